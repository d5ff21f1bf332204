// HostPool: the L2 tier's memory, one large block of host memory carved into fixed-size slots.
//
// The daemon keeps every L2 page object (one page of one shard, all layers) in a slot of this
// pool. The pool does not map its memory: its caller does, once at startup (the daemon maps it
// with platform/host_memory.h, huge pages where available), and hands it over, so that this file
// makes no system call and is tested on plain heap memory. One block lets the GPU layer register
// it with CUDA in a few large chunks (ForEachChunk) instead of per object. Slots come in size
// classes so namespaces with different object sizes share one pool. The allocator is
// CacheLib-style: the memory is split into equal regions; a class with no free slot takes a whole
// free region and carves it into its slot size, and hands the region back once all its slots are
// free. Allocate and Free are O(1), take one size class's mutex, never allocate heap memory in
// the steady state, and make no system call unless a mutex is contended. The pool never touches
// slot bytes itself.
//
// Warm restart: when the memory is a named shared memory object (platform::HostMemory with a
// shm_name) it outlives the daemon, and a restarted daemon with the same geometry re-attaches the
// same bytes. The allocator's state is not kept there: a slot journal (core/slot_journal.h, a
// second small shm object) records per slot whose object it holds, and a restarted daemon hands
// the slots whose records and bytes verify back to a fresh pool with Restore before it serves
// (server/l2/l2_recovery.h). Free clears the slot's record (set_journal) before the slot can be
// handed out again, so a record never outlives its object.
//
// Owners and region release. Whoever allocates a slot may say whose object it holds (SlotOwner:
// namespace id, page key, shard). The pool stores that record with the slot and never reads it; it
// is what lets the server find the pages living in one region, evict exactly them and so move the
// region to another size class (server/l2/l2_space.h, "region release", after CacheLib's slab
// release). Cost: 40 bytes per slot, allocated with a region's other per-slot arrays the first
// time a class uses it: at most 40 / 64 KiB = 0.06% of the pool with the default classes (the
// smallest is 64 KiB), 1% with a 4 KiB class. A region being released is *draining*: no slot of
// it is handed out any more, and once its last slot is freed it returns to the free list.
//
// Threading: every method may be called from any thread. Allocate, Free and Owns lock the mutex of
// one size class, plus the free-region mutex when a region changes hands (order: class mutex,
// then free-region mutex). ClassFor, Address, SlotBytes and the geometry accessors lock nothing.
// Stats locks each class in turn, so it is not one atomic snapshot across classes.
#ifndef KVCELLAR_CORE_HOST_POOL_H_
#define KVCELLAR_CORE_HOST_POOL_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/page_key.h"
#include "core/slot_ref.h"

namespace kvcellar::core {

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;

// Every slot size is a multiple of this, so every slot starts on a 4 KiB page boundary: O_DIRECT
// reads and writes in storage/ need page-aligned buffers and lengths.
inline constexpr uint64_t kSlotAlignment = 4 * kKiB;

// 64 MiB regions: (1) SlotRef.region is 16 bits, so a pool has at most 65536 regions, and 64 MiB
// allows pools up to 4 TiB; (2) it holds the largest default class (64 MiB) exactly once;
// (3) it is a multiple of the 2 MiB huge page and of any CUDA registration granularity; (4) a
// class grows and shrinks by 64 MiB at a time, small next to pools of tens to hundreds of GiB,
// so memory moves between classes without much stranded in half-used regions.
inline constexpr uint64_t kDefaultRegionBytes = 64 * kMiB;

struct HostPoolOptions {
  // Rounded down to a whole number of regions; at least one region.
  uint64_t capacity_bytes = 0;
  // Multiple of kSlotAlignment and at least the largest slot size. See kDefaultRegionBytes.
  uint64_t region_bytes = kDefaultRegionBytes;
  // Size classes: strictly increasing multiples of kSlotAlignment, each <= region_bytes. Empty
  // means DefaultSlotSizes(region_bytes). Listing the object sizes of the namespaces actually
  // served wastes nothing; the defaults waste up to ~20% of a slot.
  std::vector<uint64_t> slot_sizes;
  // Nonzero when the memory will be hugetlb pages of this size (the daemon's huge_pages=on): every
  // region must then be whole huge pages, so that each region, and each chunk ForEachChunk cuts
  // on region boundaries, starts on a huge page. 0: no constraint.
  uint64_t huge_page_bytes = 0;
};

// Whose object a slot holds, recorded at Allocate. `ns` 0 means no owner was given. `tenant`:
// the number of the tenant account charged for the slot (server/session/tenant_ledger.h), 0 for
// none; it fills what was padding, so a record is still 40 bytes.
struct SlotOwner {
  PageKey key;
  uint32_t ns = 0;
  uint16_t shard = 0;
  uint16_t tenant = 0;
};
static_assert(sizeof(SlotOwner) == 40, "the per-slot cost stated above");

// One allocated slot of a region and its owner record.
struct OwnedSlot {
  SlotRef slot;
  SlotOwner owner;
};

// A region's state at one moment (RegionInfos).
struct RegionInfo {
  uint32_t region = 0;
  uint16_t size_class = 0;
  uint32_t used = 0;
  uint32_t slots_per_region = 0;
  bool draining = false;
};

struct SizeClassStats {
  uint16_t size_class = 0;
  uint64_t slot_bytes = 0;
  uint32_t slots_per_region = 0;
  uint32_t regions = 0;      // Regions currently assigned to this class.
  uint64_t slots_total = 0;  // regions * slots_per_region.
  uint64_t slots_used = 0;
  uint64_t bytes_used = 0;  // slots_used * slot_bytes (slot capacity, not object bytes).
};

class SlotJournal;

class HostPool {
 public:
  // Called with one chunk of the pool's memory; see ForEachChunk.
  using RegionHook = std::function<absl::Status(void* base, uint64_t bytes)>;

  // Validates the options (errors name the bad option) and returns the bytes of memory a pool of
  // them carves: capacity_bytes rounded down to whole regions. The caller maps that much.
  static absl::StatusOr<uint64_t> MemoryBytes(const HostPoolOptions& options);

  // An empty allocator over `memory`, which the caller mapped and keeps mapped for the pool's
  // life: at least MemoryBytes(options) bytes (any tail past them is left unused), starting on a
  // kSlotAlignment boundary. Memory that still holds a previous pool's bytes (a re-attached shm
  // object) gives an empty pool too: its bytes survive, its allocations do not.
  static absl::StatusOr<std::unique_ptr<HostPool>> Create(const HostPoolOptions& options,
                                                          std::span<uint8_t> memory);

  // An empty allocator over zeroed heap memory the pool owns: for tests, benchmarks and tools,
  // which need neither huge pages nor warm restart.
  static absl::StatusOr<std::unique_ptr<HostPool>> Create(const HostPoolOptions& options);

  // The default size classes, 64 KiB to min(64 MiB, region_bytes): the powers of two (KV objects
  // often are one) merged with a series of steps of at most 1.25x, each the largest 4 KiB
  // multiple that fits a whole number of slots in a region (at 64 MiB regions: 38 classes, less
  // than 0.5% of any region unused, at most 20% of a slot unused below 16 MiB).
  static std::vector<uint64_t> DefaultSlotSizes(uint64_t region_bytes);

  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // The smallest class whose slots hold object_bytes. InvalidArgument for 0 or for a size larger
  // than the largest class (the message names both).
  absl::StatusOr<uint16_t> ClassFor(uint64_t object_bytes) const;

  // A free slot of ClassFor(object_bytes). ResourceExhausted when that class has no free slot
  // and the pool has no free region: the caller evicts and retries.
  // `owner` is stored with the slot (see "Owners" above); without one the slot's record is empty,
  // and region release cannot tell whose it is.
  absl::StatusOr<SlotRef> Allocate(uint64_t object_bytes, const SlotOwner& owner = {});
  absl::StatusOr<SlotRef> AllocateInClass(uint16_t size_class, const SlotOwner& owner = {});

  // Returns a slot. A ref that names no slot of this pool is InvalidArgument; a slot that is not
  // currently allocated (double free, or a stale ref into a region that has since changed hands)
  // is FailedPrecondition. Either way nothing changes: accounting stays exact. Errors are values
  // rather than aborts because the caller (the index) can log and count them and keep serving.
  // `owner` (optional) receives the freed slot's owner record, on success only.
  absl::Status Free(SlotRef ref, SlotOwner* owner = nullptr);

  // True when `ref` names a slot of this pool that is currently allocated.
  bool Owns(SlotRef ref) const;

  // Warm restart: marks `slots` allocated, with their owner records, in a pool nothing has been
  // allocated from yet. Each slot's region is assigned to the slot's class. InvalidArgument when
  // a slot names no slot of the pool, appears twice, or its region is named by two classes;
  // FailedPrecondition when the pool is in use. Nothing changes on error.
  absl::Status Restore(std::span<const OwnedSlot> slots);

  // The journal whose record of a slot Free clears before the slot can be reused; nullptr: none.
  // Set before the pool is shared between threads; the journal outlives the pool.
  void set_journal(SlotJournal* journal) { journal_ = journal; }
  SlotJournal* journal() const { return journal_; }

  // The slot's first byte. `ref` must be a live allocation of this pool (unchecked: hot path).
  uint8_t* Address(SlotRef ref) const {
    return base_ + uint64_t{ref.region} * region_bytes_ +
           uint64_t{ref.index} * slot_sizes_[ref.size_class];
  }
  // Capacity of the slot (its class's slot size), not the size of the object stored in it.
  uint64_t SlotBytes(SlotRef ref) const { return slot_sizes_[ref.size_class]; }

  // Calls `hook` over the pool's whole memory in order, in chunks of chunk_bytes rounded down to
  // whole regions (at least one region; 0 means all of it in one call), so every chunk starts and
  // ends on a region boundary and no slot straddles two chunks. Meant for cudaHostRegister.
  // Stops at the first error and returns it, prefixed with the chunk's offset.
  absl::Status ForEachChunk(uint64_t chunk_bytes, const RegionHook& hook) const;

  std::vector<SizeClassStats> Stats() const;
  uint32_t FreeRegions() const;

  // Region release. Every assigned region (free ones are left out), class by class; not one
  // atomic snapshot. O(regions).
  std::vector<RegionInfo> RegionInfos() const;
  // Appends the allocated slots of region `r` and their owner records to `slots`.
  // FailedPrecondition when the region is not (any more) of class `size_class`: it may have
  // emptied and changed hands meanwhile.
  absl::Status RegionSlots(uint32_t r, uint16_t size_class, std::vector<OwnedSlot>* slots) const;
  // Starts draining region `r` of class `size_class` (no-op if it already is): no slot of it is
  // allocated from now on; once its last slot is freed it returns to the free list. Errors as
  // RegionSlots.
  absl::Status DrainRegion(uint32_t r, uint16_t size_class);
  // Gives up draining `r`: its free slots serve its class again. No-op when it is not draining
  // in that class.
  void UndrainRegion(uint32_t r, uint16_t size_class);
  // Regions draining now.
  uint32_t DrainingRegions() const;

  uint8_t* base() const { return base_; }
  uint64_t capacity_bytes() const { return capacity_bytes_; }
  uint64_t region_bytes() const { return region_bytes_; }
  uint32_t region_count() const { return region_count_; }
  const std::vector<uint64_t>& slot_sizes() const { return slot_sizes_; }

 private:
  // std::mutex with thread-safety annotations. Not absl::Mutex: Debian's Abseil is built without
  // NDEBUG, so every absl::Mutex::Lock runs deadlock detection, ~75 ns per uncontended
  // lock/unlock pair on the reference machine against ~8 ns for std::mutex, which alone would
  // blow the allocator's budget (an allocate+free pair locks twice).
  class ABSL_LOCKABLE Mutex {
   public:
    void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
    void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

   private:
    std::mutex mu_;
  };
  class ABSL_SCOPED_LOCKABLE MutexLock {
   public:
    explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
    ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
    MutexLock(const MutexLock&) = delete;
    MutexLock& operator=(const MutexLock&) = delete;

   private:
    Mutex* const mu_;
  };

  static constexpr uint32_t kNil = 0xffffffffu;  // End of a region list.
  static constexpr uint16_t kNoClass = 0xffffu;  // Region owner while on the free list.

  // Per-region allocator state. `owner` is atomic so that Free and Owns, holding the mutex of the
  // class named in a ref, can check that the region belongs to that class; it only changes under
  // the owning class's mutex, so once it reads equal to the held class it stays so. All other
  // fields are guarded by the mutex of the owning class (by free_mu_ while the region is free);
  // the annotations cannot name a mutex chosen at run time, so this is stated, not checked.
  // Invariants: used == popcount(allocated); slot i is allocated iff its bit is set; the free
  // slots are free_stack[0, free_top) plus [bump, slots_per_region); a free region's bitmap is
  // all zero; a region is on its class's partial list iff 0 < used < slots_per_region and it is
  // not draining; owners[i] is meaningful iff slot i is allocated.
  struct Region {
    std::atomic<uint16_t> owner{kNoClass};
    uint32_t used = 0;
    uint32_t bump = 0;      // Slots [bump, slots_per_region) not handed out since assignment.
    uint32_t free_top = 0;  // Freed slots waiting for reuse: free_stack[0, free_top).
    uint32_t capacity = 0;  // Slots the two arrays below can describe.
    uint32_t prev = kNil;   // Links in the owning class's list of regions with a free slot.
    uint32_t next = kNil;
    bool draining = false;  // Being released: allocates nothing, returns to the free list empty.
    std::unique_ptr<uint32_t[]> free_stack;
    std::unique_ptr<SlotOwner[]> owners;  // Per slot, see SlotOwner.
    std::unique_ptr<uint64_t[]> allocated;  // Bitmap, one bit per slot.
  };

  struct alignas(64) SizeClass {  // Own cache line(s): classes are locked independently.
    uint64_t slot_bytes = 0;
    uint32_t slots_per_region = 0;
    mutable Mutex mu;
    uint32_t partial_head ABSL_GUARDED_BY(mu) = kNil;  // Regions with at least one free slot.
    uint32_t regions ABSL_GUARDED_BY(mu) = 0;
    uint64_t slots_used ABSL_GUARDED_BY(mu) = 0;
  };

  HostPool() = default;

  // Takes a free region for class `c` and puts it on c's partial list. kNil when none is left.
  uint32_t TakeFreeRegion(SizeClass& sc, uint16_t c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  // Gives region r (off the free list) to class `c`, empty, with arrays for its slots.
  void AssignRegion(SizeClass& sc, uint16_t c, uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  // Gives an empty region of class `sc` back to the free list.
  void ReturnRegion(SizeClass& sc, uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  void PushPartial(SizeClass& sc, uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  void UnlinkPartial(SizeClass& sc, uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  // Whether `ref` is inside the pool's geometry (needs no lock).
  bool InRange(SlotRef ref) const;
  // Whether an in-range `ref` is currently allocated.
  bool IsAllocated(const SizeClass& sc, SlotRef ref) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(sc.mu);
  // Free's errors, built off the fast path.
  absl::Status RangeError(SlotRef ref) const;
  absl::Status NotAllocatedError(SlotRef ref) const;

  // Immutable after Create.
  uint8_t* base_ = nullptr;
  uint64_t capacity_bytes_ = 0;
  uint64_t region_bytes_ = 0;
  uint32_t region_count_ = 0;
  std::vector<uint64_t> slot_sizes_;
  struct HeapFree {
    void operator()(void* p) const { std::free(p); }
  };
  // The heap block behind base_ when the pool owns its memory (Create without memory).
  std::unique_ptr<void, HeapFree> heap_;

  std::unique_ptr<SizeClass[]> classes_;
  std::unique_ptr<Region[]> regions_;
  SlotJournal* journal_ = nullptr;  // See set_journal.

  // Taken after a class mutex, never before one.
  mutable Mutex free_mu_;
  // Free regions, used as a stack (a region just returned is warm). Reserved to region_count_ at
  // Create, so pushes never allocate.
  std::vector<uint32_t> free_regions_ ABSL_GUARDED_BY(free_mu_);
  std::atomic<uint32_t> draining_{0};
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_HOST_POOL_H_
