// L2Space: host-pool slots for page objects, and the eviction that makes room for them.
//
// The pool (core/host_pool.h) is shared by every namespace; each namespace's index
// (core/radix_index.h) decides which of its own pages may go (unpinned, nothing in flight, leaf
// first) and hands their slots back. This class ties the two together:
//   - Allocate: a slot for a new object. When the pool is out of slots it evicts from the
//     requesting namespace first (its slots have the right size class), then from the others
//     (largest first), frees what they release and retries; still nothing is NO_SPACE for the
//     caller. Pinned and in-flight pages are never evicted: the index refuses them.
//   - EnforceWatermarks: once the pool's fill passes pool.high_watermark, evicts across
//     namespaces until it is back at pool.low_watermark. Called by the housekeeper.
//   - Free / FreeReleased: slots the indexes let go of (Abort, eviction) go back to the pool.
//
// Threads: any thread. The class has no state of its own beyond its dependencies, which are
// thread-safe; it never holds an index lock while calling the pool (the index calls nothing).
#ifndef KVCELLAR_SERVER_L2_SPACE_H_
#define KVCELLAR_SERVER_L2_SPACE_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/host_pool.h"
#include "core/radix_index.h"
#include "server/cache_metrics.h"
#include "server/namespace_registry.h"

namespace kvcellar::server {

// Told of every page L2Space evicts, before the slots are freed (server/l3_writer.h: write_back).
class L2EvictionObserver {
 public:
  virtual ~L2EvictionObserver() = default;
  // May take a slot: it sets that object's `slot` invalid and frees it later through Free().
  virtual void OnEvicted(Namespace& ns, absl::Span<core::ReleasedObject> released) = 0;
  // Slot bytes taken and not freed yet: already evicted, so watermark eviction does not count
  // them again (it would evict more pages than it needs while the writes run).
  virtual uint64_t held_bytes() const = 0;
};

class L2Space {
 public:
  // Every pointer outlives this object. Watermarks are fractions of the pool capacity.
  L2Space(core::HostPool* pool, NamespaceRegistry* namespaces, double high_watermark,
          double low_watermark, CacheMetrics* metrics);

  // A slot for one object of `ns` (whose geometry is fixed). On a full pool, evicts at least
  // `evict_bytes` (at least one slot's worth) and retries, as described above.
  // ResourceExhausted when no slot can be had.
  absl::StatusOr<core::SlotRef> Allocate(Namespace& ns, uint64_t evict_bytes);

  void Free(core::SlotRef slot);
  // Frees every valid slot of `released`.
  void FreeReleased(absl::Span<const core::ReleasedObject> released);

  // Brings the pool back to the low watermark when it is above the high one. Returns bytes freed.
  uint64_t EnforceWatermarks();

  // Set once before serving, cleared before the observer is destroyed; nullptr: none.
  void set_eviction_observer(L2EvictionObserver* observer) {
    observer_.store(observer, std::memory_order_release);
  }
  // AdminService.Evict on one namespace: RadixIndex::EvictScope (the policy's order, leaf first,
  // never busy pages), then the slots go back to the pool and the eviction is counted as every
  // eviction is. `max_objects` 0: everything eligible.
  core::AdminEvictResult EvictScope(Namespace& ns, const std::optional<core::PageKey>& subtree,
                                    uint64_t max_objects, bool dry_run);
  // AdminService.Clear on one namespace: RadixIndex::ClearScope, slots freed, counted. Busy pages
  // are doomed and freed later by ReapDoomed. With dry_run nothing changes; `removed` (optional)
  // receives the objects that went or would go.
  core::RemoveCounts ClearScope(Namespace& ns, const std::optional<core::PageKey>& subtree,
                                bool dry_run, std::vector<core::ReleasedObject>* removed);
  // Frees the pages Clear doomed whose copies have ended (the housekeeper). Returns pages.
  size_t ReapDoomed();

  // Bytes of slots in use (slot capacity, not object bytes), summed over size classes.
  uint64_t UsedBytes() const;
  core::HostPool* pool() const { return pool_; }

 private:
  // Frees the valid slots of objects an admin Clear removed and counts them as cleared.
  void FreeCleared(Namespace& ns, absl::Span<const core::ReleasedObject> released);
  // Evicts about `bytes` from `ns`, frees the slots and counts them. Returns bytes freed.
  uint64_t EvictFrom(Namespace& ns, uint64_t bytes, EvictReason reason);

  core::HostPool* const pool_;
  NamespaceRegistry* const namespaces_;
  const double high_watermark_;
  const double low_watermark_;
  CacheMetrics* const metrics_;
  std::atomic<L2EvictionObserver*> observer_{nullptr};
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L2_SPACE_H_
