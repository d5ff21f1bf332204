// L2Space: host-pool slots for page objects, and the eviction that makes room for them.
//
// The pool (core/host_pool.h) is shared by every namespace; each namespace's index
// (core/radix_index.h) decides which of its own pages may go (unpinned, nothing in flight, leaf
// first) and hands their slots back. This class ties the two together:
//   - Allocate: a slot for a new object. When the pool has no free slot of the object's size
//     class and no free region, either the class takes a whole region from another class
//     (region release, below) or it evicts within itself: from the requesting namespace first,
//     then from other namespaces of the same class (largest first). Still nothing is NO_SPACE
//     for the caller. Pinned and in-flight pages are never evicted: the index refuses them.
//   - EnforceWatermarks: once the pool's fill passes pool.high_watermark, evicts across
//     namespaces until it is back at pool.low_watermark. Called by the housekeeper.
//
// Tenant quotas (tenants.quotas; server/session/tenant_ledger.h keeps the accounts). Each slot is
// charged to its namespace's tenant, in slot bytes, from allocation to Free (the owner record
// names the account, so Free finds it without asking the namespace).
//   - Ceiling: the charge is taken before the pool is asked (TenantAccount::TryCharge), so a
//     tenant never holds more than its ceiling. At its ceiling a tenant makes room among its own
//     pages only (the requesting namespace, then its tenant's others of the same class); if that
//     frees nothing the page is NO_SPACE (a miss for the engine, never an engine failure).
//   - Guarantee: on a full pool the victims are, in order: (1) the namespaces of tenants holding
//     more than their guarantee, in the order above (the requesting namespace first when its own
//     tenant is above its guarantee, then the others largest first); another tenant's pages are
//     taken only by whole pages that fit in its excess, so (2) no allocation of one tenant takes
//     another below its guarantee. (3) Then the requester's own tenant, even below its guarantee.
//     Watermark eviction takes only excess over guarantees, in proportion to it. Guarantees are
//     not reserved: a tenant's unused guarantee is lent to whoever allocates, and reclaimed by
//     step (1) when the tenant allocates again (the borrower is then above its own guarantee).
//   - Without quotas every tenant's guarantee is 0 and its ceiling the pool: (1) is exactly the
//     order above, and eviction behaves as it did before quotas.
//   - Exactness: evictions that take another tenant's pages down toward its guarantee are
//     serialized by reclaim_mu_ (taken only when that tenant's guarantee is not 0, off the
//     pool's fast path), so two allocations cannot both spend the same excess. Slots that an L3
//     write-back still holds after an eviction stay charged until written, so under write_back a
//     tenant may dip below its guarantee by what its pending write-backs hold. Region release
//     (another size class's pressure) does not look at tenants.
//   - Free / FreeReleased: slots the indexes let go of (Abort, eviction) go back to the pool.
//
// Region release (after CacheLib's slab release). Evicting a region's worth of pages in some
// namespace's policy order frees slots scattered over many regions and never a whole one, so a
// namespace whose objects need another size class would get nothing. Instead:
//   - When: a class with fewer regions than its fair share (the pool's regions over the classes
//     holding any, itself included) takes one from a class above its share before evicting its
//     own pages; a class at its share evicts within itself, and takes a region only when that
//     frees nothing (everything of it busy, or it holds no region) and another class holds at
//     least two regions more (or it holds none). So classes converge to equal shares of the
//     pool when all are under pressure, and no class takes a region back and forth.
//   - Which region: the host pool records each slot's owner (namespace id, page key, shard). Up
//     to kReleaseCandidates regions of the victim classes, fewest used slots first, are priced
//     by a dry run of RadixIndex::EvictHolders: the objects that would go, the region's own plus
//     the L2 descendants that prefix-closure takes with them. A region holding a busy page (or a
//     busy descendant), or a slot its index does not hold (in transit), is skipped; the cheapest
//     of the rest is chosen. Price, not age, decides: with leaf-first eviction an old region
//     holds the roots of long chains, and releasing it would take whole conversations with it.
//   - How: the region is drained (the pool allocates nothing from it any more), its pages are
//     evicted through EvictHolders (the index's one eviction path) and go through the eviction
//     observer and Free like every eviction (counted with reason region_release). The region
//     returns to the free list when its last slot is freed, and the retried Allocate takes it.
//   - Waiting: write_back keeps evicted slots until their L3 writes end, so a region may not be
//     free at once: that Allocate is NO_SPACE, and a later one finds the region free (or evicts
//     what is left in it: a page whose write was in flight). A draining region left holding a
//     page that became busy (a race with a pin after the dry run) is given back to its class.
//     At most kMaxDraining regions drain at a time, bounding the slots they strand.
//
// Threads: any thread. Dependencies are thread-safe; region releases are serialized by
// release_mu_, taken before any index or pool lock; evictions spending another tenant's excess by
// reclaim_mu_, likewise taken before any index or pool lock, and never held together with
// release_mu_. It never holds an index lock while calling the pool (the index calls nothing).
// Tenant accounts are atomics (tenant_ledger.h): the fast path (TryAllocate, Free) adds one
// atomic operation per slot and no lock.
#ifndef KVCELLAR_SERVER_L2_L2_SPACE_H_
#define KVCELLAR_SERVER_L2_L2_SPACE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/host_pool.h"
#include "core/radix_index.h"
#include "server/l2/l2_sealer.h"
#include "server/metrics/cache_metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/tenant_ledger.h"

namespace kvcellar::server {

// Told of every page L2Space evicts, before the slots are freed (server/l3/l3_writer.h: write_back).
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
  // With a journal on the pool (pool.shm_name), starts its sealer.
  // `tenants` (nullable: no per-tenant accounting or quotas) is the ledger the namespaces'
  // accounts come from.
  L2Space(core::HostPool* pool, NamespaceRegistry* namespaces, double high_watermark,
          double low_watermark, CacheMetrics* metrics, TenantLedger* tenants = nullptr);
  // Stops the sealer, which seals every landed page first.
  ~L2Space();

  // A slot for shard `shard` of page `key` of `ns` (whose geometry is fixed). On a full pool,
  // releases a region or evicts at least `evict_bytes` (at least one slot's worth) and retries,
  // as described above. ResourceExhausted when no slot can be had.
  // ResourceExhausted too when the tenant is at its ceiling and its own pages free nothing.
  absl::StatusOr<core::SlotRef> Allocate(Namespace& ns, const core::PageKey& key, uint16_t shard,
                                         uint64_t evict_bytes);
  // The data path's first try: a free slot, charged to the tenant, without evicting anything.
  // ResourceExhausted when the pool has none free or the tenant is at its ceiling: then Allocate.
  // Takes the pool's class mutex and one atomic operation on the tenant's account.
  absl::StatusOr<core::SlotRef> TryAllocate(Namespace& ns, const core::PageKey& key,
                                            uint16_t shard);
  // The owner record of that object (what Allocate stores with the slot).
  core::SlotOwner Owner(const Namespace& ns, const core::PageKey& key, uint16_t shard) const {
    const TenantAccount* account = AccountOf(ns);
    return core::SlotOwner{key, ns.id(), shard,
                           account != nullptr ? account->number() : uint16_t{0}};
  }

  void Free(core::SlotRef slot);

  // Warm restart records (core/slot_journal.h, through the pool's journal); no-ops without one.
  // A write into the slot of `w` began (after the index accepted it).
  void JournalWriting(const Namespace& ns, const core::WriteRequest& w);
  // Every byte of the object in `slot` has landed: LANDED, and queued for the sealer (its
  // CRC-32C, then COMMITTED, off the data path: l2/l2_sealer.h). Called before the index commits
  // the object, so a recorded page is one whose bytes were whole.
  void JournalCommitted(const Namespace& ns, core::SlotRef slot);
  // nullptr without a journal.
  const L2Sealer* sealer() const { return sealer_.get(); }
  // Frees every valid slot of `released`.
  void FreeReleased(absl::Span<const core::ReleasedObject> released);

  // Brings the pool back to the low watermark when it is above the high one. Returns bytes freed.
  uint64_t EnforceWatermarks();

  // Set once before serving, cleared before the observer is destroyed; nullptr: none.
  void set_eviction_observer(L2EvictionObserver* observer) {
    observer_.store(observer, std::memory_order_release);
  }
  // AdminService.Evict on one namespace: RadixIndex::EvictScope (the policy's order, leaf first,
  // never busy pages); the eviction observer writes WRITE_BACK pages to L3 as on every eviction
  // (their count is added to `written_back_pages` when given), the other slots go back to the
  // pool, and the eviction is counted as every eviction is. `max_objects` 0: everything eligible.
  core::AdminEvictResult EvictScope(Namespace& ns, const std::optional<core::PageKey>& subtree,
                                    uint64_t max_objects, bool dry_run,
                                    uint64_t* written_back_pages = nullptr);
  // AdminService.Clear on one namespace: RadixIndex::ClearScope, slots freed, counted. Busy pages
  // are doomed and freed later by ReapDoomed. With dry_run nothing changes; `removed` (optional)
  // receives the objects that went or would go.
  core::RemoveCounts ClearScope(Namespace& ns, const std::optional<core::PageKey>& subtree,
                                bool dry_run, std::vector<core::ReleasedObject>* removed);
  // Frees the pages Clear doomed whose copies have ended (the housekeeper). Returns pages.
  size_t ReapDoomed();

  // Bytes of slots in use (slot capacity, not object bytes), summed over size classes.
  uint64_t UsedBytes() const;
  // Regions released to another size class since start.
  uint64_t regions_released() const { return regions_released_.load(std::memory_order_relaxed); }
  core::HostPool* pool() const { return pool_; }
  // nullptr without per-tenant accounting.
  TenantLedger* tenants() const { return tenants_; }

 private:
  // The account `ns` is charged to; nullptr without a ledger.
  TenantAccount* AccountOf(const Namespace& ns) const {
    return tenants_ != nullptr ? ns.tenant_account() : nullptr;
  }
  // Allocate once the tenant's charge is taken: the pool, region release, eviction in class.
  absl::StatusOr<core::SlotRef> AllocateCharged(Namespace& ns, const core::PageKey& key,
                                                uint16_t shard, uint64_t evict_bytes);
  // Evicts up to `bytes` of `victim`'s pages for another tenant's allocation, never taking its
  // tenant below its guarantee (whole pages within its excess). Returns bytes freed.
  uint64_t EvictForOther(Namespace& victim, uint64_t bytes, EvictReason reason,
                         TenantEvictCause cause) ABSL_LOCKS_EXCLUDED(reclaim_mu_);
  // Frees the valid slots of objects an admin Clear removed and counts them as cleared.
  void FreeCleared(Namespace& ns, absl::Span<const core::ReleasedObject> released);
  // Regions priced by a dry run per release, and regions draining at once (see above).
  static constexpr size_t kReleaseCandidates = 8;
  static constexpr uint32_t kMaxDraining = 2;

  // What evicting the pages of one region did (or, dry, would do).
  struct RegionEviction {
    uint64_t objects = 0;  // Objects evicted, in the region or not.
    uint64_t pages = 0;
    bool blocked = false;  // A page stays: busy, a busy descendant, or an unknown owner.
    bool waiting = false;  // A slot its index does not hold: in transit or held by the observer.
  };

  // Evicts about `bytes` from `ns`, frees the slots and counts them. Returns bytes freed.
  uint64_t EvictFrom(Namespace& ns, uint64_t bytes, EvictReason reason, TenantEvictCause cause);
  // After an index let go of `evicted`: the observer, Free, the counters. Returns bytes freed.
  uint64_t FinishEviction(Namespace& ns, std::vector<core::ReleasedObject>& evicted,
                          EvictReason reason, TenantEvictCause cause);
  // Class `c` is out of slots and the pool of regions: releases a region of another class for
  // it and allocates. `anyway`: c could evict nothing of its own (see "When" above).
  absl::StatusOr<core::SlotRef> ReleaseRegionFor(uint16_t c, const core::SlotOwner& owner,
                                                 bool anyway) ABSL_LOCKS_EXCLUDED(release_mu_);
  // Whether class c holds fewer regions than its fair share.
  bool UnderShare(uint16_t c) const;
  // Evicts (or prices) the pages holding slots of region r (class `size_class`).
  RegionEviction EvictRegion(uint32_t r, uint16_t size_class, bool dry_run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(release_mu_);

  core::HostPool* const pool_;
  NamespaceRegistry* const namespaces_;
  const double high_watermark_;
  const double low_watermark_;
  CacheMetrics* const metrics_;
  TenantLedger* const tenants_;
  std::atomic<L2EvictionObserver*> observer_{nullptr};
  // Serializes evictions that spend another tenant's excess over a non-zero guarantee.
  absl::Mutex reclaim_mu_;
  absl::Mutex release_mu_;
  std::atomic<uint64_t> regions_released_{0};
  std::unique_ptr<L2Sealer> sealer_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L2_L2_SPACE_H_
