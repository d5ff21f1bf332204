// Tests for core/host_pool.h: option validation, the caller's memory, class selection,
// exhaustion and region reuse, exact accounting under randomized and multi-threaded use, misuse
// detection, chunked registration, and a pool over memory a previous pool wrote (warm restart).
// All on heap memory: the mapping itself is platform/host_memory.h's, tested in
// tests/platform/host_memory_test.cc.
#include "core/host_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::HasSubstr;

// Small geometry so that exhaustion and region turnover happen within a few hundred operations.
constexpr uint64_t kRegion = 1 * kMiB;

HostPoolOptions SmallOptions(uint64_t regions, std::vector<uint64_t> slot_sizes) {
  HostPoolOptions o;
  o.capacity_bytes = regions * kRegion;
  o.region_bytes = kRegion;
  o.slot_sizes = std::move(slot_sizes);
  return o;
}

std::unique_ptr<HostPool> MustCreate(const HostPoolOptions& o) {
  absl::StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

// Heap memory on a slot boundary, standing in for the mapping a caller hands the pool.
struct FreeMemory {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Memory = std::unique_ptr<uint8_t, FreeMemory>;
Memory AlignedMemory(uint64_t bytes) {
  return Memory(static_cast<uint8_t*>(std::aligned_alloc(kSlotAlignment, bytes)));
}

std::unique_ptr<HostPool> MustCreate(const HostPoolOptions& o, std::span<uint8_t> memory) {
  absl::StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(o, memory);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

uint64_t SumUsed(const HostPool& pool) {
  uint64_t n = 0;
  for (const SizeClassStats& s : pool.Stats()) n += s.slots_used;
  return n;
}

// ---- Options and classes ------------------------------------------------------------------------

TEST(HostPoolTest, DefaultSlotSizes) {
  const std::vector<uint64_t> sizes = HostPool::DefaultSlotSizes(kDefaultRegionBytes);
  ASSERT_FALSE(sizes.empty());
  EXPECT_EQ(sizes.front(), 64 * kKiB);
  EXPECT_EQ(sizes.back(), 64 * kMiB);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(sizes[i] % kSlotAlignment, 0u) << sizes[i];
    // The tail a region cannot use is under 1% for every class.
    EXPECT_LT(kDefaultRegionBytes % sizes[i], kDefaultRegionBytes / 100) << sizes[i];
    if (i > 0) {
      EXPECT_GT(sizes[i], sizes[i - 1]);
      // Neighbouring classes are at most 1.25x apart (plus alignment) up to 4 slots per region.
      if (sizes[i] <= 16 * kMiB) {
        EXPECT_LE(sizes[i] * 4, sizes[i - 1] * 5 + 4 * kSlotAlignment) << sizes[i];
      }
    }
  }
  for (uint64_t p = 64 * kKiB; p <= 64 * kMiB; p *= 2) {
    EXPECT_TRUE(std::binary_search(sizes.begin(), sizes.end(), p)) << "power of two " << p;
  }
  // Small regions cap the classes at the region size.
  const std::vector<uint64_t> small = HostPool::DefaultSlotSizes(kRegion);
  EXPECT_EQ(small.back(), kRegion);
}

TEST(HostPoolTest, RejectsBadOptions) {
  struct Case {
    HostPoolOptions options;
    absl::string_view message;
  };
  std::vector<Case> cases;
  cases.push_back({SmallOptions(0, {64 * kKiB}), "less than one region"});
  HostPoolOptions o = SmallOptions(4, {64 * kKiB});
  o.region_bytes = 1000;
  cases.push_back({o, "region_bytes 1000"});
  cases.push_back({SmallOptions(4, {64 * kKiB + 1}), "slot_sizes[0] = 65537"});
  cases.push_back({SmallOptions(4, {0}), "slot_sizes[0] = 0"});
  cases.push_back({SmallOptions(4, {2 * kMiB}), "no larger than region_bytes"});
  cases.push_back({SmallOptions(4, {128 * kKiB, 64 * kKiB}), "strictly increasing"});
  cases.push_back({SmallOptions(4, {64 * kKiB, 64 * kKiB}), "strictly increasing"});
  o = SmallOptions(1, {64 * kKiB});
  o.region_bytes = 4 * kKiB;
  o.capacity_bytes = (uint64_t{1} << 16) * 4 * kKiB + 4 * kKiB;  // 65537 regions.
  o.slot_sizes = {4 * kKiB};
  cases.push_back({o, "65537 regions"});
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(c.options);
    ASSERT_FALSE(pool.ok()) << c.message;
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument) << pool.status();
    EXPECT_THAT(pool.status().message(), HasSubstr(std::string(c.message)));
  }
}

TEST(HostPoolTest, CapacityRoundsDownToWholeRegions) {
  HostPoolOptions o = SmallOptions(3, {64 * kKiB});
  o.capacity_bytes += kRegion / 2;
  std::unique_ptr<HostPool> pool = MustCreate(o);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->capacity_bytes(), 3 * kRegion);
  EXPECT_EQ(pool->region_count(), 3u);
  EXPECT_EQ(pool->FreeRegions(), 3u);
  EXPECT_EQ(*HostPool::MemoryBytes(o), 3 * kRegion);
}

TEST(HostPoolTest, CarvesTheCallersMemory) {
  const HostPoolOptions o = SmallOptions(4, {64 * kKiB});
  ASSERT_EQ(*HostPool::MemoryBytes(o), 4 * kRegion);
  Memory memory = AlignedMemory(5 * kRegion);
  ASSERT_NE(memory, nullptr);
  // More memory than the options ask for: the tail is left unused.
  std::unique_ptr<HostPool> pool = MustCreate(o, {memory.get(), 5 * kRegion});
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->base(), memory.get());
  EXPECT_EQ(pool->capacity_bytes(), 4 * kRegion);
  const SlotRef r = *pool->Allocate(1);
  EXPECT_GE(pool->Address(r), memory.get());
  EXPECT_LE(pool->Address(r) + pool->SlotBytes(r), memory.get() + 4 * kRegion);

  // Too little, or not on a slot boundary, is refused before anything is carved.
  absl::StatusOr<std::unique_ptr<HostPool>> small =
      HostPool::Create(o, {memory.get(), 4 * kRegion - 1});
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("must hold 4194304 bytes"));
  absl::StatusOr<std::unique_ptr<HostPool>> skewed =
      HostPool::Create(o, {memory.get() + 64, 4 * kRegion});
  ASSERT_FALSE(skewed.ok());
  EXPECT_THAT(skewed.status().message(), HasSubstr("4096-byte boundary"));
  // Bad options are refused the same way with or without memory.
  EXPECT_THAT(HostPool::Create(SmallOptions(0, {64 * kKiB}), {memory.get(), 5 * kRegion})
                  .status()
                  .message(),
              HasSubstr("less than one region"));
}

TEST(HostPoolTest, ClassForPicksTheSmallestClassThatFits) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(2, {64 * kKiB, 256 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(*pool->ClassFor(1), 0);
  EXPECT_EQ(*pool->ClassFor(64 * kKiB), 0);
  EXPECT_EQ(*pool->ClassFor(64 * kKiB + 1), 1);
  EXPECT_EQ(*pool->ClassFor(256 * kKiB), 1);
  EXPECT_EQ(*pool->ClassFor(256 * kKiB + 1), 2);
  EXPECT_EQ(*pool->ClassFor(kRegion), 2);

  absl::StatusOr<uint16_t> big = pool->ClassFor(kRegion + 1);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.status().message(), HasSubstr("1048577"));
  EXPECT_THAT(big.status().message(), HasSubstr("largest slot size 1048576"));
  EXPECT_FALSE(pool->ClassFor(0).ok());
  EXPECT_FALSE(pool->AllocateInClass(3).ok());
}

// ---- Allocation ---------------------------------------------------------------------------------

TEST(HostPoolTest, AllocateUntilExhaustedThenFreeReturnsRegions) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(4, {256 * kKiB}));
  ASSERT_NE(pool, nullptr);
  std::vector<SlotRef> refs;
  for (int i = 0; i < 16; ++i) {
    absl::StatusOr<SlotRef> r = pool->Allocate(200 * kKiB);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    EXPECT_EQ(pool->SlotBytes(*r), 256 * kKiB);
    refs.push_back(*r);
  }
  absl::StatusOr<SlotRef> full = pool->Allocate(1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("262144 bytes"));
  EXPECT_EQ(pool->FreeRegions(), 0u);
  SizeClassStats s = pool->Stats()[0];
  EXPECT_EQ(s.regions, 4u);
  EXPECT_EQ(s.slots_per_region, 4u);
  EXPECT_EQ(s.slots_total, 16u);
  EXPECT_EQ(s.slots_used, 16u);
  EXPECT_EQ(s.bytes_used, 16 * 256 * kKiB);

  // Freeing one slot makes exactly that slot allocatable again.
  ASSERT_TRUE(pool->Free(refs[5]).ok());
  absl::StatusOr<SlotRef> again = pool->Allocate(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, refs[5]);

  // A region goes back to the free list when its last slot is freed, not before.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool->Free(refs[i]).ok());
  EXPECT_EQ(pool->FreeRegions(), 0u);
  ASSERT_TRUE(pool->Free(refs[3]).ok());
  EXPECT_EQ(pool->FreeRegions(), 1u);
  for (int i = 4; i < 16; ++i) ASSERT_TRUE(pool->Free(refs[i]).ok());
  EXPECT_EQ(pool->FreeRegions(), 4u);
  s = pool->Stats()[0];
  EXPECT_EQ(s.regions, 0u);
  EXPECT_EQ(s.slots_used, 0u);
  EXPECT_EQ(s.bytes_used, 0u);
}

TEST(HostPoolTest, OneSlotPerRegionClass) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(2, {kRegion}));
  ASSERT_NE(pool, nullptr);
  SlotRef a = *pool->Allocate(kRegion);
  SlotRef b = *pool->Allocate(kRegion);
  EXPECT_FALSE(pool->Allocate(kRegion).ok());
  EXPECT_NE(a.region, b.region);
  ASSERT_TRUE(pool->Free(a).ok());
  EXPECT_EQ(pool->FreeRegions(), 1u);
  ASSERT_TRUE(pool->Free(b).ok());
  EXPECT_EQ(pool->FreeRegions(), 2u);
}

TEST(HostPoolTest, MixedClassesShareThePool) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(4, {64 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  std::vector<SlotRef> small;
  small.push_back(*pool->Allocate(64 * kKiB));  // Takes one region for the small class.
  std::vector<SlotRef> large;
  for (int i = 0; i < 3; ++i) large.push_back(*pool->Allocate(kRegion));
  EXPECT_EQ(pool->Allocate(kRegion).status().code(), absl::StatusCode::kResourceExhausted);
  // The small class still has 15 free slots in its region, then it is full too.
  for (int i = 0; i < 15; ++i) small.push_back(*pool->Allocate(64 * kKiB));
  EXPECT_EQ(pool->Allocate(64 * kKiB).status().code(), absl::StatusCode::kResourceExhausted);
  // Emptying the small class's region hands it to the large class.
  for (const SlotRef& r : small) ASSERT_TRUE(pool->Free(r).ok());
  absl::StatusOr<SlotRef> moved = pool->Allocate(kRegion);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->region, small[0].region);
  const std::vector<SizeClassStats> stats = pool->Stats();
  EXPECT_EQ(stats[0].regions, 0u);
  EXPECT_EQ(stats[1].regions, 4u);
}

TEST(HostPoolTest, OwnerRecordsAndRegionInfos) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(3, {256 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  std::vector<SlotRef> small;
  for (uint16_t i = 0; i < 6; ++i) {
    SlotOwner owner;
    owner.key.bytes[0] = static_cast<uint8_t>(i + 1);
    owner.ns = 7;
    owner.shard = i;
    small.push_back(*pool->Allocate(256 * kKiB, owner));
  }
  SlotRef large = *pool->Allocate(kRegion);  // No owner record.
  ASSERT_TRUE(pool->Free(small[1]).ok());

  std::vector<RegionInfo> infos = pool->RegionInfos();
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[0].size_class, 0);
  EXPECT_EQ(infos[0].used + infos[1].used, 5u);
  EXPECT_EQ(infos[0].slots_per_region, 4u);
  EXPECT_EQ(infos[2].size_class, 1);
  EXPECT_EQ(infos[2].region, large.region);

  std::vector<OwnedSlot> slots;
  ASSERT_TRUE(pool->RegionSlots(small[0].region, 0, &slots).ok());
  ASSERT_EQ(slots.size(), 3u);  // small[0], small[2], small[3]: small[1] was freed.
  EXPECT_EQ(slots[0].slot, small[0]);
  EXPECT_EQ(slots[0].owner.ns, 7u);
  EXPECT_EQ(slots[0].owner.key.bytes[0], 1);
  EXPECT_EQ(slots[1].slot, small[2]);
  EXPECT_EQ(slots[1].owner.shard, 2);
  slots.clear();
  ASSERT_TRUE(pool->RegionSlots(large.region, 1, &slots).ok());
  ASSERT_EQ(slots.size(), 1u);
  EXPECT_EQ(slots[0].owner.ns, 0u);
  // The wrong class, or a free region, is refused.
  EXPECT_EQ(pool->RegionSlots(large.region, 0, &slots).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(HostPoolTest, DrainingRegionAllocatesNothingAndIsFreedWhenEmpty) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(2, {256 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  std::vector<SlotRef> a;
  for (int i = 0; i < 8; ++i) a.push_back(*pool->Allocate(256 * kKiB));
  const uint16_t victim = a[0].region;
  ASSERT_TRUE(pool->Free(a[1]).ok());  // The victim region is partial now.
  ASSERT_TRUE(pool->DrainRegion(victim, 0).ok());
  ASSERT_TRUE(pool->DrainRegion(victim, 0).ok());  // Idempotent.
  EXPECT_EQ(pool->DrainingRegions(), 1u);
  EXPECT_EQ(pool->DrainRegion(victim, 1).code(), absl::StatusCode::kFailedPrecondition);
  // Its free slot is not handed out, nor are the ones freed while it drains.
  EXPECT_EQ(pool->Allocate(256 * kKiB).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pool->Free(a[0]).ok());
  ASSERT_TRUE(pool->Free(a[2]).ok());
  EXPECT_EQ(pool->Allocate(256 * kKiB).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->FreeRegions(), 0u);
  // The last slot freed: the region is free, for any class, and no longer draining.
  ASSERT_TRUE(pool->Free(a[3]).ok());
  EXPECT_EQ(pool->FreeRegions(), 1u);
  EXPECT_EQ(pool->DrainingRegions(), 0u);
  absl::StatusOr<SlotRef> big = pool->Allocate(kRegion);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->region, victim);
}

TEST(HostPoolTest, UndrainGivesTheRegionBackToItsClass) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(1, {256 * kKiB}));
  ASSERT_NE(pool, nullptr);
  std::vector<SlotRef> a;
  for (int i = 0; i < 4; ++i) a.push_back(*pool->Allocate(256 * kKiB));
  ASSERT_TRUE(pool->DrainRegion(a[0].region, 0).ok());
  ASSERT_TRUE(pool->Free(a[2]).ok());  // Full while draining: must not join the partial list.
  EXPECT_EQ(pool->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  pool->UndrainRegion(a[0].region, 0);
  EXPECT_EQ(pool->DrainingRegions(), 0u);
  absl::StatusOr<SlotRef> again = pool->Allocate(1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, a[2]);
  EXPECT_EQ(pool->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(SumUsed(*pool), 4u);
}

TEST(HostPoolTest, AddressesAreDistinctAlignedAndInsideTheMapping) {
  std::unique_ptr<HostPool> pool =
      MustCreate(SmallOptions(8, {4 * kKiB, 12 * kKiB, 100 * kKiB, 300 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  std::mt19937 rng(42);
  std::vector<std::pair<uint8_t*, uint64_t>> ranges;
  while (true) {
    const uint16_t c = static_cast<uint16_t>(rng() % pool->slot_sizes().size());
    absl::StatusOr<SlotRef> r = pool->AllocateInClass(c);
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
      if (pool->FreeRegions() == 0 && ranges.size() > 100) break;
      continue;
    }
    uint8_t* p = pool->Address(*r);
    const uint64_t n = pool->SlotBytes(*r);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kSlotAlignment, 0u);
    ASSERT_GE(p, pool->base());
    ASSERT_LE(p + n, pool->base() + pool->capacity_bytes());
    // A slot never crosses a region boundary.
    EXPECT_EQ((p - pool->base()) / kRegion, (p + n - 1 - pool->base()) / kRegion);
    p[0] = 1;
    p[n - 1] = 1;
    ranges.emplace_back(p, n);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    ASSERT_LE(ranges[i - 1].first + ranges[i - 1].second, ranges[i].first) << "overlap at " << i;
  }
}

// ---- Misuse -------------------------------------------------------------------------------------

TEST(HostPoolTest, DoubleFreeIsDetectedAndChangesNothing) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(2, {256 * kKiB}));
  ASSERT_NE(pool, nullptr);
  SlotRef a = *pool->Allocate(1);
  SlotRef b = *pool->Allocate(1);
  ASSERT_TRUE(pool->Free(a).ok());
  EXPECT_FALSE(pool->Owns(a));
  EXPECT_TRUE(pool->Owns(b));
  const absl::Status again = pool->Free(a);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("not allocated"));
  EXPECT_EQ(pool->Stats()[0].slots_used, 1u);
  // The slot is handed out once, not twice, after the double free.
  SlotRef c = *pool->Allocate(1);
  SlotRef d = *pool->Allocate(1);
  EXPECT_NE(c, d);
  EXPECT_NE(c, b);
  EXPECT_NE(d, b);
  EXPECT_EQ(pool->Stats()[0].slots_used, 3u);

  // A slot that was never handed out.
  SlotRef never = b;
  never.index = 3;
  EXPECT_EQ(pool->Free(never).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->Stats()[0].slots_used, 3u);
}

TEST(HostPoolTest, InvalidRefsAreRejected) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(2, {256 * kKiB}));
  ASSERT_NE(pool, nullptr);
  const SlotRef live = *pool->Allocate(1);
  for (SlotRef bad : {SlotRef{}, SlotRef{1, 0, 0}, SlotRef{0, 2, 0}, SlotRef{0, 0, 4}}) {
    const absl::Status s = pool->Free(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.Packed() << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("names no slot"));
    EXPECT_FALSE(pool->Owns(bad));
  }
  EXPECT_TRUE(pool->Owns(live));
  EXPECT_EQ(pool->Stats()[0].slots_used, 1u);
}

TEST(HostPoolTest, StaleRefIntoAReassignedRegionIsRejected) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(1, {256 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  const SlotRef small = *pool->Allocate(1);
  ASSERT_TRUE(pool->Free(small).ok());
  const SlotRef big = *pool->Allocate(kRegion);  // Same region, now the large class's.
  ASSERT_EQ(big.region, small.region);
  const absl::Status s = pool->Free(small);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("in class 1"));
  EXPECT_TRUE(pool->Owns(big));
  EXPECT_EQ(pool->Stats()[1].slots_used, 1u);
  EXPECT_EQ(pool->Stats()[0].slots_used, 0u);
}

// ---- Accounting ---------------------------------------------------------------------------------

// Checks the pool's stats against a model: the set of live refs.
void ExpectAccountingMatches(const HostPool& pool, const absl::flat_hash_set<SlotRef>& live) {
  std::vector<uint64_t> used(pool.slot_sizes().size(), 0);
  std::vector<std::set<uint16_t>> regions(pool.slot_sizes().size());
  for (const SlotRef& r : live) {
    ++used[r.size_class];
    regions[r.size_class].insert(r.region);
  }
  uint32_t assigned = 0;
  for (const SizeClassStats& s : pool.Stats()) {
    ASSERT_EQ(s.slots_used, used[s.size_class]) << "class " << s.size_class;
    ASSERT_EQ(s.bytes_used, used[s.size_class] * s.slot_bytes);
    // Regions return to the free list as soon as they empty, so a class holds exactly the
    // regions its live slots are in.
    ASSERT_EQ(s.regions, regions[s.size_class].size()) << "class " << s.size_class;
    ASSERT_EQ(s.slots_total, uint64_t{s.regions} * s.slots_per_region);
    assigned += s.regions;
  }
  ASSERT_EQ(pool.FreeRegions() + assigned, pool.region_count());
}

TEST(HostPoolTest, RandomizedAccountingIsExact) {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    std::unique_ptr<HostPool> pool =
        MustCreate(SmallOptions(6, {4 * kKiB, 64 * kKiB, 200 * kKiB, 512 * kKiB, kRegion}));
    ASSERT_NE(pool, nullptr);
    std::mt19937 rng(seed);
    absl::flat_hash_set<SlotRef> live;
    std::vector<SlotRef> order;  // Same set, indexable for random picks.
    for (int op = 0; op < 20000; ++op) {
      // Phases bias toward allocation then freeing, so the pool fills and drains repeatedly.
      const bool fill_phase = (op / 2000) % 2 == 0;
      if (order.empty() || rng() % 100 < (fill_phase ? 70u : 30u)) {
        const uint64_t bytes = 1 + rng() % kRegion;
        absl::StatusOr<SlotRef> r = pool->Allocate(bytes);
        if (!r.ok()) {
          ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
        } else {
          ASSERT_GE(pool->SlotBytes(*r), bytes);
          ASSERT_TRUE(live.insert(*r).second) << "slot handed out twice";
          order.push_back(*r);
        }
      } else {
        const size_t i = rng() % order.size();
        const SlotRef r = order[i];
        order[i] = order.back();
        order.pop_back();
        live.erase(r);
        ASSERT_TRUE(pool->Free(r).ok());
        if (rng() % 10 == 0) {
          ASSERT_FALSE(pool->Free(r).ok());  // Double free: rejected, changes nothing.
        }
      }
      if (op % 97 == 0) ExpectAccountingMatches(*pool, live);
    }
    ExpectAccountingMatches(*pool, live);
    for (const SlotRef& r : order) ASSERT_TRUE(pool->Free(r).ok());
    ExpectAccountingMatches(*pool, {});
    EXPECT_EQ(pool->FreeRegions(), pool->region_count());
  }
}

TEST(HostPoolTest, FourThreadsAllocateAndFreeWithExactAccounting) {
  std::unique_ptr<HostPool> pool =
      MustCreate(SmallOptions(16, {4 * kKiB, 64 * kKiB, 256 * kKiB, kRegion}));
  ASSERT_NE(pool, nullptr);
  constexpr int kThreads = 4;
  constexpr int kOps = 50000;
  std::vector<std::vector<SlotRef>> kept(kThreads);
  std::vector<int> errors(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      std::vector<SlotRef>& mine = kept[t];
      for (int op = 0; op < kOps; ++op) {
        if (mine.empty() || rng() % 2 == 0) {
          // Mostly small classes, shared by all threads, plus some whole-region slots.
          const uint64_t bytes = rng() % 16 == 0 ? kRegion : 1 + rng() % (256 * kKiB);
          absl::StatusOr<SlotRef> r = pool->Allocate(bytes);
          if (!r.ok()) {
            if (r.status().code() != absl::StatusCode::kResourceExhausted) ++errors[t];
            continue;
          }
          // Tag the slot; a slot handed to two threads at once shows up as a foreign tag.
          const uint64_t tag = (uint64_t{static_cast<uint32_t>(t)} << 32) | r->index;
          std::memcpy(pool->Address(*r), &tag, sizeof(tag));
          mine.push_back(*r);
        } else {
          const size_t i = rng() % mine.size();
          const SlotRef r = mine[i];
          mine[i] = mine.back();
          mine.pop_back();
          uint64_t tag;
          std::memcpy(&tag, pool->Address(r), sizeof(tag));
          if (tag != ((uint64_t{static_cast<uint32_t>(t)} << 32) | r.index)) ++errors[t];
          if (!pool->Free(r).ok()) ++errors[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], 0) << "thread " << t;

  absl::flat_hash_set<SlotRef> live;
  for (const auto& v : kept) {
    for (const SlotRef& r : v) ASSERT_TRUE(live.insert(r).second);
  }
  ExpectAccountingMatches(*pool, live);
  for (const auto& v : kept) {
    for (const SlotRef& r : v) ASSERT_TRUE(pool->Free(r).ok());
  }
  EXPECT_EQ(SumUsed(*pool), 0u);
  EXPECT_EQ(pool->FreeRegions(), pool->region_count());
}

// ---- Registration chunks ------------------------------------------------------------------------

TEST(HostPoolTest, ForEachChunkCoversTheMappingOnRegionBoundaries) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(8, {64 * kKiB}));
  ASSERT_NE(pool, nullptr);
  auto chunks_of = [&](uint64_t chunk_bytes) {
    std::vector<std::pair<uint64_t, uint64_t>> seen;  // (offset, bytes)
    const absl::Status s = pool->ForEachChunk(chunk_bytes, [&](void* base, uint64_t bytes) {
      seen.emplace_back(static_cast<uint8_t*>(base) - pool->base(), bytes);
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
    return seen;
  };
  using Chunks = std::vector<std::pair<uint64_t, uint64_t>>;
  // 3.5 regions rounds down to 3: chunks of 3, 3 and the remaining 2.
  EXPECT_EQ(chunks_of(3 * kRegion + kRegion / 2),
            (Chunks{{0, 3 * kRegion}, {3 * kRegion, 3 * kRegion}, {6 * kRegion, 2 * kRegion}}));
  EXPECT_EQ(chunks_of(0), (Chunks{{0, 8 * kRegion}}));
  EXPECT_EQ(chunks_of(100 * kRegion), (Chunks{{0, 8 * kRegion}}));
  // Smaller than a region: one region per chunk, never less.
  const Chunks singles = chunks_of(4 * kKiB);
  ASSERT_EQ(singles.size(), 8u);
  for (size_t i = 0; i < singles.size(); ++i)
    EXPECT_EQ(singles[i], std::make_pair(i * kRegion, kRegion));
}

TEST(HostPoolTest, ForEachChunkStopsAtTheFirstError) {
  std::unique_ptr<HostPool> pool = MustCreate(SmallOptions(4, {64 * kKiB}));
  ASSERT_NE(pool, nullptr);
  int calls = 0;
  const absl::Status s = pool->ForEachChunk(kRegion, [&](void*, uint64_t) {
    return ++calls == 2 ? absl::UnavailableError("cudaHostRegister: out of memory")
                        : absl::OkStatus();
  });
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("offset 1048576"));
  EXPECT_THAT(s.message(), HasSubstr("cudaHostRegister: out of memory"));
}

// ---- Warm restart ------------------------------------------------------------------------------

// A pool over memory a previous pool wrote (the daemon's re-attached shm object): the bytes are
// still there under the same refs, and the new pool starts empty.
TEST(HostPoolTest, PoolOverReattachedMemoryKeepsTheBytesAndStartsEmpty) {
  const HostPoolOptions o = SmallOptions(4, {64 * kKiB, 256 * kKiB});
  Memory memory = AlignedMemory(4 * kRegion);
  ASSERT_NE(memory, nullptr);
  const std::span<uint8_t> bytes(memory.get(), 4 * kRegion);
  std::vector<std::pair<SlotRef, uint8_t>> written;
  {
    std::unique_ptr<HostPool> a = MustCreate(o, bytes);
    ASSERT_NE(a, nullptr);
    for (int i = 0; i < 10; ++i) {
      const SlotRef r = *a->Allocate(i % 2 == 0 ? 64 * kKiB : 256 * kKiB);
      const uint8_t v = static_cast<uint8_t>(0x40 + i);
      std::memset(a->Address(r), v, a->SlotBytes(r));
      written.emplace_back(r, v);
    }
  }  // Destroyed; the memory stays, as a shm object outlives the daemon.

  std::unique_ptr<HostPool> b = MustCreate(o, bytes);
  ASSERT_NE(b, nullptr);
  for (const auto& [r, v] : written) {
    const uint8_t* p = b->Address(r);
    const uint64_t n = b->SlotBytes(r);
    EXPECT_TRUE(std::all_of(p, p + n, [v = v](uint8_t x) { return x == v; }))
        << "slot " << r.Packed();
  }
  // The allocator state does not survive: the pool starts empty.
  EXPECT_EQ(SumUsed(*b), 0u);
  EXPECT_EQ(b->FreeRegions(), b->region_count());
}

// The huge-page rule for regions; the mapping's own huge-page policy is platform/huge_pages.h's.
TEST(HostPoolTest, HugePageSizeMustDivideRegions) {
  HostPoolOptions o = SmallOptions(4, {64 * kKiB});
  o.region_bytes = 2 * kMiB;
  o.capacity_bytes = 8 * kMiB;
  o.huge_page_bytes = 2 * kMiB;
  EXPECT_TRUE(HostPool::MemoryBytes(o).ok());

  o.region_bytes = kRegion;  // Half a 2 MiB huge page.
  absl::StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(o);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("multiple of the huge page size"));
  EXPECT_THAT(pool.status().message(), HasSubstr("with huge_pages=on"));
}

// Warm restart: slots handed back to a fresh pool are allocated (with their owners), their
// regions belong to their classes, the rest of each region is free, and nothing else changed.
TEST(HostPoolTest, RestoreMarksSlotsAllocatedInTheirRegions) {
  absl::StatusOr<std::unique_ptr<HostPool>> pool =
      HostPool::Create(SmallOptions(4, {64 * kKiB, 256 * kKiB}));
  ASSERT_TRUE(pool.ok()) << pool.status();
  HostPool& p = **pool;
  SlotOwner owner;
  owner.ns = 7;
  owner.shard = 3;
  owner.key.bytes[0] = 0xab;
  const std::vector<OwnedSlot> slots = {
      {{0, 2, 5}, owner}, {{0, 2, 0}, owner}, {{1, 0, 3}, owner}};
  ASSERT_TRUE(p.Restore(slots).ok());
  for (const OwnedSlot& s : slots) EXPECT_TRUE(p.Owns(s.slot)) << s.slot.Packed();
  EXPECT_EQ(SumUsed(p), 3u);
  EXPECT_EQ(p.FreeRegions(), 2u);
  std::vector<OwnedSlot> in_region;
  ASSERT_TRUE(p.RegionSlots(2, 0, &in_region).ok());
  ASSERT_EQ(in_region.size(), 2u);
  EXPECT_EQ(in_region[0].owner.ns, 7u);
  EXPECT_EQ(in_region[0].owner.shard, 3u);
  // The free slots of region 2 serve class 0 before any free region does; none of them is a
  // restored one.
  absl::flat_hash_set<uint64_t> handed;
  for (uint32_t i = 0; i < kRegion / (64 * kKiB) - 2; ++i) {
    absl::StatusOr<SlotRef> s = p.AllocateInClass(0);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->region, 2u);
    EXPECT_NE(s->index, 5u);
    EXPECT_NE(s->index, 0u);
    EXPECT_TRUE(handed.insert(s->Packed()).second);
  }
  EXPECT_EQ(p.FreeRegions(), 2u);
  // Restored slots free like any other, and a region emptied goes back to the free list.
  ASSERT_TRUE(p.Free({1, 0, 3}).ok());
  EXPECT_EQ(p.FreeRegions(), 3u);
  EXPECT_EQ(p.Restore(slots).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(HostPoolTest, RestoreRefusesWhatNoPoolCouldHoldAndChangesNothing) {
  auto fresh = [] {
    absl::StatusOr<std::unique_ptr<HostPool>> pool =
        HostPool::Create(SmallOptions(4, {64 * kKiB, 256 * kKiB}));
    EXPECT_TRUE(pool.ok());
    return *std::move(pool);
  };
  std::unique_ptr<HostPool> p = fresh();
  // Two classes in one region.
  std::vector<OwnedSlot> two_classes = {{{0, 1, 0}, {}}, {{1, 1, 1}, {}}};
  EXPECT_EQ(p->Restore(two_classes).code(), absl::StatusCode::kInvalidArgument);
  // A slot twice.
  std::vector<OwnedSlot> twice = {{{0, 1, 4}, {}}, {{0, 1, 4}, {}}};
  EXPECT_EQ(p->Restore(twice).code(), absl::StatusCode::kInvalidArgument);
  // Out of the geometry: class 1 has 4 slots per region.
  std::vector<OwnedSlot> outside = {{{1, 0, 4}, {}}};
  EXPECT_EQ(p->Restore(outside).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SumUsed(*p), 0u);
  EXPECT_EQ(p->FreeRegions(), 4u);
  // And the same pool still restores a good set.
  EXPECT_TRUE(p->Restore(std::vector<OwnedSlot>{{{1, 3, 2}, {}}}).ok());
  EXPECT_EQ(p->FreeRegions(), 3u);
}

}  // namespace
}  // namespace kvcellar::core
