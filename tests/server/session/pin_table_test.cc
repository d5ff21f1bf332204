// Tests server/session/pin_table.h: Match pins with one hold per TP rank, their leases, and that
// every way a pin ends unpins exactly its pages in the namespace's real index.
#include "server/session/pin_table.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr absl::Duration kLease = absl::Seconds(30);

class PinTableTest : public ::testing::Test {
 protected:
  PinTableTest() : ns_(world_.Adopted(NsSpec())), keys_(PromptKeys(NsSpec(), 1, 6)) {
    EXPECT_EQ(world_.Commit(*ns_, keys_), keys_.size());
  }

  // What Match does: pins keys[begin, end) in the index under `id`, then records the pin.
  void Pin(uint64_t id, const std::string& instance, size_t begin, size_t end, uint32_t holds,
           absl::Time now = absl::Now(), uint64_t session = 0) {
    std::vector<core::PageKey> keys(keys_.begin() + begin, keys_.begin() + end);
    ns_->index()->Pin(id, keys, now + kLease);
    pins_.Add(id, instance, ns_, std::move(keys), holds, kLease, now + kLease, session);
  }

  // Pins the index holds on keys_[i] (all owners).
  uint32_t PinsOn(size_t i) { return ns_->index()->Inspect(keys_[i])->pins; }
  uint64_t PinnedPages() { return ns_->index()->Stats().pinned_pages; }

  L2World world_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  PinTable pins_;
};

TEST_F(PinTableTest, PinEndsWithTheLastRanksHold) {
  Pin(100, "inst", 0, 3, /*holds=*/2);
  EXPECT_EQ(pins_.size(), 1u);
  EXPECT_EQ(PinnedPages(), 3u);

  EXPECT_FALSE(pins_.DropHold(100, "inst", 1));
  EXPECT_FALSE(pins_.DropHold(100, "inst", 1)) << "a rank's second drop counts nothing";
  EXPECT_FALSE(pins_.DropHold(100, "inst", 7)) << "a rank beyond the holds counts nothing";
  EXPECT_EQ(pins_.size(), 1u);
  EXPECT_EQ(PinnedPages(), 3u) << "rank 0 still holds the pages";

  EXPECT_TRUE(pins_.DropHold(100, "inst", 0));
  EXPECT_EQ(pins_.size(), 0u);
  EXPECT_EQ(PinnedPages(), 0u);
}

TEST_F(PinTableTest, AnotherInstanceCannotDropOrReleaseAPin) {
  Pin(100, "inst", 0, 2, 1);
  EXPECT_FALSE(pins_.DropHold(100, "intruder", 0));
  EXPECT_FALSE(pins_.Release(100, "intruder"));
  EXPECT_FALSE(pins_.DropHold(999, "inst", 0)) << "unknown pin";
  EXPECT_FALSE(pins_.Release(999, "inst"));
  EXPECT_EQ(pins_.size(), 1u);
  EXPECT_EQ(PinnedPages(), 2u);
}

TEST_F(PinTableTest, ReleaseDropsTheWholePinAndOnlyItsOwnIndexPins) {
  Pin(100, "inst", 0, 3, 4);
  Pin(101, "inst", 1, 2, 1);  // Page 1 pinned twice, by two pins.
  EXPECT_EQ(PinsOn(1), 2u);
  EXPECT_TRUE(pins_.Release(100, "inst"));
  EXPECT_FALSE(pins_.Release(100, "inst")) << "already released";
  EXPECT_EQ(PinsOn(0), 0u);
  EXPECT_EQ(PinsOn(1), 1u) << "pin 101's hold on page 1 stays";
  EXPECT_EQ(pins_.size(), 1u);
}

TEST_F(PinTableTest, RenewExtendsKnownPinsAndNamesTheUnknownOnes) {
  const absl::Time t0 = absl::Now();
  Pin(100, "inst", 0, 2, 1, t0);
  Pin(101, "other", 2, 3, 1, t0);
  Pin(102, "inst", 3, 4, 1, t0 - 2 * kLease);  // Already lapsed.

  const absl::Time t1 = t0 + kLease / 2;
  EXPECT_THAT(pins_.Renew({100, 101, 102, 999}, "inst", t1), ElementsAre(101, 102, 999));

  // Pin 100 now lasts until t1 + kLease, in the table and in the index.
  EXPECT_EQ(pins_.ExpireDue(t0 + kLease), 2u) << "101 and 102 lapse, 100 was renewed";
  EXPECT_EQ(ns_->index()->ExpireLeases(t0 + kLease), 0u)
      << "the renewal moved pin 100's lease in the index too; 101 and 102 are unpinned already";
  EXPECT_EQ(PinsOn(0), 2u) << "pin 100: its first pin and the renewal's";
  EXPECT_EQ(PinsOn(2), 0u);
  EXPECT_EQ(pins_.size(), 1u);

  EXPECT_EQ(pins_.ExpireDue(t1 + kLease), 1u);
  EXPECT_EQ(pins_.size(), 0u);
  EXPECT_EQ(PinnedPages(), 0u) << "ending the pin unpins its pages";
}

TEST_F(PinTableTest, ExpireDueEndsPinsAtTheirDeadline) {
  const absl::Time t0 = absl::Now();
  Pin(100, "inst", 0, 2, 1, t0);
  Pin(101, "inst", 2, 4, 1, t0 + absl::Seconds(5));
  EXPECT_EQ(pins_.ExpireDue(t0 + kLease - absl::Nanoseconds(1)), 0u);
  EXPECT_EQ(pins_.ExpireDue(t0 + kLease), 1u) << "deadline <= now";
  EXPECT_EQ(PinsOn(0), 0u);
  EXPECT_EQ(PinsOn(2), 1u);
  EXPECT_THAT(pins_.Renew({100}, "inst", t0), ElementsAre(100)) << "an expired pin is unknown";
}

TEST_F(PinTableTest, InstanceEndReleasesItsPinsOnly) {
  Pin(100, "a", 0, 2, 2);
  Pin(101, "a", 2, 3, 2);
  Pin(102, "b", 3, 4, 1);
  EXPECT_EQ(pins_.ReleaseInstance("a"), 2u);
  EXPECT_EQ(pins_.ReleaseInstance("a"), 0u);
  EXPECT_EQ(pins_.size(), 1u);
  EXPECT_EQ(PinsOn(0), 0u);
  EXPECT_EQ(PinsOn(3), 1u);
}

TEST_F(PinTableTest, WorkerEndDropsItsRanksHolds) {
  Pin(100, "a", 0, 2, 2);  // Ranks 0 and 1.
  Pin(101, "a", 2, 3, 1);  // Rank 0 only.
  Pin(102, "b", 3, 4, 2);
  EXPECT_EQ(pins_.DropRankHolds("a", 1), 0u) << "pin 100 still held by rank 0";
  EXPECT_EQ(pins_.DropRankHolds("a", 1), 0u);
  EXPECT_EQ(pins_.size(), 3u);
  EXPECT_EQ(pins_.DropRankHolds("a", 0), 2u) << "100 and 101 lose their last hold";
  EXPECT_EQ(pins_.size(), 1u);
  EXPECT_EQ(PinsOn(0), 0u);
  EXPECT_EQ(PinsOn(2), 0u);
  EXPECT_EQ(PinsOn(3), 1u);
}

TEST_F(PinTableTest, ExtendPinsLandedPagesUntilThePinsDeadline) {
  const absl::Time t0 = absl::Now();
  Pin(100, "inst", 0, 2, 1, t0);
  EXPECT_TRUE(pins_.Extend(100, {keys_[2], keys_[3]}));
  EXPECT_EQ(PinsOn(3), 1u);
  EXPECT_EQ(pins_.UsageBySession()[0].pages, 4u) << "the pin covers the landed pages";

  // Renewals cover them too; the pin's end unpins them.
  EXPECT_THAT(pins_.Renew({100}, "inst", t0 + absl::Seconds(1)), IsEmpty());
  EXPECT_EQ(PinsOn(3), 2u);
  EXPECT_TRUE(pins_.Release(100, "inst"));
  EXPECT_EQ(PinnedPages(), 0u);

  EXPECT_FALSE(pins_.Extend(100, {keys_[4]})) << "the pin has ended";
  EXPECT_EQ(PinsOn(4), 0u) << "nothing pinned for an ended pin";
}

TEST_F(PinTableTest, RevokeEndsThePinsThePredicateNames) {
  std::shared_ptr<Namespace> other = world_.Adopted(NsSpec(1, false, "other-model"));
  const std::vector<core::PageKey> other_keys = PromptKeys(NsSpec(1, false, "other-model"), 1, 2);
  ASSERT_EQ(world_.Commit(*other, other_keys), 2u);
  Pin(100, "inst", 0, 2, 1);
  Pin(101, "inst", 4, 6, 1);
  other->index()->Pin(102, other_keys, absl::Now() + kLease);
  pins_.Add(102, "inst", other, other_keys, 1, kLease, absl::Now() + kLease);

  // Revoke the pins of this namespace that hold page 4.
  const size_t revoked = pins_.Revoke([&](const Namespace& ns, absl::Span<const core::PageKey> k) {
    return &ns == ns_.get() && std::find(k.begin(), k.end(), keys_[4]) != k.end();
  });
  EXPECT_EQ(revoked, 1u);
  EXPECT_EQ(pins_.size(), 2u);
  EXPECT_EQ(PinsOn(4), 0u);
  EXPECT_EQ(PinsOn(0), 1u);
  EXPECT_EQ(other->index()->Stats().pinned_pages, 2u);
  EXPECT_FALSE(pins_.Release(101, "inst")) << "a revoked pin is unknown";
}

TEST_F(PinTableTest, UsageCountsPinsAndPagesBySession) {
  Pin(100, "inst", 0, 3, 1, absl::Now(), /*session=*/11);
  Pin(101, "inst", 3, 4, 1, absl::Now(), 11);
  Pin(102, "inst", 4, 6, 1, absl::Now(), 12);
  absl::flat_hash_map<uint64_t, PinTable::Usage> usage = pins_.UsageBySession();
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[11].pins, 2u);
  EXPECT_EQ(usage[11].pages, 4u);
  EXPECT_EQ(usage[12].pins, 1u);
  EXPECT_EQ(usage[12].pages, 2u);
}

}  // namespace
}  // namespace kvcellar::server::testing
