#include "server/config/tenant_quota.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config/config.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(TenantQuotaTest, EmptyIsNoQuotas) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> q = ParseTenantQuotas(" ; \n ");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->empty());
}

TEST(TenantQuotaTest, ParsesFractionsPercentagesAndSizes) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> q = ParseTenantQuotas(
      "team-a=guarantee:0.5,ceiling:0.8; team-b=guarantee:4GiB;=ceiling:25%;"
      "c=ceiling:1.0, guarantee:65536");
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->size(), 4u);
  EXPECT_EQ((*q)[0], (TenantQuotaSpec{"team-a", {true, 0.5, 0}, {true, 0.8, 0}}));
  EXPECT_EQ((*q)[1], (TenantQuotaSpec{"team-b", {false, 0, 4 * kGiB}, {true, 1.0, 0}}));
  EXPECT_EQ((*q)[2], (TenantQuotaSpec{"", {false, 0, 0}, {true, 0.25, 0}}));  // Empty tenant.
  EXPECT_EQ((*q)[3], (TenantQuotaSpec{"c", {false, 0, 65536}, {true, 1.0, 0}}));
}

TEST(TenantQuotaTest, ErrorsNameTheEntryAndWhy) {
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"team-a", "quota 1 'team-a': expected TENANT=guarantee:AMOUNT,ceiling:AMOUNT"},
      {"a=guarantee:0.1;team-b=guarantee:lots",
       "quota 2 'team-b=guarantee:lots': guarantee 'lots' is not a fraction (0.5, 50%) or a "
       "size (4GiB)"},
      {"a=guarantee:1.5", "guarantee '1.5' is outside [0, 1] of the pool"},
      {"a=ceiling:120%", "ceiling '120%' is outside [0, 1] of the pool"},
      {"a=share:0.5", "'share' is not guarantee or ceiling"},
      {"a=guarantee", "'guarantee' is not guarantee:AMOUNT or ceiling:AMOUNT"},
      {"a=guarantee:0.1,guarantee:0.2", "guarantee is given twice"},
      {"a=guarantee:", "guarantee is empty"},
      {"a=", "'' is not guarantee:AMOUNT"},
      {"a=guarantee:0.1;a=ceiling:0.5", "quota 2 'a=ceiling:0.5': tenant 'a' has a quota already"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<TenantQuotaSpec>> q = ParseTenantQuotas(c.text);
    ASSERT_FALSE(q.ok()) << c.text;
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr(c.message)) << c.text;
  }
}

TEST(TenantQuotaTest, ResolvesAgainstThePool) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> q =
      ParseTenantQuotas("a=guarantee:0.5,ceiling:0.8;b=guarantee:1GiB;c=ceiling:25%");
  ASSERT_TRUE(q.ok()) << q.status();
  absl::StatusOr<std::vector<TenantQuotaBytes>> b = ResolveTenantQuotas(*q, 4 * kGiB);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->size(), 3u);
  EXPECT_EQ((*b)[0].guarantee_bytes, 2 * kGiB);
  EXPECT_EQ((*b)[0].ceiling_bytes, static_cast<uint64_t>(0.8 * 4 * kGiB));
  EXPECT_EQ((*b)[1].guarantee_bytes, kGiB);
  EXPECT_EQ((*b)[1].ceiling_bytes, 4 * kGiB);
  EXPECT_EQ((*b)[2].guarantee_bytes, 0u);
  EXPECT_EQ((*b)[2].ceiling_bytes, kGiB);
}

TEST(TenantQuotaTest, ResolveRefusesWhatThePoolCannotHold) {
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"a=guarantee:0.6;b=guarantee:0.5",
       "'tenants.quotas': the guarantees sum to 4724464025 bytes, above 'pool.capacity' "
       "(4294967296 bytes)"},
      {"a=guarantee:0.5,ceiling:0.4",
       "'tenants.quotas' tenant 'a': ceiling (0.4 of the pool = 1717986918 bytes) is below its "
       "guarantee (0.5 of the pool = 2147483648 bytes)"},
      {"a=guarantee:8GiB", "tenant 'a': guarantee (8589934592 bytes) exceeds 'pool.capacity'"},
      {"a=ceiling:5GiB", "tenant 'a': ceiling (5368709120 bytes) exceeds 'pool.capacity'"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<TenantQuotaSpec>> q = ParseTenantQuotas(c.text);
    ASSERT_TRUE(q.ok()) << q.status();
    absl::StatusOr<std::vector<TenantQuotaBytes>> b = ResolveTenantQuotas(*q, 4 * kGiB);
    ASSERT_FALSE(b.ok()) << c.text;
    EXPECT_THAT(b.status().message(), HasSubstr(c.message)) << c.text;
  }
}

TEST(TenantQuotaTest, ConfigKeyTakesSetAndReportsErrorsByKey) {
  absl::StatusOr<Config> ok = LoadConfig(
      std::nullopt, {"pool.capacity=8GiB",
                     "tenants.quotas=team-a=guarantee:0.5,ceiling:0.8;team-b=guarantee:4GiB"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tenants.quotas, "team-a=guarantee:0.5,ceiling:0.8;team-b=guarantee:4GiB");
  EXPECT_THAT(ConfigToYaml(*ok, false), HasSubstr("quotas: \"team-a=guarantee:0.5"));

  absl::StatusOr<Config> bad_syntax =
      LoadConfig(std::nullopt, {"tenants.quotas=team-a=guarantee:half"});
  ASSERT_FALSE(bad_syntax.ok());
  EXPECT_THAT(bad_syntax.status().message(), HasSubstr("tenants.quotas"));
  EXPECT_THAT(bad_syntax.status().message(), HasSubstr("guarantee 'half' is not a fraction"));

  absl::StatusOr<Config> too_much = LoadConfig(
      std::nullopt, {"pool.capacity=8GiB", "tenants.quotas=a=guarantee:0.7;b=guarantee:3GiB"});
  ASSERT_FALSE(too_much.ok());
  EXPECT_THAT(too_much.status().message(), HasSubstr("'tenants.quotas': the guarantees sum to"));
}

}  // namespace
}  // namespace kvcellar::server
