// Tests server/session/tenant_ledger.h (accounts, numbering, the ceiling's charge) and
// server/session/tenant_metrics.h (usage joined with namespace counters, bounded series).
#include "server/session/tenant_ledger.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config/tenant_quota.h"
#include "server/session/tenant_metrics.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

TEST(TenantLedgerTest, QuotasFirstThenTenantsAsTheyCome) {
  TenantLedger ledger({{"team-b", 100, 200}, {"team-a", 0, 50}});
  EXPECT_TRUE(ledger.has_quotas());
  TenantAccount* b = ledger.ForTenant("team-b");
  EXPECT_EQ(b->number(), 1);
  EXPECT_TRUE(b->has_quota());
  EXPECT_EQ(b->guarantee_bytes(), 100u);
  EXPECT_EQ(b->ceiling_bytes(), 200u);
  TenantAccount* c = ledger.ForTenant("team-c");
  EXPECT_EQ(c->number(), 3);
  EXPECT_FALSE(c->has_quota());
  EXPECT_EQ(c->ceiling_bytes(), TenantAccount::kNoCeiling);
  EXPECT_EQ(ledger.ForTenant("team-c"), c);
  EXPECT_EQ(ledger.ByNumber(2), ledger.ForTenant("team-a"));
  EXPECT_EQ(ledger.ByNumber(0), nullptr);
  EXPECT_EQ(ledger.ByNumber(4), nullptr);
  EXPECT_EQ(ledger.Snapshot().size(), 3u);
  EXPECT_FALSE(TenantLedger().has_quotas());
}

TEST(TenantLedgerTest, ChargeNeverPassesTheCeiling) {
  TenantAccount a("a", 1, 10, 100, true);
  EXPECT_TRUE(a.TryCharge(60));
  EXPECT_FALSE(a.TryCharge(41));
  EXPECT_TRUE(a.TryCharge(40));
  EXPECT_EQ(a.used_bytes(), 100u);
  EXPECT_EQ(a.excess_bytes(), 90u);
  a.Discharge(95);
  EXPECT_EQ(a.excess_bytes(), 0u);
  // Many threads racing for the last bytes: exactly the ceiling is charged.
  TenantAccount raced("r", 2, 0, 1000, true);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&raced] {
      for (int i = 0; i < 1000; ++i) raced.TryCharge(3);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(raced.used_bytes(), 999u);
}

TEST(TenantLedgerTest, TenantsPastTheLimitShareTheOverflowAccount) {
  TenantLedger ledger;
  for (int i = 0; i < TenantLedger::kMaxAccounts - 1; ++i) {
    ASSERT_EQ(ledger.ForTenant(absl::StrCat("t", i))->number(), i + 1);
  }
  TenantAccount* over = ledger.ForTenant("late-1");
  EXPECT_EQ(over->tenant(), TenantLedger::kOverflowTenant);
  EXPECT_EQ(over->number(), TenantLedger::kMaxAccounts);
  EXPECT_EQ(ledger.ForTenant("late-2"), over);
}

TEST(TenantMetricsTest, UsageJoinsAccountsAndNamespacesAndSeriesAreBounded) {
  L2World::Options o;
  o.quotas = {{"team-a", 4 * kObjectBytes, 16 * kObjectBytes}};
  L2World world(o);
  std::shared_ptr<Namespace> a = world.Adopted(NsSpec(1, false, "m", "team-a"));
  std::shared_ptr<Namespace> b = world.Adopted(NsSpec(1, false, "m", "team-b"));
  std::shared_ptr<Namespace> c = world.Adopted(NsSpec(1, false, "m", "team-c"));
  ASSERT_EQ(world.Commit(*a, PromptKeys(a->spec(), 1, 3)), 3u);
  ASSERT_EQ(world.Commit(*b, PromptKeys(b->spec(), 1, 2)), 2u);
  NamespaceCounters::Add(a->counters().lookup_pages, 10);
  NamespaceCounters::Add(a->counters().l2_hit_pages, 6);
  NamespaceCounters::Add(a->counters().l3_hit_pages, 1);

  const std::vector<TenantUsage> usage =
      CollectTenantUsage(world.tenants(), world.namespaces().Snapshot(), 1000 * kObjectBytes);
  ASSERT_EQ(usage.size(), 3u);
  EXPECT_EQ(usage[0].tenant, "team-a");
  EXPECT_TRUE(usage[0].has_quota);
  EXPECT_EQ(usage[0].guarantee_bytes, 4 * kObjectBytes);
  EXPECT_EQ(usage[0].l2_bytes, 3 * kObjectBytes);
  EXPECT_EQ(usage[0].l2_pages, 3u);
  EXPECT_EQ(usage[0].l2_miss_pages(), 4u);
  EXPECT_EQ(usage[0].l3_miss_pages(), 3u);
  EXPECT_EQ(usage[1].tenant, "team-b");
  EXPECT_EQ(usage[1].ceiling_bytes, 1000 * kObjectBytes) << "no ceiling reads as the pool";

  MetricsRegistry registry;
  registry.AddCollector([&](MetricWriter& out) { WriteTenantMetrics(usage, 2, out); });
  const std::string text = registry.Scrape();
  EXPECT_THAT(text, ::testing::HasSubstr("kvcellar_tenant_l2_bytes{tenant=\"team-a\"} " +
                                         std::to_string(3 * kObjectBytes)));
  EXPECT_THAT(
      text, ::testing::HasSubstr("kvcellar_tenant_lookup_pages_total{tenant=\"team-a\",tier=\"l2\","
                                 "result=\"miss\"} 4"));
  EXPECT_THAT(text, ::testing::HasSubstr("kvcellar_tenant_l2_pages{tenant=\"other\"} 0"));
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("team-c")));
}

}  // namespace
}  // namespace kvcellar::server::testing
