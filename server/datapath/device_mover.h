// DeviceMover: the copies between engine device blocks and L2 page objects. Turns a validated
// Load or Backup into one batched device op and finishes it (DESIGN.md "Engine data path").
//
// Load (L2 -> device), per sequence: the leading pages whose whole TP group is committed in L2
// are pinned for the copy (owner = the op id, so eviction can never free a slot under a copy) and
// scattered into the engine's blocks; the first page that is not is MISS (IN_FLIGHT when a write
// of it is unfinished) and the rest SKIPPED. One SubmitScatter per RPC; with signal_layers the
// engine's layer words get the op id layer by layer as they land (SimSignalPump), and every layer
// plus the op word once the op is terminal. When it ends: copy pins dropped, blocks and slot
// returned to the session, this rank's hold on the Match pin dropped when release_pin says so.
//
// Hybrid namespaces (docs/api.md "Groups") move one object per (page, group) the request names:
// a Load copies all of a sequence's or none of it, a Backup stores or fails each page whole.
//
// Backup (device -> L2), per sequence, in order: a page whose shard is committed is
// ALREADY_PRESENT and one being written by another op IN_FLIGHT (dedup: not copied); otherwise a
// slot of the namespace's object size is allocated (on a full pool, unpinned leaf pages are
// evicted and the allocation retried; still nothing is NO_SPACE) and the page enters the index as
// in flight (BeginWrite: invisible to Match). A page whose parent is not indexed is
// PARENT_MISSING. The first page that fails ends the sequence: the rest are SKIPPED. One
// SubmitGather per RPC, behind the engine's ready signal (SIM: submitted only once the ready word
// reaches the token, or TIMEOUT; CUDA: the device waits on the IPC event). When it ends: every
// page is committed (visible once its group is complete) or, on failure, aborted and its slot
// freed.
//
// Threads: any gRPC handler submits; OpTable's completion thread (or a closing session) finishes.
// Holds no lock of its own; the index, pool, session and tables it calls are thread-safe.
#ifndef KVCELLAR_SERVER_DATAPATH_DEVICE_MOVER_H_
#define KVCELLAR_SERVER_DATAPATH_DEVICE_MOVER_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/config/cache_limits.h"
#include "server/datapath/device_set.h"
#include "server/datapath/sim_signal_pump.h"
#include "server/events/label_log.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_writer.h"
#include "server/metrics/cache_metrics.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

class DeviceMover {
 public:
  // Every pointer outlives the mover. A session's copies go to the backend of its device_kind in
  // `devices`. `writer` (may be nullptr) is told of every committed Backup.
  DeviceMover(const DeviceSet* devices, L2Space* l2, PinTable* pins, OpTable* ops,
              SimSignalPump* pump, CacheMetrics* metrics, const CacheLimits* limits,
              L3Writer* writer = nullptr);

  // Where the labels LabelPages attaches are recorded for a restart (events.label_log); nullptr:
  // nowhere. Set before serving; outlives the mover.
  void set_label_log(LabelLog* log) { label_log_ = log; }

  // The request passed ValidateLoad / ValidateBackup. Errors: the session's reservation errors
  // (SESSION_UNKNOWN, TOO_MANY_OPS, BLOCK_BUSY, SLOT_BUSY) with nothing changed, or INTERNAL when
  // the device refused the batch (nothing copied, everything undone). Otherwise the op, already
  // in the OpTable.
  absl::StatusOr<std::shared_ptr<OpRecord>> Load(const std::shared_ptr<Session>& session,
                                                 const v1::LoadRequest& request);
  absl::StatusOr<std::shared_ptr<OpRecord>> Backup(const std::shared_ptr<Session>& session,
                                                   const v1::BackupRequest& request);

 private:
  // A Backup's pages from planning to submission.
  struct BackupBatch;

  // The phases of Backup, in order.
  // The index keys of the request's pages and each sequence's parent.
  void BackupKeys(BackupBatch& batch, const v1::BackupRequest& request);
  // The objects committed already: not copied again.
  void FindPresent(BackupBatch& batch);
  // While events publish: each page's label (its tokens, an opaque-key engine's own hash), kept
  // by the index for the page's events (limits_->max_token_bytes per namespace).
  void LabelPages(BackupBatch& batch, const v1::BackupRequest& request);
  // An L2 slot for each object to store, evicting if need be; a sequence stops at its first
  // object without one.
  void AllocateSlots(BackupBatch& batch);
  // After BeginWrite: each page's status, the copies to make, and what to give back (slots of
  // refused writes, pages after a hole, unused device blocks). A page of several objects (a
  // hybrid's groups) fails whole when one of them does.
  void SettlePages(BackupBatch& batch, absl::Span<const absl::Status> begun);
  // The status of object k's page when the index refused its write; sets `failed` when its
  // sequence stops.
  uint8_t RefusedWriteStatus(BackupBatch& batch, uint32_t k, const absl::Status& begun,
                             bool* failed);
  // The copies submitted to the device (gated on the engine's ready word or event when asked);
  // on a refusal everything of the batch is undone and the error returned.
  absl::Status SubmitBackupCopy(BackupBatch& batch, const v1::BackupRequest& request);

  const DeviceSet* const devices_;
  L2Space* const l2_;
  PinTable* const pins_;
  OpTable* const ops_;
  SimSignalPump* const pump_;
  CacheMetrics* const metrics_;
  const CacheLimits* const limits_;
  L3Writer* const writer_;
  LabelLog* label_log_ = nullptr;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_DATAPATH_DEVICE_MOVER_H_
