// Tests server/l3/l3_lookup.h with real file tiers and a real index: what the index knows, what
// the backends add within the budget (and the index records), and which tier each page is read
// from.
#include "server/l3/l3_lookup.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;

constexpr absl::Duration kBudget = absl::Seconds(2);

// Puts every shard of `keys` into tier `tier`'s backend only: another node's writes, or files a
// restarted daemon has not indexed.
void PutBehindTheIndex(L3World& world, Namespace& ns, size_t tier,
                       const std::vector<core::PageKey>& keys) {
  for (const core::PageKey& key : keys) {
    for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
      ASSERT_EQ(storage::testing::PutOne(world.backend(tier), ns.digest(), key, shard,
                                         ns.object_bytes()),
                storage::ObjectStatus::kOk);
    }
  }
}

// What the index knows of tier runs from keys[0] on.
TierRuns IndexRuns(Namespace& ns, const std::vector<core::PageKey>& keys) {
  core::MatchOptions options;
  options.shards = ns.group_shards();
  absl::StatusOr<core::MatchResult> m = ns.index()->Match(keys, options);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? m->l3_pages : TierRuns{};
}

TEST(L3LookupTest, BudgetIsTheRequestsCappedByTheDaemonsMaximum) {
  L3World world;
  L3Lookup lookup(&world.tiers(), absl::Milliseconds(50));
  EXPECT_EQ(lookup.num_tiers(), 1u);
  EXPECT_EQ(lookup.Budget(20), absl::Milliseconds(20));
  EXPECT_EQ(lookup.Budget(500), absl::Milliseconds(50));
  EXPECT_EQ(lookup.Budget(0), absl::ZeroDuration());
}

TEST(L3LookupTest, WithoutABudgetOnlyTheIndexCounts) {
  L3World world;
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 0, 6);
  world.StoreInL3(*ns, 0, {keys.begin(), keys.begin() + 2});
  PutBehindTheIndex(world, *ns, 0, {keys.begin() + 2, keys.end()});
  L3Lookup lookup(&world.tiers(), kBudget);
  L3LookupInput in;
  in.lookup = keys;
  in.index_runs = IndexRuns(*ns, keys);
  in.budget = absl::ZeroDuration();
  EXPECT_EQ(lookup.Runs(*ns, in)[0], 2u);
}

TEST(L3LookupTest, TheBackendsExtendTheRunAndTheIndexRemembersIt) {
  L3World world;
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 0, 6);
  world.StoreInL3(*ns, 0, {keys.begin(), keys.begin() + 2});
  PutBehindTheIndex(world, *ns, 0, {keys.begin() + 2, keys.begin() + 5});
  L3Lookup lookup(&world.tiers(), kBudget);
  L3LookupInput in;
  in.lookup = keys;
  in.index_runs = IndexRuns(*ns, keys);
  ASSERT_EQ(in.index_runs[0], 2u);
  in.budget = kBudget;
  EXPECT_EQ(lookup.Runs(*ns, in)[0], 5u);  // Page 5 is nowhere.
  // Recorded: the next Match knows all five without asking.
  EXPECT_EQ(IndexRuns(*ns, keys)[0], 5u);
}

TEST(L3LookupTest, AnUnknownFirstParentIsNotAskedAbout) {
  L3World world;
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 0, 4);
  PutBehindTheIndex(world, *ns, 0, keys);
  L3Lookup lookup(&world.tiers(), kBudget);
  L3LookupInput in;
  in.lookup = keys;
  in.budget = kBudget;
  in.parent0_known = false;  // Keys sent from a page > 0: no place in the index for page 0.
  EXPECT_EQ(lookup.Runs(*ns, in)[0], 0u);
  in.parent0_known = true;
  EXPECT_EQ(lookup.Runs(*ns, in)[0], 4u);
}

TEST(L3LookupTest, EachPageIsReadFromTheFirstTierThatCoversIt) {
  L3World world({"", ""});
  L3Lookup lookup(&world.tiers(), kBudget);
  ASSERT_EQ(lookup.num_tiers(), 2u);
  TierRuns runs{};
  runs[0] = 2;
  runs[1] = 5;
  std::vector<int> tier_of_page;
  std::vector<uint32_t> by_tier(2, 0);
  EXPECT_EQ(lookup.Attribute(runs, &tier_of_page, absl::MakeSpan(by_tier)), 5u);
  EXPECT_THAT(tier_of_page, ElementsAre(0, 0, 1, 1, 1));
  EXPECT_THAT(by_tier, ElementsAre(2u, 3u));
  runs = TierRuns{};
  EXPECT_EQ(lookup.Attribute(runs, &tier_of_page, absl::MakeSpan(by_tier)), 0u);
  EXPECT_TRUE(tier_of_page.empty());
}

}  // namespace
}  // namespace kvcellar::server::testing
