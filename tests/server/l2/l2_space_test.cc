// Tests server/l2/l2_space.h on a real host pool and real namespace indexes: slots with their
// owner records, eviction on a full pool (the requesting namespace first, then the largest of its
// size class, never a busy page), watermarks shared in proportion, the eviction observer, admin
// Evict and Clear, and one region release. Region release in depth is l2_region_release_test.cc.
#include "server/l2/l2_space.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::SizeIs;

constexpr uint32_t kChain = 16;  // Pages per prompt.

L2World::Options OneRegion() {
  L2World::Options o;
  o.pool_bytes = kRegionBytes;  // 64 slots of kObjectBytes.
  return o;
}

uint64_t Evicted(const Namespace& ns) {
  return NamespaceCounters::Get(ns.counters().evicted_objects);
}

class L2SpaceTest : public ::testing::Test {
 protected:
  explicit L2SpaceTest(L2World::Options o = OneRegion()) : world_(o) {}

  // Namespace `model`, geometry fixed, with `prompts` prompts of kChain pages committed; their
  // keys.
  std::vector<std::vector<core::PageKey>> Fill(std::shared_ptr<Namespace>* ns,
                                               const std::string& model, uint32_t prompts,
                                               uint32_t pages = kChain) {
    *ns = world_.Adopted(NsSpec(1, false, model));
    std::vector<std::vector<core::PageKey>> chains;
    for (uint32_t p = 0; p < prompts; ++p) {
      chains.push_back(PromptKeys(NsSpec(1, false, model), p, pages));
      EXPECT_EQ(world_.Commit(**ns, chains.back()), pages);
    }
    return chains;
  }

  L2World world_;
};

TEST_F(L2SpaceTest, AllocateRecordsWhoseObjectTheSlotHolds) {
  std::shared_ptr<Namespace> ns = world_.Adopted(NsSpec(2));
  const core::PageKey key = PromptKeys(NsSpec(2), 1, 1)[0];
  absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns, key, /*shard=*/1, 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(world_.pool().SlotBytes(*slot), ns->slot_bytes());
  EXPECT_EQ(world_.l2().UsedBytes(), kObjectBytes);

  std::vector<core::OwnedSlot> owned;
  ASSERT_TRUE(world_.pool().RegionSlots(slot->region, slot->size_class, &owned).ok());
  ASSERT_THAT(owned, SizeIs(1));
  const core::SlotOwner expected = world_.l2().Owner(*ns, key, 1);
  EXPECT_EQ(owned[0].owner.key, expected.key);
  EXPECT_EQ(owned[0].owner.ns, ns->id());
  EXPECT_EQ(owned[0].owner.shard, 1);

  world_.l2().Free(*slot);
  world_.l2().Free(core::SlotRef());  // An invalid slot is ignored.
  EXPECT_EQ(world_.l2().UsedBytes(), 0u);
  EXPECT_EQ(SlotsUsed(world_.pool()), 0u);
}

TEST_F(L2SpaceTest, FullPoolEvictsTheRequestingNamespacesColdestLeafFirst) {
  std::shared_ptr<Namespace> ns;
  const auto chains = Fill(&ns, "model-a", 4);  // 64 pages: the pool is full.
  ASSERT_EQ(SlotsUsed(world_.pool()), kSlotsPerRegion);
  const core::PageKey extra = PromptKeys(NsSpec(1, false, "model-a"), 9, 1)[0];

  absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns, extra, 0, 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  // One slot's worth: the leaf of the least recently used prompt; the index stays prefix-closed.
  EXPECT_EQ(L2World::L2Hits(*ns, chains[0]), kChain - 1);
  for (size_t p = 1; p < chains.size(); ++p) EXPECT_EQ(L2World::L2Hits(*ns, chains[p]), kChain);
  EXPECT_EQ(Evicted(*ns), 1u);
  EXPECT_EQ(NamespaceCounters::Get(ns->counters().evicted_bytes), kObjectBytes);
  const CacheCountersSnapshot m = world_.metrics().Snapshot();
  EXPECT_EQ(m.evicted_pages, 1u);
  EXPECT_EQ(m.evicted_bytes, kObjectBytes);
  EXPECT_EQ(SlotsUsed(world_.pool()), kSlotsPerRegion) << "the evicted slot went to the new page";
  world_.l2().Free(*slot);
}

TEST_F(L2SpaceTest, RequestingNamespaceGivesUpItsOwnPagesBeforeOthers) {
  std::shared_ptr<Namespace> a;
  std::shared_ptr<Namespace> b;
  const auto a_chains = Fill(&a, "model-a", 2);  // Older.
  const auto b_chains = Fill(&b, "model-b", 2);
  const core::PageKey extra = PromptKeys(NsSpec(1, false, "model-b"), 9, 1)[0];
  absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*b, extra, 0, 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(Evicted(*a), 0u) << "model-a's older pages stay";
  EXPECT_EQ(Evicted(*b), 1u);
  EXPECT_EQ(L2World::L2Hits(*a, a_chains[0]), kChain);
  world_.l2().Free(*slot);
}

TEST_F(L2SpaceTest, NamespaceWithNothingToGiveTakesFromTheLargestOfItsClass) {
  std::shared_ptr<Namespace> small;
  std::shared_ptr<Namespace> large;
  Fill(&small, "model-small", 1);  // 16 pages.
  Fill(&large, "model-large", 3);  // 48 pages.
  std::shared_ptr<Namespace> fresh = world_.Adopted(NsSpec(1, false, "model-new"));
  const core::PageKey key = PromptKeys(NsSpec(1, false, "model-new"), 1, 1)[0];
  absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*fresh, key, 0, 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(Evicted(*large), 1u);
  EXPECT_EQ(Evicted(*small), 0u);
  world_.l2().Free(*slot);
}

TEST_F(L2SpaceTest, PinnedAndInFlightPagesAreNeverEvicted) {
  std::shared_ptr<Namespace> ns;
  const auto chains = Fill(&ns, "model-a", 3);  // 48 pages, all pinned below.
  for (const auto& chain : chains) ns->index()->Pin(7, chain, absl::InfiniteFuture());
  // 16 more pages in flight: slots held, not committed.
  const std::vector<core::PageKey> writing = PromptKeys(NsSpec(1, false, "model-a"), 5, kChain);
  for (size_t i = 0; i < writing.size(); ++i) {
    absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns, writing[i], 0, 0);
    ASSERT_TRUE(slot.ok()) << slot.status();
    const std::optional<core::PageKey> parent =
        i == 0 ? std::nullopt : std::optional(writing[i - 1]);
    ASSERT_TRUE(ns->index()->BeginWrite({writing[i], parent, 0, *slot}).ok());
  }
  ASSERT_EQ(SlotsUsed(world_.pool()), kSlotsPerRegion);

  const core::PageKey extra = PromptKeys(NsSpec(1, false, "model-a"), 9, 1)[0];
  absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns, extra, 0, 0);
  EXPECT_EQ(slot.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Evicted(*ns), 0u);
  for (const auto& chain : chains) EXPECT_EQ(L2World::L2Hits(*ns, chain), kChain);
  EXPECT_EQ(ns->index()->Stats().l2_inflight_objects, kChain);

  ns->index()->ReleaseOwner(7);  // Unpinned: now there is room.
  slot = world_.l2().Allocate(*ns, extra, 0, 0);
  EXPECT_TRUE(slot.ok()) << slot.status();
}

TEST_F(L2SpaceTest, ClassWithoutARegionTakesOneFromAnotherClass) {
  L2World world;  // 4 regions.
  std::shared_ptr<Namespace> small = world.Adopted(NsSpec(1, false, "small"));
  for (uint32_t p = 0; p < 16; ++p) {  // 256 pages of 16 KiB: every region.
    ASSERT_EQ(world.Commit(*small, PromptKeys(NsSpec(1, false, "small"), p, kChain)), kChain);
  }
  ASSERT_EQ(world.pool().FreeRegions(), 0u);
  // 64 KiB objects: the pool's second class, which holds no region.
  std::shared_ptr<Namespace> big =
      world.Adopted(NsSpec(1, false, "big"), TestLayout(kLayers, 4 * kBytesPerBlock));
  const core::PageKey key = PromptKeys(NsSpec(1, false, "big"), 1, 1)[0];
  absl::StatusOr<core::SlotRef> slot = world.l2().Allocate(*big, key, 0, 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(world.pool().SlotBytes(*slot), 4 * kObjectBytes);
  EXPECT_EQ(world.l2().regions_released(), 1u);
  EXPECT_GE(Evicted(*small), kSlotsPerRegion) << "a whole region's pages, at least";
  EXPECT_TRUE(small->index()->CheckInvariants().ok());
  EXPECT_EQ(SlotsUsed(world.pool()), small->index()->Stats().l2_objects + 1)
      << "every evicted slot was freed";
  world.l2().Free(*slot);
}

TEST(L2SpaceWatermarkTest, AboveTheHighWatermarkEveryNamespaceGivesItsShare) {
  L2World::Options o = OneRegion();
  o.high_watermark = 0.5;
  o.low_watermark = 0.25;
  L2World world(o);
  std::shared_ptr<Namespace> a = world.Adopted(NsSpec(1, false, "model-a"));
  std::shared_ptr<Namespace> b = world.Adopted(NsSpec(1, false, "model-b"));
  ASSERT_EQ(world.Commit(*a, PromptKeys(NsSpec(1, false, "model-a"), 1, 24)), 24u);
  EXPECT_EQ(world.l2().EnforceWatermarks(), 0u) << "24 of 64 slots: below the high watermark";
  ASSERT_EQ(world.Commit(*b, PromptKeys(NsSpec(1, false, "model-b"), 1, 8)), 8u);
  EXPECT_EQ(world.l2().EnforceWatermarks(), 0u) << "32 of 64: at the high watermark, not above";
  ASSERT_EQ(world.Commit(*b, PromptKeys(NsSpec(1, false, "model-b"), 2, 8)), 8u);

  // 40 slots, low watermark 16: 24 to free, 3/5 from model-a (24 of 40) and 2/5 from model-b.
  const uint64_t freed = world.l2().EnforceWatermarks();
  EXPECT_EQ(freed, (Evicted(*a) + Evicted(*b)) * kObjectBytes);
  EXPECT_LE(world.l2().UsedBytes(), 16 * kObjectBytes);
  EXPECT_GE(Evicted(*a), 14u);
  EXPECT_LE(Evicted(*a), 16u);
  EXPECT_GE(Evicted(*b), 9u);
  EXPECT_LE(Evicted(*b), 11u);
  EXPECT_EQ(world.metrics().Snapshot().evicted_bytes, freed);
  EXPECT_EQ(world.l2().EnforceWatermarks(), 0u);
}

// Takes the slot of every other evicted object, as write_back does while it writes them to L3.
class HoldingObserver final : public L2EvictionObserver {
 public:
  explicit HoldingObserver(core::HostPool* pool) : pool_(pool) {}
  void OnEvicted(Namespace& ns, absl::Span<core::ReleasedObject> released) override {
    for (size_t i = 0; i < released.size(); ++i) {
      EXPECT_TRUE(pool_->Owns(released[i].slot)) << "told before the slots are freed";
      if (i % 2 == 0) {
        held.push_back(released[i].slot);
        released[i].slot = core::SlotRef();
      }
    }
    evicted_from = &ns;
  }
  uint64_t held_bytes() const override { return held.size() * kObjectBytes; }

  std::vector<core::SlotRef> held;
  Namespace* evicted_from = nullptr;

 private:
  core::HostPool* const pool_;
};

TEST_F(L2SpaceTest, ObserverMayKeepEvictedSlotsAndTheWatermarkDoesNotCountThem) {
  std::shared_ptr<Namespace> ns;
  Fill(&ns, "model-a", 2);  // 32 of 64 slots.
  HoldingObserver observer(&world_.pool());
  // Watermarks 0.4 / 0.3 of 64 slots: above 25.6 slots, evict down to 19.2.
  L2Space l2(&world_.pool(), &world_.namespaces(), 0.4, 0.3, &world_.metrics());
  l2.set_eviction_observer(&observer);

  ASSERT_GT(l2.EnforceWatermarks(), 0u);
  const uint64_t evicted = Evicted(*ns);
  EXPECT_EQ(evicted, 13u) << "12.8 slots over the low watermark, in whole objects";
  EXPECT_EQ(observer.evicted_from, ns.get());
  ASSERT_EQ(observer.held.size(), (evicted + 1) / 2);
  for (const core::SlotRef& s : observer.held) EXPECT_TRUE(world_.pool().Owns(s));
  EXPECT_EQ(SlotsUsed(world_.pool()), 32 - evicted + observer.held.size())
      << "only the slots the observer left were freed";

  // Above the high watermark only when the observer's slots count: they are evicted already.
  ASSERT_GT(SlotsUsed(world_.pool()), 25u);
  EXPECT_EQ(l2.EnforceWatermarks(), 0u);
  EXPECT_EQ(Evicted(*ns), evicted);
  l2.set_eviction_observer(nullptr);
  EXPECT_GT(l2.EnforceWatermarks(), 0u) << "counted without the observer";

  for (const core::SlotRef& s : observer.held) l2.Free(s);
  EXPECT_EQ(SlotsUsed(world_.pool()), ns->index()->Stats().l2_objects);
}

TEST_F(L2SpaceTest, AdminEvictTakesUnpinnedPagesOfTheScope) {
  std::shared_ptr<Namespace> ns;
  const auto chains = Fill(&ns, "model-a", 2);
  ns->index()->Pin(7, chains[1], absl::InfiniteFuture());

  const core::AdminEvictResult dry = world_.l2().EvictScope(*ns, std::nullopt, 0, true);
  EXPECT_EQ(dry.objects, kChain);
  EXPECT_EQ(dry.skipped_pinned_pages, kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), 2 * kChain) << "a dry run changes nothing";
  EXPECT_EQ(Evicted(*ns), 0u);

  // A subtree: page 8 of prompt 0 and everything below it.
  const core::AdminEvictResult sub = world_.l2().EvictScope(*ns, chains[0][8], 0, false);
  EXPECT_EQ(sub.pages, 8u);
  EXPECT_EQ(L2World::L2Hits(*ns, chains[0]), 8u);
  const core::AdminEvictResult all = world_.l2().EvictScope(*ns, std::nullopt, 0, false);
  EXPECT_EQ(all.pages, 8u);
  EXPECT_EQ(L2World::L2Hits(*ns, chains[1]), kChain) << "pinned pages stay";
  EXPECT_EQ(SlotsUsed(world_.pool()), kChain);
  EXPECT_EQ(Evicted(*ns), kChain);
  EXPECT_EQ(world_.metrics().Snapshot().evicted_pages, kChain);

  std::shared_ptr<Namespace> no_geometry = world_.namespaces().GetOrCreate(NsSpec(1, false, "x"));
  EXPECT_EQ(world_.l2().EvictScope(*no_geometry, std::nullopt, 0, false).objects, 0u);
}

TEST_F(L2SpaceTest, AdminClearDoomsBusyPagesAndReapsThemOnceFree) {
  std::shared_ptr<Namespace> ns;
  const auto chains = Fill(&ns, "model-a", 2);
  ns->index()->Pin(7, chains[1], absl::InfiniteFuture());  // A copy reading prompt 1.

  // A dry run counts pinned pages as removed (as after the caller revoked its Match pins).
  std::vector<core::ReleasedObject> would;
  core::RemoveCounts dry = world_.l2().ClearScope(*ns, std::nullopt, true, &would);
  EXPECT_EQ(would.size(), 2 * kChain);
  EXPECT_EQ(dry.removed_pages, 2 * kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), 2 * kChain) << "a dry run changes nothing";
  EXPECT_EQ(L2World::L2Hits(*ns, chains[0]), kChain);
  EXPECT_EQ(NamespaceCounters::Get(ns->counters().cleared_objects), 0u);

  std::vector<core::ReleasedObject> removed;
  core::RemoveCounts counts = world_.l2().ClearScope(*ns, std::nullopt, false, &removed);
  EXPECT_EQ(counts.removed_pages, kChain);
  EXPECT_EQ(counts.busy_pages, kChain) << "the pin is a copy's: its pages are doomed";
  EXPECT_EQ(removed.size(), kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), kChain) << "the busy pages keep their slots for now";
  EXPECT_EQ(L2World::L2Hits(*ns, chains[1]), 0u) << "doomed pages are invisible at once";
  EXPECT_EQ(NamespaceCounters::Get(ns->counters().cleared_objects), kChain);
  EXPECT_EQ(world_.metrics().Snapshot().cleared_objects, kChain);

  EXPECT_EQ(world_.l2().ReapDoomed(), 0u) << "still pinned";
  ns->index()->ReleaseOwner(7);
  EXPECT_EQ(world_.l2().ReapDoomed(), kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), 0u);
  EXPECT_EQ(NamespaceCounters::Get(ns->counters().cleared_objects), 2 * kChain);
  EXPECT_EQ(Evicted(*ns), 0u) << "cleared, not evicted";
}

}  // namespace
}  // namespace kvcellar::server::testing
