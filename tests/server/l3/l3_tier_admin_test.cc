// Tests server/l3/l3_tier_admin.h over two real file tiers: usage counted from the index's marks
// per backend, Evict deepest page first until the target, Clear of everything in scope, both
// deleting the objects from the backends and the marks from the index.
#include "server/l3/l3_tier_admin.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::SizeIs;

constexpr uint32_t kPages = 4;

class L3TierAdminTest : public ::testing::Test {
 protected:
  L3TierAdminTest()
      : world_({"", ""}),
        admin_(&world_.tiers(), &world_.namespaces()),
        ns_(world_.Adopted(NsSpec(2))),
        keys_(PromptKeys(NsSpec(2), 1, kPages)) {
    // Pages 0..3 in tier t0, pages 0..1 in tier t1; none in L2.
    world_.StoreInL3(*ns_, 0, keys_);
    world_.StoreInL3(*ns_, 1, {keys_[0], keys_[1]});
  }

  L3Scope Scope(std::vector<std::string> backends = {},
                std::optional<core::PageKey> subtree = std::nullopt) {
    return L3Scope{ns_->digest(), subtree, std::move(backends)};
  }

  L3World world_;
  L3TierAdmin admin_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
};

MATCHER_P4(IsUsage, backend, objects, pages, bytes, "") {
  return arg.backend == backend && arg.objects == static_cast<uint64_t>(objects) &&
         arg.pages == static_cast<uint64_t>(pages) && arg.bytes == static_cast<uint64_t>(bytes);
}

TEST_F(L3TierAdminTest, BackendsAreTheTierNamesInLookupOrder) {
  EXPECT_THAT(admin_.Backends(), ElementsAre("t0", "t1"));
}

TEST_F(L3TierAdminTest, UsageCountsTheIndexMarksPerBackend) {
  absl::StatusOr<std::vector<L3BackendUsage>> all = admin_.Usage(Scope());
  ASSERT_TRUE(all.ok()) << all.status();
  // Two shards per page.
  EXPECT_THAT(*all, ElementsAre(IsUsage("t0", 8, 4, 8 * kObjectBytes),
                                IsUsage("t1", 4, 2, 4 * kObjectBytes)));

  absl::StatusOr<std::vector<L3BackendUsage>> t1 = admin_.Usage(Scope({"t1"}));
  ASSERT_TRUE(t1.ok());
  EXPECT_THAT(*t1, ElementsAre(IsUsage("t1", 4, 2, 4 * kObjectBytes)));

  absl::StatusOr<std::vector<L3BackendUsage>> subtree = admin_.Usage(Scope({}, keys_[1]));
  ASSERT_TRUE(subtree.ok());
  EXPECT_THAT(*subtree, ElementsAre(IsUsage("t0", 6, 3, 6 * kObjectBytes),
                                    IsUsage("t1", 2, 1, 2 * kObjectBytes)));

  // A namespace the daemon does not know: one empty entry per tier in scope.
  absl::StatusOr<std::vector<L3BackendUsage>> unknown =
      admin_.Usage(L3Scope{NsSpec(1, false, "other").Digest(), std::nullopt, {}});
  ASSERT_TRUE(unknown.ok());
  EXPECT_THAT(*unknown, ElementsAre(IsUsage("t0", 0, 0, 0), IsUsage("t1", 0, 0, 0)));
}

TEST_F(L3TierAdminTest, EvictRemovesDeepestPagesFirstUntilTheTarget) {
  absl::StatusOr<std::vector<L3BackendUsage>> dry = admin_.Evict(Scope({"t0"}), 1, true);
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_THAT(*dry, ElementsAre(IsUsage("t0", 2, 1, 2 * kObjectBytes)));
  EXPECT_EQ(ns_->index()->Stats().l3_objects[0], 8u) << "a dry run removes nothing";
  EXPECT_EQ(world_.Read(*ns_, 0, keys_[3]), storage::ObjectStatus::kOk);

  // Three objects' worth from t0: page 3 (two objects), then page 2.
  absl::StatusOr<std::vector<L3BackendUsage>> r =
      admin_.Evict(Scope({"t0"}), 3 * kObjectBytes, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(*r, ElementsAre(IsUsage("t0", 4, 2, 4 * kObjectBytes)));
  for (uint16_t shard = 0; shard < 2; ++shard) {
    EXPECT_EQ(world_.Read(*ns_, 0, keys_[3], shard), storage::ObjectStatus::kNotFound);
    EXPECT_EQ(world_.Read(*ns_, 0, keys_[2], shard), storage::ObjectStatus::kNotFound);
    EXPECT_EQ(world_.Read(*ns_, 0, keys_[1], shard), storage::ObjectStatus::kOk);
  }
  EXPECT_EQ(ns_->index()->Stats().l3_objects[0], 4u);
  EXPECT_EQ(ns_->index()->Stats().l3_objects[1], 4u) << "t1 was not named";
  EXPECT_EQ(world_.Read(*ns_, 1, keys_[1]), storage::ObjectStatus::kOk);
}

TEST_F(L3TierAdminTest, ClearRemovesEverythingInScopeAndPagesInNoTierLeaveTheIndex) {
  absl::StatusOr<std::vector<L3BackendUsage>> sub = admin_.Clear(Scope({}, keys_[2]), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_THAT(*sub, ElementsAre(IsUsage("t0", 4, 2, 4 * kObjectBytes), IsUsage("t1", 0, 0, 0)));
  EXPECT_FALSE(ns_->index()->Inspect(keys_[3]).has_value()) << "held by no tier any more";
  EXPECT_TRUE(ns_->index()->Inspect(keys_[1]).has_value());

  absl::StatusOr<std::vector<L3BackendUsage>> all = admin_.Clear(Scope(), false);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(*all, ElementsAre(IsUsage("t0", 4, 2, 4 * kObjectBytes),
                                IsUsage("t1", 4, 2, 4 * kObjectBytes)));
  EXPECT_EQ(ns_->index()->Stats().pages, 0u);
  EXPECT_EQ(world_.Read(*ns_, 0, keys_[0]), storage::ObjectStatus::kNotFound);
  EXPECT_EQ(world_.Read(*ns_, 1, keys_[0]), storage::ObjectStatus::kNotFound);
  absl::StatusOr<std::vector<L3BackendUsage>> again = admin_.Usage(Scope());
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(*again, ElementsAre(IsUsage("t0", 0, 0, 0), IsUsage("t1", 0, 0, 0)));
}

TEST_F(L3TierAdminTest, CopiesOfPagesStillInL2LeaveOnlyL3) {
  std::shared_ptr<Namespace> ns = world_.Adopted(NsSpec(1, false, "resident"));
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(1, false, "resident"), 1, 2);
  ASSERT_EQ(world_.Commit(*ns, keys), 2u);
  world_.StoreInL3(*ns, 1, keys);
  absl::StatusOr<std::vector<L3BackendUsage>> r =
      admin_.Clear(L3Scope{ns->digest(), std::nullopt, {}}, false);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, SizeIs(2));
  EXPECT_EQ((*r)[1].objects, 2u);
  EXPECT_EQ(L2World::L2Hits(*ns, keys), 2u) << "L2 keeps its copies";
  EXPECT_EQ(ns->index()->Stats().l3_objects[1], 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
