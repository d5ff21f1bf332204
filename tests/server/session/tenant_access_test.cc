#include "server/session/tenant_access.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

PeerIdentity Unix(uint32_t uid, uint32_t gid) { return PeerIdentity::Unix(uid, gid, 100); }

PeerIdentity Certificate(const std::string& subject) {
  PeerIdentity p;
  p.kind = PeerIdentity::Kind::kCertificate;
  p.subject = subject;
  return p;
}

PeerIdentity Network(const std::string& address) {
  PeerIdentity p;
  p.kind = PeerIdentity::Kind::kNetwork;
  p.address = address;
  return p;
}

void ExpectDenied(const absl::Status& s, const std::string& why) {
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(ErrorReasonOf(s), v1::ERROR_REASON_TENANT_DENIED) << s;
  EXPECT_EQ(ErrorFieldOf(s), "namespace_spec.tenant") << s;
  EXPECT_THAT(s.message(), HasSubstr(why));
}

TEST(TenantAccessTest, NoGrantsOpensEveryTenantToEveryone) {
  TenantAccess open = TenantAccess::FromConfig("");
  EXPECT_TRUE(open.open());
  EXPECT_TRUE(open.Check("team-a", Unix(1000, 1000)).ok());
  EXPECT_TRUE(open.Check("", Network("10.0.0.1")).ok());
}

TEST(TenantAccessTest, GrantsByUidGidAndSubject) {
  TenantAccess access = TenantAccess::FromConfig(
      "team-a=uid:1001;team-a=gid:3000;team-b=subject:CN=engine-b,O=team-b;=uid:1002");
  EXPECT_FALSE(access.open());
  EXPECT_TRUE(access.Check("team-a", Unix(1001, 5)).ok());
  EXPECT_TRUE(access.Check("team-a", Unix(7, 3000)).ok());
  EXPECT_TRUE(access.Check("team-b", Certificate("CN=engine-b,O=team-b")).ok());
  EXPECT_TRUE(access.Check("", Unix(1002, 5)).ok());

  ExpectDenied(access.Check("team-a", Unix(1002, 5)), "'team-a' is not granted to uid 1002");
  ExpectDenied(access.Check("team-b", Unix(1001, 3000)), "is not granted to uid 1001");
  ExpectDenied(access.Check("team-a", Certificate("CN=engine-a")), "certificate 'CN=engine-a'");
  // A uid grant is about Unix-socket peers: a certificate or an address never matches one.
  ExpectDenied(access.Check("team-b", Certificate("CN=engine-b")), "is not granted");
  ExpectDenied(access.Check("team-a", Network("10.0.0.1")), "address 10.0.0.1");
  // A tenant without grants belongs to nobody.
  ExpectDenied(access.Check("team-z", Unix(1001, 3000)), "is not granted to anyone");
  // The empty tenant is a tenant like the others.
  ExpectDenied(access.Check("", Unix(1001, 3000)), "tenant '' is not granted to uid 1001");
}

TEST(TenantAccessTest, LongTenantsAreQuotedInPart) {
  TenantAccess access = TenantAccess::FromConfig("team-a=uid:1");
  absl::Status s = access.Check(std::string(5000, 'x'), Unix(2, 2));
  ExpectDenied(s, "...'");
  EXPECT_LT(s.message().size(), 300u);
}

TEST(TenantAccessTest, TextThatDoesNotParseRefusesEveryone) {
  TenantAccess access = TenantAccess::FromConfig("team-a=pid:1");
  EXPECT_FALSE(access.open());
  ExpectDenied(access.Check("team-a", Unix(0, 0)), "not granted to anyone");
}

}  // namespace
}  // namespace kvcellar::server
