#include "server/config/tenant_grant.h"

#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config/config.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

TEST(TenantGrantTest, EmptyGrantsNothing) {
  absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(" ; \n ");
  ASSERT_TRUE(grants.ok()) << grants.status();
  EXPECT_TRUE(grants->empty());
}

TEST(TenantGrantTest, ParsesEveryKindInOrder) {
  absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(
      "team-a=uid:1001; team-a=gid:3000;team-b=subject:CN=engine-b,O=team-b:x=y;=uid:7;"
      "org:team=uid:root");
  ASSERT_TRUE(grants.ok()) << grants.status();
  ASSERT_EQ(grants->size(), 5u);
  EXPECT_EQ((*grants)[0], (TenantGrant{"team-a", TenantGrant::Kind::kUid, 1001, ""}));
  EXPECT_EQ((*grants)[1], (TenantGrant{"team-a", TenantGrant::Kind::kGid, 3000, ""}));
  // A subject keeps its ',', '=' and ':'; only the first '=' ends the tenant.
  EXPECT_EQ((*grants)[2],
            (TenantGrant{"team-b", TenantGrant::Kind::kSubject, 0, "CN=engine-b,O=team-b:x=y"}));
  EXPECT_EQ((*grants)[3], (TenantGrant{"", TenantGrant::Kind::kUid, 7, ""}));  // Empty tenant.
  // Names resolve through the system's user database; a tenant may hold ':'.
  EXPECT_EQ((*grants)[4], (TenantGrant{"org:team", TenantGrant::Kind::kUid, 0, ""}));
}

TEST(TenantGrantTest, ErrorsNameTheGrantAndWhy) {
  struct Case {
    std::string text;
    std::string expect;
  };
  const Case cases[] = {
      {"team-a", "grant 1 'team-a': expected TENANT=uid:USER"},
      {"a=uid:1;team-a=pid:3", "grant 2 'team-a=pid:3': identity kind 'pid' is not uid, gid"},
      {"team-a=1001", "identity '1001' is not uid:USER"},
      {"team-a=uid:", "uid is empty"},
      {"team-a=gid:", "gid is empty"},
      {"team-a=uid:12x", "'12x' is not a valid id"},
      {"team-a=uid:99999999999", "is not a valid id"},
      {"team-a=uid:no-such-user-kvc", "no user 'no-such-user-kvc'"},
      {"team-a=gid:no-such-group-kvc", "no group 'no-such-group-kvc'"},
      {"team-a=subject:", "subject is empty"},
      {std::string("te\x01m=uid:1"), "control character"},
      {std::string(1100, 't') + "=uid:1", "longer than 1024 bytes"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(c.text);
    ASSERT_FALSE(grants.ok()) << c.text;
    EXPECT_EQ(grants.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(grants.status().message(), HasSubstr(c.expect)) << c.text;
    EXPECT_LT(grants.status().message().size(), 300u) << "bad values are quoted in part";
  }
}

TEST(TenantGrantTest, ConfigKeyChecksGrantsAndTheirTlsMode) {
  absl::StatusOr<Config> ok = LoadConfig(std::nullopt, {"tenants.allow=team-a=uid:0;team-b=gid:0"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tenants.allow, "team-a=uid:0;team-b=gid:0");
  absl::StatusOr<Config> bad =
      LoadConfig(std::nullopt, {"tenants.allow=team-a=uid:no-such-user-kvc"});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'tenants.allow'"));
  EXPECT_THAT(bad.status().message(), HasSubstr("no user 'no-such-user-kvc'"));
  // A subject is only ever verified under mtls: without it the grant could never match.
  absl::StatusOr<Config> no_mtls =
      LoadConfig(std::nullopt, {"tenants.allow=team-c=subject:CN=client"});
  ASSERT_FALSE(no_mtls.ok());
  EXPECT_THAT(no_mtls.status().message(), HasSubstr("'tls.mode' is not mtls"));
}

}  // namespace
}  // namespace kvcellar::server
