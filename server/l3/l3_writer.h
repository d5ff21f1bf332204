// L3Writer: L2 -> L3 writes under the write policies and the tiers' admission filters
// (DESIGN.md "Engine data path" step 4; proto WritePolicy).
//
//   write_through            a page is written to every tier as soon as it is committed in L2;
//   write_through_selective  once its L2 hits (Match) reach storage.selective_hits;
//   write_back               when it is evicted from L2 (the slot is kept until the write ends);
//   l2_only                  never.
// A tier's admission filter (admit_after=N) holds a page back from that tier until it has N L2
// hits, whatever the policy (write_back: pages evicted with fewer hits are not written there).
//
// Safety of the bytes: a write reads the page's L2 slot while the backend runs. The page is
// pinned in the index for that time under an owner id of its own with no lease deadline, so
// eviction can never free (and reuse) a slot under a write; a write-back write owns the evicted
// slot and frees it when the backend is done. A page that left L2 before it could be pinned is
// not written (counted not_resident).
//
// Backpressure: at most storage.max_pending_write_bytes are in flight; writes past it are
// dropped and counted, never queued without bound and never waited for. No engine RPC waits on
// a write: Backup completes when the page is in L2.
//
// Every object written records its page's parent link in its header (the parent's key, or "first
// page"), read from the index while the page is pinned (write-back: when it was committed), so
// that a file tier scanned after a restart puts it back in the tree (storage/object_format.h).
//
// Pages held back (selective, admission, write_back) are remembered in a bounded table (key ->
// policy, hits, tiers written, parent); when it is full new pages are not tracked (counted).
//
// Threads: OnCommitted from the op completion thread, OnL2Hits from Match handlers, OnEvicted
// from whichever thread evicts; write callbacks on backend threads. One mutex guards the table;
// no index, pool or backend call is made under it.
#ifndef KVCELLAR_SERVER_L3_L3_WRITER_H_
#define KVCELLAR_SERVER_L3_L3_WRITER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/radix_index.h"
#include "kvcellar/v1/common.pb.h"
#include "server/metrics/cache_metrics.h"
#include "server/config/config.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_tiers.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

class L3Writer final : public L2EvictionObserver {
 public:
  // Every pointer outlives the writer. `next_id` names write owners in the index (the daemon's id
  // sequence, so they never collide with pins or ops).
  L3Writer(L3Tiers* tiers, L2Space* l2, std::function<uint64_t()> next_id, CacheMetrics* metrics,
           const StorageConfig& config);
  // Waits for every write in flight (the backends bound it by their timeouts).
  ~L3Writer() override;
  L3Writer(const L3Writer&) = delete;
  L3Writer& operator=(const L3Writer&) = delete;

  // The policy a Backup's UNSPECIFIED means.
  v1::WritePolicy default_policy() const { return default_policy_; }
  v1::WritePolicy Resolve(v1::WritePolicy p) const {
    return p == v1::WRITE_POLICY_UNSPECIFIED ? default_policy_ : p;
  }

  // A Backup committed `objects` of `ns` into L2 under `policy`.
  void OnCommitted(Namespace& ns, absl::Span<const core::ObjectId> objects,
                   v1::WritePolicy policy) ABSL_LOCKS_EXCLUDED(mu_);
  // Match found `keys` (index keys) of `ns` in L2: counts a hit on each tracked page and writes
  // the pages whose threshold this reached.
  void OnL2Hits(Namespace& ns, absl::Span<const core::PageKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // L2Space evicted `released` from `ns`: write-back pages are written, their slots taken (set
  // invalid in `released`) and freed once written.
  void OnEvicted(Namespace& ns, absl::Span<core::ReleasedObject> released) override
      ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t held_bytes() const override { return held_bytes_.load(std::memory_order_relaxed); }

  // Blocks until no write is in flight (tests, shutdown).
  void Drain() ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t pending_bytes() const { return pending_bytes_.load(std::memory_order_relaxed); }
  size_t tracked() const { return tracked_count_.load(std::memory_order_relaxed); }

 private:
  struct Tracked {
    Namespace* ns = nullptr;  // Namespaces live as long as the daemon.
    v1::WritePolicy policy = v1::WRITE_POLICY_UNSPECIFIED;
    uint32_t hits = 0;
    uint8_t written = 0;  // Tiers already written (or being written).
    // write_back: recorded in the object's header, and to index the L3 copy after eviction.
    storage::ParentLink parent;
  };
  struct Job;

  // Hits tier `t` needs before a page of `policy` is written there on a hit; 0 = at once;
  // UINT32_MAX = never on a hit (write_back, none).
  uint32_t Threshold(v1::WritePolicy policy, size_t t) const;
  uint8_t AllTiers() const { return static_cast<uint8_t>((1u << tiers_->size()) - 1); }
  // Reserves bytes for a write; false (and counts dropped) when over the limit.
  bool Reserve(uint64_t bytes, uint8_t tiers, uint64_t objects);
  // Writes resident objects of `ns` to `tiers`: pins the pages, reads their L2 slots.
  void WriteResident(Namespace& ns, std::vector<core::ObjectId> objects, uint8_t tiers);
  // Issues the puts of a job (slots already safe: pinned or owned).
  void Submit(std::shared_ptr<Job> job);
  void Finish(Job& job);

  L3Tiers* const tiers_;
  L2Space* const l2_;
  const std::function<uint64_t()> next_id_;
  CacheMetrics* const metrics_;
  const v1::WritePolicy default_policy_;
  const uint32_t selective_hits_;
  const uint64_t max_pending_bytes_;

  std::atomic<uint64_t> pending_bytes_{0};
  std::atomic<uint64_t> held_bytes_{0};  // Slot bytes of write-back jobs in flight.
  std::atomic<size_t> tracked_count_{0};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<core::PageKey, Tracked> tracked_ ABSL_GUARDED_BY(mu_);
  size_t inflight_jobs_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_WRITER_H_
