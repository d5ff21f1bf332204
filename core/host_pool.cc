// HostPool: option validation, construction over the caller's memory, and the slab allocator.
#include "core/host_pool.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/slot_journal.h"

namespace kvcellar::core {
namespace {

// SlotRef.region is 16 bits.
constexpr uint64_t kMaxRegions = uint64_t{1} << 16;
// Class numbers are 16 bits and 0xffff marks a free region.
constexpr size_t kMaxClasses = 0xffff;
// The default classes span 64 KiB (a small page of a small model) to 64 MiB (a large page of a
// large model, e.g. 128 tokens of a 70B model's full KV at bf16 on one shard is 40 MiB).
constexpr uint64_t kDefaultMinSlot = 64 * kKiB;
constexpr uint64_t kDefaultMaxSlot = 64 * kMiB;

uint64_t AlignDown(uint64_t v, uint64_t a) { return v / a * a; }

// What valid options describe.
struct Geometry {
  uint64_t bytes = 0;  // Memory carved: capacity_bytes rounded down to whole regions.
  uint64_t region_count = 0;
  std::vector<uint64_t> slot_sizes;
};

// The slot sizes of `options`, or InvalidArgument naming the bad one.
absl::StatusOr<std::vector<uint64_t>> SlotSizes(const HostPoolOptions& options) {
  std::vector<uint64_t> sizes = options.slot_sizes.empty()
                                    ? HostPool::DefaultSlotSizes(options.region_bytes)
                                    : options.slot_sizes;
  if (sizes.size() > kMaxClasses) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool has ", sizes.size(), " slot sizes; at most ", kMaxClasses));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0 || sizes[i] % kSlotAlignment != 0 || sizes[i] > options.region_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host pool slot_sizes[", i, "] = ", sizes[i], " must be a positive multiple of ",
          kSlotAlignment, " no larger than region_bytes ", options.region_bytes));
    }
    if (i > 0 && sizes[i] <= sizes[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("host pool slot_sizes must be strictly increasing: slot_sizes[", i,
                       "] = ", sizes[i], " follows ", sizes[i - 1]));
    }
  }
  return sizes;
}

// Validates `options`; errors name the bad option.
absl::StatusOr<Geometry> Validate(const HostPoolOptions& options) {
  const uint64_t region_bytes = options.region_bytes;
  if (region_bytes == 0 || region_bytes % kSlotAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host pool region_bytes ", region_bytes,
                                                   " must be a positive multiple of ",
                                                   kSlotAlignment));
  }
  if (options.huge_page_bytes != 0 && region_bytes % options.huge_page_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host pool region_bytes ", region_bytes,
                                                   " must be a multiple of the huge page size ",
                                                   options.huge_page_bytes, " with huge_pages=on"));
  }
  if (options.capacity_bytes < region_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool capacity_bytes ", options.capacity_bytes,
                     " is less than one region (region_bytes ", region_bytes, ")"));
  }
  Geometry g;
  g.region_count = options.capacity_bytes / region_bytes;
  if (g.region_count > kMaxRegions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host pool capacity_bytes ", options.capacity_bytes, " is ", g.region_count, " regions of ",
        region_bytes, " bytes; at most ", kMaxRegions, " fit a SlotRef: raise region_bytes"));
  }
  absl::StatusOr<std::vector<uint64_t>> sizes = SlotSizes(options);
  if (!sizes.ok()) return sizes.status();
  g.slot_sizes = *std::move(sizes);
  g.bytes = g.region_count * region_bytes;
  return g;
}

}  // namespace

std::vector<uint64_t> HostPool::DefaultSlotSizes(uint64_t region_bytes) {
  region_bytes = AlignDown(region_bytes, kSlotAlignment);
  if (region_bytes == 0) return {};
  const uint64_t max_slot = std::min(kDefaultMaxSlot, region_bytes);
  std::vector<uint64_t> sizes;
  // Powers of two: KV objects are often exactly that (layers * 2 * P * heads * head_dim * 2).
  for (uint64_t s = kDefaultMinSlot; s <= max_slot; s *= 2) sizes.push_back(s);
  // A 1.25x series bounds the waste for every other size to about 20%. Each step takes the
  // largest size that keeps a whole number of slots per region (region / n): for the same slot
  // count a bigger slot is free. Below 5 slots per region the steps are region/4, /3, /2, /1.
  uint64_t prev = std::min(kDefaultMinSlot, max_slot);
  sizes.push_back(prev);
  while (prev < max_slot) {
    const uint64_t prev_count = region_bytes / prev;
    const uint64_t target = prev + prev / 4;
    const uint64_t count = std::min(prev_count - 1, (region_bytes + target - 1) / target);
    prev = std::min(
        max_slot, std::max(prev + kSlotAlignment, AlignDown(region_bytes / count, kSlotAlignment)));
    sizes.push_back(prev);
  }
  sizes.push_back(max_slot);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

absl::StatusOr<uint64_t> HostPool::MemoryBytes(const HostPoolOptions& options) {
  absl::StatusOr<Geometry> g = Validate(options);
  if (!g.ok()) return g.status();
  return g->bytes;
}

absl::StatusOr<std::unique_ptr<HostPool>> HostPool::Create(const HostPoolOptions& options,
                                                           std::span<uint8_t> memory) {
  absl::StatusOr<Geometry> g = Validate(options);
  if (!g.ok()) return g.status();
  if (memory.size() < g->bytes ||
      reinterpret_cast<uintptr_t>(memory.data()) % kSlotAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool memory of ", memory.size(), " bytes at 0x",
                     absl::Hex(reinterpret_cast<uintptr_t>(memory.data())), " must hold ", g->bytes,
                     " bytes and start on a ", kSlotAlignment, "-byte boundary"));
  }
  const uint64_t region_bytes = options.region_bytes;
  const uint64_t region_count = g->region_count;

  std::unique_ptr<HostPool> pool(new HostPool());
  pool->base_ = memory.data();
  pool->capacity_bytes_ = g->bytes;
  pool->region_bytes_ = region_bytes;
  pool->region_count_ = static_cast<uint32_t>(region_count);
  pool->slot_sizes_ = std::move(g->slot_sizes);

  pool->classes_ = std::make_unique<SizeClass[]>(pool->slot_sizes_.size());
  for (size_t c = 0; c < pool->slot_sizes_.size(); ++c) {
    pool->classes_[c].slot_bytes = pool->slot_sizes_[c];
    pool->classes_[c].slots_per_region = static_cast<uint32_t>(region_bytes / pool->slot_sizes_[c]);
  }
  pool->regions_ = std::make_unique<Region[]>(region_count);
  MutexLock lock(&pool->free_mu_);
  pool->free_regions_.reserve(region_count);
  // Pushed in reverse so that region 0 is handed out first.
  for (uint64_t r = region_count; r-- > 0;) pool->free_regions_.push_back(static_cast<uint32_t>(r));
  return pool;
}

absl::StatusOr<std::unique_ptr<HostPool>> HostPool::Create(const HostPoolOptions& options) {
  absl::StatusOr<uint64_t> bytes = MemoryBytes(options);
  if (!bytes.ok()) return bytes.status();
  // calloc: zeroed, like the fresh anonymous memory the daemon maps (glibc takes a large block
  // straight from the kernel, already zero, and skips the memset: nothing is touched here). One
  // alignment more than needed, so that the pool can start on a slot boundary in it.
  std::unique_ptr<void, HeapFree> heap(std::calloc(1, *bytes + kSlotAlignment));
  if (heap == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool: no heap memory for ", *bytes, " bytes"));
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(heap.get());
  uint8_t* base = static_cast<uint8_t*>(heap.get()) +
                  (kSlotAlignment - start % kSlotAlignment) % kSlotAlignment;
  absl::StatusOr<std::unique_ptr<HostPool>> pool = Create(options, {base, *bytes});
  if (pool.ok()) (*pool)->heap_ = std::move(heap);
  return pool;
}

HostPool::~HostPool() = default;

absl::StatusOr<uint16_t> HostPool::ClassFor(uint64_t object_bytes) const {
  if (object_bytes == 0) return absl::InvalidArgumentError("host pool object size is 0");
  auto it = std::lower_bound(slot_sizes_.begin(), slot_sizes_.end(), object_bytes);
  if (it == slot_sizes_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("host pool object size ", object_bytes,
                                                   " is larger than the largest slot size ",
                                                   slot_sizes_.back()));
  }
  return static_cast<uint16_t>(it - slot_sizes_.begin());
}

absl::StatusOr<SlotRef> HostPool::Allocate(uint64_t object_bytes, const SlotOwner& owner) {
  absl::StatusOr<uint16_t> c = ClassFor(object_bytes);
  if (!c.ok()) return c.status();
  return AllocateInClass(*c, owner);
}

absl::StatusOr<SlotRef> HostPool::AllocateInClass(uint16_t c, const SlotOwner& owner) {
  if (c >= slot_sizes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host pool size class ", c, " out of range; the pool has ", slot_sizes_.size()));
  }
  SizeClass& sc = classes_[c];
  MutexLock lock(&sc.mu);
  uint32_t r = sc.partial_head;
  if (r == kNil) {
    r = TakeFreeRegion(sc, c);
    if (r == kNil) {
      return absl::ResourceExhaustedError(absl::StrCat("host pool full: no free slot of ",
                                                       sc.slot_bytes, " bytes (class ", c,
                                                       ") and no free region"));
    }
  }
  Region& g = regions_[r];
  const uint32_t index = g.free_top > 0 ? g.free_stack[--g.free_top] : g.bump++;
  g.allocated[index >> 6] |= uint64_t{1} << (index & 63);
  g.owners[index] = owner;
  if (++g.used == sc.slots_per_region) UnlinkPartial(sc, r);
  ++sc.slots_used;
  return SlotRef{c, static_cast<uint16_t>(r), index};
}

bool HostPool::InRange(SlotRef ref) const {
  return ref.valid() && ref.size_class < slot_sizes_.size() && ref.region < region_count_ &&
         ref.index < classes_[ref.size_class].slots_per_region;
}

bool HostPool::IsAllocated(const SizeClass& sc, SlotRef ref) const {
  const Region& g = regions_[ref.region];
  // Stable while sc.mu is held if it equals ref.size_class; otherwise the region is not ours
  // (and its arrays may not exist), so the bitmap is read only after the owner matches.
  return g.owner.load(std::memory_order_relaxed) == ref.size_class &&
         (g.allocated[ref.index >> 6] >> (ref.index & 63) & 1) != 0;
}

absl::Status HostPool::RangeError(SlotRef ref) const {
  return absl::InvalidArgumentError(
      absl::StrCat("slot ref {class ", ref.size_class, ", region ", ref.region, ", index ",
                   ref.index, "} names no slot of this host pool (", slot_sizes_.size(),
                   " classes, ", region_count_, " regions)"));
}

absl::Status HostPool::NotAllocatedError(SlotRef ref) const {
  const uint16_t owner = regions_[ref.region].owner.load(std::memory_order_relaxed);
  return absl::FailedPreconditionError(absl::StrCat(
      "slot ref {class ", ref.size_class, ", region ", ref.region, ", index ", ref.index,
      "} is not allocated (double free or stale ref); region ", ref.region, " is ",
      owner == kNoClass ? std::string("free") : absl::StrCat("in class ", owner)));
}

absl::Status HostPool::Free(SlotRef ref, SlotOwner* owner) {
  if (!InRange(ref)) return RangeError(ref);
  SizeClass& sc = classes_[ref.size_class];
  MutexLock lock(&sc.mu);
  if (!IsAllocated(sc, ref)) return NotAllocatedError(ref);
  // The record first: once the slot is on the free stack another thread may take it.
  if (journal_ != nullptr) journal_->Clear(ref);
  Region& g = regions_[ref.region];
  if (owner != nullptr) *owner = g.owners[ref.index];
  g.allocated[ref.index >> 6] &= ~(uint64_t{1} << (ref.index & 63));
  g.free_stack[g.free_top++] = ref.index;
  --sc.slots_used;
  const bool was_full = g.used == sc.slots_per_region;
  --g.used;
  if (g.used == 0) {
    if (!was_full && !g.draining) UnlinkPartial(sc, ref.region);
    ReturnRegion(sc, ref.region);
  } else if (was_full && !g.draining) {
    PushPartial(sc, ref.region);
  }
  return absl::OkStatus();
}

bool HostPool::Owns(SlotRef ref) const {
  if (!InRange(ref)) return false;
  const SizeClass& sc = classes_[ref.size_class];
  MutexLock lock(&sc.mu);
  return IsAllocated(sc, ref);
}

uint32_t HostPool::TakeFreeRegion(SizeClass& sc, uint16_t c) {
  uint32_t r;
  {
    MutexLock lock(&free_mu_);
    if (free_regions_.empty()) return kNil;
    r = free_regions_.back();
    free_regions_.pop_back();
  }
  AssignRegion(sc, c, r);
  PushPartial(sc, r);
  return r;
}

void HostPool::AssignRegion(SizeClass& sc, uint16_t c, uint32_t r) {
  // The region is now this class's; its fields are guarded by sc.mu from here on.
  Region& g = regions_[r];
  const uint32_t n = sc.slots_per_region;
  if (g.capacity < n) {
    // The one heap allocation: a region's first use by a class with more slots than it has
    // held before. Bounded by region_count * (slots of the smallest class used).
    g.free_stack = std::make_unique<uint32_t[]>(n);
    g.allocated = std::make_unique<uint64_t[]>((n + 63) / 64);  // Zeroed.
    g.owners = std::make_unique<SlotOwner[]>(n);
    g.capacity = n;
  }
  g.used = 0;
  g.bump = 0;
  g.free_top = 0;
  g.owner.store(c, std::memory_order_relaxed);
  ++sc.regions;
}

absl::Status HostPool::Restore(std::span<const OwnedSlot> slots) {
  // Checked whole before anything changes.
  std::vector<uint16_t> region_class(region_count_, kNoClass);
  for (const OwnedSlot& s : slots) {
    if (!InRange(s.slot)) return RangeError(s.slot);
    uint16_t& c = region_class[s.slot.region];
    if (c != kNoClass && c != s.slot.size_class) {
      return absl::InvalidArgumentError(absl::StrCat("restore: region ", s.slot.region,
                                                     " is named by size classes ", c, " and ",
                                                     s.slot.size_class));
    }
    c = s.slot.size_class;
  }
  {
    MutexLock lock(&free_mu_);
    if (free_regions_.size() != region_count_) {
      return absl::FailedPreconditionError("restore: the host pool is already in use");
    }
  }
  // Per region, (slot index, position in `slots`), sorted by index.
  std::vector<std::vector<std::pair<uint32_t, size_t>>> region_slots(region_count_);
  for (size_t i = 0; i < slots.size(); ++i) {
    region_slots[slots[i].slot.region].push_back({slots[i].slot.index, i});
  }
  for (uint32_t r = 0; r < region_count_; ++r) {
    std::vector<std::pair<uint32_t, size_t>>& v = region_slots[r];
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i) {
      if (v[i].first == v[i - 1].first) {
        return absl::InvalidArgumentError(
            absl::StrCat("restore: slot ", v[i].first, " of region ", r, " is named twice"));
      }
    }
  }

  for (uint32_t r = 0; r < region_count_; ++r) {
    const uint16_t c = region_class[r];
    if (c == kNoClass) continue;
    SizeClass& sc = classes_[c];
    MutexLock lock(&sc.mu);
    AssignRegion(sc, c, r);
    Region& g = regions_[r];
    for (const auto& [index, at] : region_slots[r]) {
      g.allocated[index >> 6] |= uint64_t{1} << (index & 63);
      g.owners[index] = slots[at].owner;
      ++g.used;
    }
    // Every slot is carved; the free ones wait on the stack, lowest handed out first.
    g.bump = sc.slots_per_region;
    for (uint32_t i = sc.slots_per_region; i-- > 0;) {
      if ((g.allocated[i >> 6] >> (i & 63) & 1) == 0) g.free_stack[g.free_top++] = i;
    }
    sc.slots_used += g.used;
    if (g.used < sc.slots_per_region) PushPartial(sc, r);
  }
  MutexLock lock(&free_mu_);
  free_regions_.clear();
  for (uint32_t r = region_count_; r-- > 0;) {
    if (region_class[r] == kNoClass) free_regions_.push_back(r);
  }
  return absl::OkStatus();
}

void HostPool::ReturnRegion(SizeClass& sc, uint32_t r) {
  Region& g = regions_[r];
  // Every slot is free, so the bitmap is already all zero, as a free region's must be.
  g.owner.store(kNoClass, std::memory_order_relaxed);
  g.free_top = 0;
  g.bump = 0;
  if (g.draining) {
    g.draining = false;
    draining_.fetch_sub(1, std::memory_order_relaxed);
  }
  --sc.regions;
  MutexLock lock(&free_mu_);
  free_regions_.push_back(r);  // Never reallocates: reserved to region_count_.
}

void HostPool::PushPartial(SizeClass& sc, uint32_t r) {
  Region& g = regions_[r];
  g.prev = kNil;
  g.next = sc.partial_head;
  if (sc.partial_head != kNil) regions_[sc.partial_head].prev = r;
  sc.partial_head = r;
}

void HostPool::UnlinkPartial(SizeClass& sc, uint32_t r) {
  Region& g = regions_[r];
  if (g.prev != kNil) {
    regions_[g.prev].next = g.next;
  } else {
    sc.partial_head = g.next;
  }
  if (g.next != kNil) regions_[g.next].prev = g.prev;
  g.prev = g.next = kNil;
}

absl::Status HostPool::ForEachChunk(uint64_t chunk_bytes, const RegionHook& hook) const {
  const uint64_t regions_per_chunk =
      chunk_bytes == 0 ? region_count_ : std::max<uint64_t>(1, chunk_bytes / region_bytes_);
  for (uint64_t r = 0; r < region_count_; r += regions_per_chunk) {
    const uint64_t n = std::min<uint64_t>(regions_per_chunk, region_count_ - r);
    const uint64_t offset = r * region_bytes_;
    absl::Status s = hook(base_ + offset, n * region_bytes_);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("host pool chunk at offset ", offset, " (",
                                                 n * region_bytes_, " bytes): ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::vector<SizeClassStats> HostPool::Stats() const {
  std::vector<SizeClassStats> out(slot_sizes_.size());
  for (size_t c = 0; c < slot_sizes_.size(); ++c) {
    const SizeClass& sc = classes_[c];
    SizeClassStats& s = out[c];
    s.size_class = static_cast<uint16_t>(c);
    s.slot_bytes = sc.slot_bytes;
    s.slots_per_region = sc.slots_per_region;
    MutexLock lock(&sc.mu);
    s.regions = sc.regions;
    s.slots_total = uint64_t{sc.regions} * sc.slots_per_region;
    s.slots_used = sc.slots_used;
    s.bytes_used = sc.slots_used * sc.slot_bytes;
  }
  return out;
}

uint32_t HostPool::FreeRegions() const {
  MutexLock lock(&free_mu_);
  return static_cast<uint32_t>(free_regions_.size());
}

std::vector<RegionInfo> HostPool::RegionInfos() const {
  std::vector<RegionInfo> out;
  for (size_t c = 0; c < slot_sizes_.size(); ++c) {
    const SizeClass& sc = classes_[c];
    MutexLock lock(&sc.mu);
    if (sc.regions == 0) continue;
    // A region's owner changes only under the mutex of the class it leaves or joins, so the
    // regions reading `c` here are exactly c's.
    for (uint32_t r = 0; r < region_count_; ++r) {
      const Region& g = regions_[r];
      if (g.owner.load(std::memory_order_relaxed) != c) continue;
      out.push_back({r, static_cast<uint16_t>(c), g.used, sc.slots_per_region, g.draining});
    }
  }
  return out;
}

absl::Status HostPool::RegionSlots(uint32_t r, uint16_t size_class,
                                   std::vector<OwnedSlot>* slots) const {
  if (r >= region_count_ || size_class >= slot_sizes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("host pool: region ", r, " of class ",
                                                   size_class, " is out of range"));
  }
  const SizeClass& sc = classes_[size_class];
  MutexLock lock(&sc.mu);
  const Region& g = regions_[r];
  if (g.owner.load(std::memory_order_relaxed) != size_class) {
    return absl::FailedPreconditionError(
        absl::StrCat("host pool: region ", r, " is not in class ", size_class));
  }
  const uint32_t words = (sc.slots_per_region + 63) / 64;
  for (uint32_t w = 0; w < words; ++w) {
    for (uint64_t bits = g.allocated[w]; bits != 0; bits &= bits - 1) {
      const uint32_t i = w * 64 + static_cast<uint32_t>(std::countr_zero(bits));
      slots->push_back({SlotRef{size_class, static_cast<uint16_t>(r), i}, g.owners[i]});
    }
  }
  return absl::OkStatus();
}

absl::Status HostPool::DrainRegion(uint32_t r, uint16_t size_class) {
  if (r >= region_count_ || size_class >= slot_sizes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("host pool: region ", r, " of class ",
                                                   size_class, " is out of range"));
  }
  SizeClass& sc = classes_[size_class];
  MutexLock lock(&sc.mu);
  Region& g = regions_[r];
  if (g.owner.load(std::memory_order_relaxed) != size_class) {
    return absl::FailedPreconditionError(
        absl::StrCat("host pool: region ", r, " is not in class ", size_class));
  }
  if (g.draining) return absl::OkStatus();
  // An assigned region always holds a slot (an empty one returns at once), so it is on the
  // partial list exactly when it is not full.
  if (g.used < sc.slots_per_region) UnlinkPartial(sc, r);
  g.draining = true;
  draining_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void HostPool::UndrainRegion(uint32_t r, uint16_t size_class) {
  if (r >= region_count_ || size_class >= slot_sizes_.size()) return;
  SizeClass& sc = classes_[size_class];
  MutexLock lock(&sc.mu);
  Region& g = regions_[r];
  if (g.owner.load(std::memory_order_relaxed) != size_class || !g.draining) return;
  g.draining = false;
  draining_.fetch_sub(1, std::memory_order_relaxed);
  if (g.used < sc.slots_per_region) PushPartial(sc, r);
}

uint32_t HostPool::DrainingRegions() const { return draining_.load(std::memory_order_relaxed); }

}  // namespace kvcellar::core
