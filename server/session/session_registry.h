// Sessions: one per registered engine rank (WORKER) or scheduler process (SCHEDULER), grouped by
// engine instance, each alive while its lease is renewed (docs/api.md, "Concepts").
//
// A Session holds what its registration fixed (namespace, shard, block count, completion slots,
// the device mapping of its KV memory) and what its data ops borrow from it while they run: the
// device blocks and load slot of every unfinished op (a later Load or Backup naming one of them
// is BLOCK_BUSY / SLOT_BUSY, because the engine would otherwise overwrite bytes the daemon is
// still copying), and a count of ops in flight (TOO_MANY_OPS past the limit).
//
// Closing (UnregisterEngine, lease expiry, replacement) is two steps so that the daemon never
// touches engine memory after it says it is done: Close() stops new reservations and waits for
// submissions already past their reservation, then hands back the EngineMapping; the caller
// cancels the session's ops and destroys the mapping, which waits for copies in progress.
//
// SessionRegistry maps ids to sessions and keeps instances consistent: every session of an
// instance has the same namespace and TP size (else GROUP_MISMATCH), and one live session per
// (instance, rank) for workers or per (instance, SCHEDULER) (else SESSION_EXISTS unless
// replace_existing). A session whose lease has lapsed is unknown to Find at once, before the
// housekeeper reaps it (TakeExpired).
//
// Threads: any gRPC handler, the op completion thread and the housekeeper. Lock order: the
// registry's mutex before a session's; a session's mutex is a leaf.
#ifndef KVCELLAR_SERVER_SESSION_SESSION_REGISTRY_H_
#define KVCELLAR_SERVER_SESSION_SESSION_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/session/namespace_registry.h"
#include "server/session/peer_identity.h"
#include "server/session/sim_counter_channel.h"

namespace kvcellar::server {

// What a registration fixed. Immutable for the session's life.
struct SessionInfo {
  uint64_t id = 0;
  std::string instance_id;
  uint32_t rank = 0;  // 0 for schedulers.
  v1::SessionRole role = v1::SESSION_ROLE_WORKER;
  std::shared_ptr<Namespace> ns;
  uint16_t shard = 0;         // The shard this rank reads and writes.
  bool shard_writer = false;  // MHA: every worker; MLA: rank 0.
  uint32_t tp_size = 1;
  // What checking a Backup's token_ids needs of the namespace (FillSessionGeometry).
  uint32_t page_size = 0;
  bool opaque_keys = false;
  core::PageKey ns_digest;
  // The kind of each KV group of a hybrid namespace, whose Loads and Backups name group_blocks;
  // empty otherwise (device_blocks).
  std::vector<core::GroupKind> group_kinds;
  v1::DeviceKind device_kind = v1::DEVICE_KIND_UNSPECIFIED;
  uint32_t num_blocks = 0;
  // A hybrid layout whose groups have block pools of their own (KvLayout::group_num_blocks): the
  // blocks of each group, and where its blocks start in the one numbering of all groups' blocks
  // that BLOCK_BUSY and repeats are checked in. Empty: the groups share num_blocks.
  std::vector<uint32_t> group_num_blocks;
  std::vector<uint32_t> group_block_base;
  uint32_t num_layers = 0;
  uint32_t num_load_slots = 0;
  uint32_t num_ready_slots = 0;
  // CUDA: the 64-byte IPC handle of each ready event, by ready slot.
  std::vector<std::string> cuda_ready_events;
  // SIM: the engine's signal counters, or nullptr when it registered none.
  std::shared_ptr<SimCounterChannel> sim_signals;
  // Who registered the session (the transport's proof, not the request's word): the only
  // identity that may use it.
  PeerIdentity owner;
  // For listings and logs.
  uint32_t pid = 0;
  std::string engine_name;
  std::string client_version;
  absl::Time registered;

  bool is_worker() const { return role != v1::SESSION_ROLE_SCHEDULER; }
  // Valid block indices of group g are [0, GroupBlocks(g)).
  uint32_t GroupBlocks(size_t g) const {
    return group_num_blocks.empty() ? num_blocks : group_num_blocks[g];
  }
  // Group g's block b in the numbering busy blocks are tracked in: b itself when the groups share
  // one pool (a block is one group's at a time), else after the blocks of groups 0..g-1.
  uint32_t BusyBlock(size_t g, uint32_t b) const {
    return group_block_base.empty() ? b : group_block_base[g] + b;
  }
};

class Session {
 public:
  Session(SessionInfo info, std::unique_ptr<gpu::EngineMapping> mapping, absl::Time lease_deadline);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const SessionInfo& info() const { return info_; }
  uint64_t id() const { return info_.id; }

  // The device mapping; use only between a successful Reserve() and its EndSubmission(), which
  // keeps Close() from taking it away. nullptr for schedulers.
  gpu::EngineMapping* mapping() const { return mapping_.get(); }

  absl::Time lease_deadline() const ABSL_LOCKS_EXCLUDED(mu_);
  void Renew(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // Starts a submission: checks, all or nothing, that the session is open (else SESSION_UNKNOWN),
  // that it has fewer than `max_inflight` unfinished ops (TOO_MANY_OPS), that no block of
  // `blocks` (the request's blocks in request order; `block_field(i)` names blocks[i]) is used by
  // an unfinished op (BLOCK_BUSY) and that `slot` is free (SLOT_BUSY, naming `slot_field`); then
  // takes them all and counts one op in flight. Must be followed by EndSubmission().
  absl::Status Reserve(absl::Span<const uint32_t> blocks,
                       absl::FunctionRef<std::string(size_t)> block_field,
                       std::optional<uint32_t> slot, absl::string_view slot_field,
                       uint32_t max_inflight) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns blocks (and the slot) that the op turned out not to use, or that a finished op used.
  void ReleaseBlocks(absl::Span<const uint32_t> blocks) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseSlot(uint32_t slot) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the submission begun by Reserve. `op_started` false: the op was never created (submit
  // failed), so its in-flight count is returned too.
  void EndSubmission(bool op_started) ABSL_LOCKS_EXCLUDED(mu_);
  // An op of this session reached a terminal state.
  void OpFinished() ABSL_LOCKS_EXCLUDED(mu_);

  // Stops new submissions, waits for those in progress, and hands over the mapping (nullptr for
  // schedulers or a second call). The caller finishes the session's ops and then destroys it.
  std::unique_ptr<gpu::EngineMapping> Close() ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const ABSL_LOCKS_EXCLUDED(mu_);

  // For listings: ops in flight and device blocks in use.
  uint32_t inflight_ops() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t busy_blocks() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const SessionInfo info_;
  // Set at construction; moved out by Close() once no submission uses it.
  std::unique_ptr<gpu::EngineMapping> mapping_;

  mutable absl::Mutex mu_;
  absl::Time lease_deadline_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t submitting_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t inflight_ops_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint32_t> busy_blocks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint32_t> busy_slots_ ABSL_GUARDED_BY(mu_);
};

class SessionRegistry {
 public:
  SessionRegistry() = default;

  // A random, non-zero id no live session has (the id is the client's credential).
  uint64_t NewSessionId() ABSL_LOCKS_EXCLUDED(mu_);

  // The checks Add() makes, without adding: lets RegisterEngine fail fast before it maps memory.
  absl::Status CheckAdd(const SessionInfo& info, bool replace_existing) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Adds `session`. With replace_existing, a live session holding the same (instance, rank) is
  // removed and returned in `*replaced` (the caller ends it); the instance keeps living through
  // the replacement. A holder whose lease has lapsed is replaced whatever replace_existing says.
  absl::Status Add(std::shared_ptr<Session> session, bool replace_existing,
                   std::shared_ptr<Session>* replaced) ABSL_LOCKS_EXCLUDED(mu_);

  // The live session `id`, or nullptr when unknown or its lease has lapsed at `now`.
  std::shared_ptr<Session> Find(uint64_t id, absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);

  struct Removed {
    std::shared_ptr<Session> session;
    bool last_of_instance = false;
  };
  // Removes `id` (nullptr session when unknown).
  Removed Remove(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every session whose lease lapsed at `now`.
  std::vector<Removed> TakeExpired(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every session (daemon shutdown).
  std::vector<Removed> TakeAll() ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::shared_ptr<Session>> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t sessions() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t instances() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the instance has a live session.
  bool HasInstance(const std::string& instance_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Instance {
    core::PageKey ns_digest;
    uint32_t tp_size = 0;
    std::vector<std::shared_ptr<Session>> sessions;
  };

  // The live session of `instance` holding `info`'s (rank or scheduler) seat, or nullptr.
  static std::shared_ptr<Session> Holder(const Instance& instance, const SessionInfo& info);
  absl::Status CheckAddLocked(const SessionInfo& info, bool replace_existing) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  Removed RemoveLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Instance> instances_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_SESSION_REGISTRY_H_
