// Tests the tenant quotas of server/l2/l2_space.h (tenants.quotas): slot bytes charged to the
// tenant from allocation to Free, a tenant at its ceiling evicting its own pages (or NO_SPACE),
// eviction taking pages of tenants above their guarantee first, unused guarantee lent and
// reclaimed, watermark eviction leaving guarantees alone, and no quotas behaving as before. Ends
// with a randomized check against the invariants over many allocations of three tenants.
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/l2/l2_space.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

constexpr uint32_t kChain = 8;  // Pages per prompt.
constexpr uint64_t kSlot = kObjectBytes;

L2World::Options Pool(uint32_t regions, std::vector<TenantQuotaBytes> quotas) {
  L2World::Options o;
  o.pool_bytes = regions * kRegionBytes;
  o.quotas = std::move(quotas);
  return o;
}

class L2SpaceQuotaTest : public ::testing::Test {
 protected:
  void Start(const L2World::Options& o) { world_ = std::make_unique<L2World>(o); }

  std::shared_ptr<Namespace> Ns(const std::string& tenant, const std::string& model = "m") {
    return world_->Adopted(NsSpec(1, false, model, tenant));
  }
  // L2World::Commit, except that a chain whose parent was evicted meanwhile just ends (the
  // data path pins parents first; this test does not).
  size_t Commit(Namespace& ns, const std::vector<core::PageKey>& keys) {
    core::RadixIndex& index = *ns.index();
    for (size_t i = 0; i < keys.size(); ++i) {
      absl::StatusOr<core::SlotRef> slot = world_->l2().Allocate(ns, keys[i], 0, 0);
      if (!slot.ok()) return i;
      const std::optional<core::PageKey> parent =
          i == 0 ? std::nullopt : std::optional(keys[i - 1]);
      if (!index.BeginWrite({keys[i], parent, 0, *slot}).ok()) {
        world_->l2().Free(*slot);
        return i;
      }
      EXPECT_TRUE(index.Commit({keys[i], 0}).ok());
    }
    return keys.size();
  }
  // Commits prompts [first, first + n) of kChain pages; returns the pages committed.
  size_t Fill(Namespace& ns, uint32_t first, uint32_t n) {
    size_t pages = 0;
    for (uint32_t p = first; p < first + n; ++p) {
      pages += Commit(ns, PromptKeys(ns.spec(), p, kChain));
    }
    return pages;
  }
  TenantAccount& Account(const std::string& tenant) { return *world_->tenants().ForTenant(tenant); }
  uint64_t IndexBytes(const Namespace& ns) { return ns.index()->Stats().l2_bytes; }

  std::unique_ptr<L2World> world_;
};

TEST_F(L2SpaceQuotaTest, SlotsAreChargedToTheirTenantUntilFreed) {
  Start(Pool(1, {}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  ASSERT_EQ(Fill(*a, 0, 2), 2 * kChain);
  EXPECT_EQ(Account("team-a").used_bytes(), 2 * kChain * kSlot);
  EXPECT_EQ(Account("team-b").used_bytes(), 0u);

  absl::StatusOr<core::SlotRef> slot =
      world_->l2().TryAllocate(*a, PromptKeys(a->spec(), 9, 1)[0], 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(world_->l2().Owner(*a, {}, 0).tenant, Account("team-a").number());
  EXPECT_EQ(Account("team-a").used_bytes(), (2 * kChain + 1) * kSlot);
  world_->l2().Free(*slot);
  EXPECT_EQ(Account("team-a").used_bytes(), 2 * kChain * kSlot);

  core::AdminEvictResult evicted = world_->l2().EvictScope(*a, std::nullopt, 0, false);
  EXPECT_EQ(evicted.objects, 2 * kChain);
  EXPECT_EQ(Account("team-a").used_bytes(), 0u);
  EXPECT_EQ(Account("team-a").evicted_pages(TenantEvictCause::kAdmin), 2 * kChain);
}

TEST_F(L2SpaceQuotaTest, WithoutQuotasTheRequesterEvictsItsOwnThenTheLargest) {
  // As before quotas: the requesting namespace first, whatever its tenant holds.
  Start(Pool(1, {}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  std::shared_ptr<Namespace> b = Ns("team-b");
  ASSERT_EQ(Fill(*a, 0, 6), 6 * kChain);
  ASSERT_EQ(Fill(*b, 0, 2), 2 * kChain);  // The pool (64 slots) is full.
  ASSERT_EQ(Fill(*b, 2, 1), kChain);
  EXPECT_EQ(Account("team-a").used_bytes(), 6 * kChain * kSlot);
  EXPECT_EQ(Account("team-b").evicted_pages(TenantEvictCause::kOwn), kChain);
  // A tenant holding nothing takes from the largest.
  std::shared_ptr<Namespace> c = Ns("team-c");
  ASSERT_EQ(Commit(*c, PromptKeys(c->spec(), 0, 1)), 1u);
  EXPECT_EQ(Account("team-a").evicted_pages(TenantEvictCause::kOtherTenant), 1u);
}

TEST_F(L2SpaceQuotaTest, TenantAtItsCeilingEvictsItsOwnPages) {
  Start(Pool(1, {{"team-a", 0, 2 * kChain * kSlot}}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  std::shared_ptr<Namespace> a2 = Ns("team-a", "other-model");
  std::shared_ptr<Namespace> b = Ns("team-b");
  ASSERT_EQ(Fill(*b, 0, 1), kChain);
  ASSERT_EQ(Fill(*a, 0, 1), kChain);
  ASSERT_EQ(Fill(*a2, 0, 1), kChain);
  ASSERT_EQ(Fill(*a, 1, 3), 3 * kChain) << "the pool has room, the ceiling does not";
  EXPECT_EQ(Account("team-a").used_bytes(), 2 * kChain * kSlot);
  EXPECT_EQ(IndexBytes(*b), kChain * kSlot) << "another tenant is never touched";
  EXPECT_EQ(Account("team-a").evicted_pages(TenantEvictCause::kOwn), 3 * kChain);
  EXPECT_EQ(IndexBytes(*a2), kChain * kSlot) << "the requesting namespace gave first";
  EXPECT_EQ(world_->pool().Stats()[0].bytes_used, 3 * kChain * kSlot);
}

TEST_F(L2SpaceQuotaTest, TenantAtItsCeilingWithNothingToEvictGetsNoSpace) {
  Start(Pool(1, {{"team-a", 0, 4 * kSlot}}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  const std::vector<core::PageKey> keys = PromptKeys(a->spec(), 0, 5);
  std::vector<core::SlotRef> slots;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<core::SlotRef> s = world_->l2().Allocate(*a, keys[i], 0, 0);
    ASSERT_TRUE(s.ok()) << s.status();
    slots.push_back(*s);  // Held, as a write in transit: nothing of team-a can be evicted.
  }
  absl::StatusOr<core::SlotRef> refused = world_->l2().Allocate(*a, keys[4], 0, 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("ceiling"));
  EXPECT_EQ(Account("team-a").used_bytes(), 4 * kSlot);
  EXPECT_EQ(Account("team-a").ceiling_refusals(), 1u);
  EXPECT_EQ(world_->l2().TryAllocate(*a, keys[4], 0).status().code(),
            absl::StatusCode::kResourceExhausted);
  for (core::SlotRef s : slots) world_->l2().Free(s);
  EXPECT_EQ(Account("team-a").used_bytes(), 0u);
}

TEST_F(L2SpaceQuotaTest, BurstOfOneTenantLeavesAnotherAtItsGuarantee) {
  // team-a is guaranteed half the pool (32 slots) and holds 4 prompts = 32 slots.
  Start(Pool(1, {{"team-a", 32 * kSlot, 64 * kSlot}, {"team-b", 0, 64 * kSlot}}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  std::shared_ptr<Namespace> b = Ns("team-b");
  ASSERT_EQ(Fill(*a, 0, 4), 4 * kChain);
  ASSERT_EQ(Fill(*b, 0, 40), 40 * kChain) << "team-b churns through its own half";
  EXPECT_EQ(Account("team-a").used_bytes(), 32 * kSlot);
  for (uint32_t p = 0; p < 4; ++p) {
    EXPECT_EQ(L2World::L2Hits(*a, PromptKeys(a->spec(), p, kChain)), kChain);
  }
  EXPECT_EQ(Account("team-a").evicted_pages(TenantEvictCause::kOtherTenant), 0u);
  EXPECT_EQ(Account("team-b").used_bytes(), 32 * kSlot);
}

TEST_F(L2SpaceQuotaTest, UnusedGuaranteeIsLentAndReclaimed) {
  Start(Pool(1, {{"team-a", 32 * kSlot, 64 * kSlot}, {"team-b", 32 * kSlot, 64 * kSlot}}));
  std::shared_ptr<Namespace> a = Ns("team-a");
  std::shared_ptr<Namespace> b = Ns("team-b");
  // team-a is idle: team-b borrows the whole pool.
  ASSERT_EQ(Fill(*b, 0, 8), 8 * kChain);
  EXPECT_EQ(Account("team-b").used_bytes(), 64 * kSlot);
  // team-a comes back: it takes pages from team-b, which is above its guarantee...
  ASSERT_EQ(Fill(*a, 0, 4), 4 * kChain);
  EXPECT_EQ(Account("team-b").evicted_pages(TenantEvictCause::kOtherTenant), 4 * kChain);
  EXPECT_EQ(Account("team-b").used_bytes(), 32 * kSlot);
  // ...until team-b is back at its guarantee; past its own, team-a evicts its own pages.
  ASSERT_EQ(Fill(*a, 4, 2), 2 * kChain);
  EXPECT_EQ(Account("team-b").used_bytes(), 32 * kSlot);
  EXPECT_EQ(Account("team-a").evicted_pages(TenantEvictCause::kOwn), 2 * kChain);
  // And team-b, at its guarantee while team-a holds more than none, still churns its own.
  ASSERT_EQ(Fill(*b, 8, 2), 2 * kChain);
  EXPECT_EQ(Account("team-a").used_bytes(), 32 * kSlot);
}

TEST_F(L2SpaceQuotaTest, WatermarkEvictionTakesOnlyExcessOverGuarantees) {
  L2World::Options o = Pool(1, {{"team-a", 32 * kSlot, 64 * kSlot}});
  o.high_watermark = 0.9;
  o.low_watermark = 0.5;
  Start(o);
  std::shared_ptr<Namespace> a = Ns("team-a");
  std::shared_ptr<Namespace> b = Ns("team-b");
  ASSERT_EQ(Fill(*a, 0, 5), 5 * kChain);  // 40 slots: 8 above its guarantee.
  ASSERT_EQ(Fill(*b, 0, 3), 3 * kChain);  // 24 slots: all excess (no quota).
  const uint64_t freed = world_->l2().EnforceWatermarks();
  EXPECT_GE(freed, 32 * kSlot);
  EXPECT_GE(Account("team-a").used_bytes(), 32 * kSlot);
  EXPECT_EQ(Account("team-a").used_bytes() + Account("team-b").used_bytes(), 64 * kSlot - freed);
}

// Three tenants with random guarantees and ceilings allocate, evict, hold and free at random. After
// each step: every tenant is within its ceiling, the ledger equals what the pool and the indexes
// hold, and no tenant went below min(what it held before, its guarantee) through another
// tenant's allocation or the watermark.
TEST_F(L2SpaceQuotaTest, RandomizedNoTenantIsPushedBelowItsGuaranteeByAnother) {
  uint64_t taken_by_others = 0;  // So the check is not vacuous: tenants did take from others.
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const uint64_t pool_slots = 2 * kSlotsPerRegion;
    std::vector<std::string> names = {"t0", "t1", "t2"};
    std::vector<TenantQuotaBytes> quotas;
    uint64_t left = pool_slots;
    for (const std::string& n : names) {
      const uint64_t g = std::uniform_int_distribution<uint64_t>(0, left / 2)(rng);
      left -= g;
      const uint64_t c = std::uniform_int_distribution<uint64_t>(g, pool_slots)(rng);
      if (rng() % 4 != 0) quotas.push_back({n, g * kSlot, std::max<uint64_t>(c, 1) * kSlot});
    }
    L2World::Options o = Pool(2, quotas);
    o.high_watermark = 0.95;
    o.low_watermark = 0.8;
    Start(o);
    std::vector<std::shared_ptr<Namespace>> spaces;
    std::vector<TenantAccount*> accounts;
    for (const std::string& n : names) {
      accounts.push_back(&Account(n));
      spaces.push_back(Ns(n, "m1"));
      spaces.push_back(Ns(n, "m2"));
    }
    std::vector<std::pair<core::SlotRef, size_t>> held;  // Slots in transit, and their tenant.
    uint32_t next_prompt = 0;
    for (int step = 0; step < 400; ++step) {
      std::vector<uint64_t> before;
      for (TenantAccount* t : accounts) before.push_back(t->used_bytes());
      const size_t who = rng() % spaces.size();
      Namespace& ns = *spaces[who];
      size_t tenant = who / 2;  // Whose doing the step is.
      const int op = static_cast<int>(rng() % 10);
      if (op < 6) {
        const uint32_t pages = 1 + rng() % (2 * kChain);
        Commit(ns, PromptKeys(ns.spec(), next_prompt++, pages));
      } else if (op == 6) {
        absl::StatusOr<core::SlotRef> s =
            world_->l2().Allocate(ns, PromptKeys(ns.spec(), next_prompt++, 1)[0], 0, 0);
        if (s.ok()) held.emplace_back(*s, tenant);
      } else if (op == 7 && !held.empty()) {
        tenant = held.back().second;  // A slot in transit freed by its own tenant.
        world_->l2().Free(held.back().first);
        held.pop_back();
      } else if (op == 8) {
        world_->l2().EvictScope(ns, std::nullopt, 1 + rng() % kChain, false);
      } else {
        world_->l2().EnforceWatermarks();
      }
      uint64_t charged = 0;
      for (size_t t = 0; t < accounts.size(); ++t) {
        const TenantAccount& a = *accounts[t];
        charged += a.used_bytes();
        ASSERT_LE(a.used_bytes(), a.ceiling_bytes()) << a.tenant() << " step " << step;
        const bool own = t == tenant && op != 9;
        if (!own) {
          ASSERT_GE(a.used_bytes(), std::min(before[t], a.guarantee_bytes()))
              << a.tenant() << " step " << step << " op " << op << " by " << names[tenant];
        }
        uint64_t indexed = 0;
        for (size_t i = 0; i < 2; ++i) indexed += IndexBytes(*spaces[2 * t + i]);
        for (const auto& [slot, owner] : held) indexed += owner == t ? kSlot : 0;
        ASSERT_EQ(a.used_bytes(), indexed) << a.tenant() << " step " << step;
      }
      ASSERT_EQ(charged, world_->l2().UsedBytes()) << "step " << step;
    }
    for (const auto& [slot, owner] : held) world_->l2().Free(slot);
    for (TenantAccount* t : accounts) {
      taken_by_others += t->evicted_pages(TenantEvictCause::kOtherTenant);
    }
  }
  EXPECT_GT(taken_by_others, 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
