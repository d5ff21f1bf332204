// Tests server/admin/admin_scope.h: which namespaces a parsed Scope selects, and the checks on
// digests, keys, tiers and backend names, each naming the offending request field.
#include "server/admin/admin_scope.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Bytes(const core::PageKey& key) { return std::string(key.AsBytes()); }

google::protobuf::RepeatedField<int> Tiers(std::initializer_list<int> tiers) {
  google::protobuf::RepeatedField<int> out;
  for (int t : tiers) out.Add(t);
  return out;
}

google::protobuf::RepeatedPtrField<std::string> Names(std::initializer_list<const char*> names) {
  google::protobuf::RepeatedPtrField<std::string> out;
  for (const char* n : names) *out.Add() = n;
  return out;
}

TEST(AdminScopeTest, SelectsByDigestAndExactTenant) {
  L2World world;
  std::shared_ptr<Namespace> a = world.namespaces().GetOrCreate(NsSpec(1, false, "m", "team-a"));
  std::shared_ptr<Namespace> b = world.namespaces().GetOrCreate(NsSpec(1, false, "m", "team-b"));
  std::shared_ptr<Namespace> none = world.namespaces().GetOrCreate(NsSpec(1, false, "m", ""));

  AdminScope all;
  EXPECT_TRUE(all.Selects(*a));
  EXPECT_TRUE(all.Selects(*none));

  AdminScope by_digest;
  by_digest.ns_digest = b->digest();
  EXPECT_FALSE(by_digest.Selects(*a));
  EXPECT_TRUE(by_digest.Selects(*b));

  AdminScope empty_tenant;
  empty_tenant.tenant = "";
  EXPECT_TRUE(empty_tenant.Selects(*none)) << "\"\" is a tenant";
  EXPECT_FALSE(empty_tenant.Selects(*a));

  AdminScope both;  // Every field set must match.
  both.ns_digest = a->digest();
  both.tenant = "team-b";
  EXPECT_FALSE(both.Selects(*a));
  EXPECT_FALSE(both.Selects(*b));
}

TEST(AdminScopeTest, OptionalKeyIsEmptyOrExactly32Bytes) {
  const core::PageKey key = PromptKeys(NsSpec(), 1, 1)[0];
  absl::StatusOr<std::optional<core::PageKey>> unset = ParseOptionalKey("", "ns_digest");
  ASSERT_TRUE(unset.ok());
  EXPECT_FALSE(unset->has_value());
  absl::StatusOr<std::optional<core::PageKey>> set = ParseOptionalKey(Bytes(key), "ns_digest");
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(**set, key);

  absl::StatusOr<std::optional<core::PageKey>> short_key = ParseOptionalKey("abc", "x.ns_digest");
  EXPECT_TRUE(IsCacheError(short_key.status(), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "x.ns_digest"));
  EXPECT_THAT(short_key.status().message(), HasSubstr("3 bytes, want 32"));
  EXPECT_FALSE(ParseOptionalKey(std::string(33, 'k'), "f").ok());
}

TEST(AdminScopeTest, ScopeFieldsAreNamedUnderTheRequestsField) {
  const core::PageKey digest = NsSpec().Digest();
  const core::PageKey root = PromptKeys(NsSpec(), 1, 2)[1];
  v1::Scope scope;
  scope.set_ns_digest(Bytes(digest));
  scope.set_subtree_root_key(Bytes(root));
  scope.mutable_tenant()->set_tenant("");
  absl::StatusOr<AdminScope> parsed = ParseScope(scope, "scope");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->ns_digest, digest);
  EXPECT_EQ(parsed->subtree_root, root);
  ASSERT_TRUE(parsed->tenant.has_value()) << "a present TenantFilter selects its tenant, even \"\"";
  EXPECT_EQ(*parsed->tenant, "");

  absl::StatusOr<AdminScope> any = ParseScope(v1::Scope(), "scope");
  ASSERT_TRUE(any.ok());
  EXPECT_FALSE(any->ns_digest.has_value());
  EXPECT_FALSE(any->tenant.has_value());
  EXPECT_FALSE(any->subtree_root.has_value());

  scope.set_subtree_root_key("short");
  EXPECT_TRUE(IsCacheError(ParseScope(scope, "scope").status(), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "scope.subtree_root_key"));
  scope.set_ns_digest("short");
  EXPECT_TRUE(IsCacheError(ParseScope(scope, "req.scope").status(),
                           absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "req.scope.ns_digest"));
}

TEST(AdminScopeTest, TiersAreL2AndL3WithKnownBackends) {
  absl::StatusOr<AdminTiers> both =
      ParseTiers(Tiers({v1::TIER_L3, v1::TIER_L2}), Names({"redis"}), {"nvme", "redis"});
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(both->l2);
  EXPECT_TRUE(both->l3);
  EXPECT_THAT(both->l3_backends, ElementsAre("redis"));

  absl::StatusOr<AdminTiers> l2 = ParseTiers(Tiers({v1::TIER_L2}), Names({}), {});
  ASSERT_TRUE(l2.ok());
  EXPECT_TRUE(l2->l2);
  EXPECT_FALSE(l2->l3);
  EXPECT_TRUE(l2->l3_backends.empty());
}

TEST(AdminScopeTest, BadTiersNameTheirIndex) {
  EXPECT_TRUE(IsCacheError(ParseTiers(Tiers({}), Names({}), {}).status(),
                           absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "tiers"));
  absl::Status l1 = ParseTiers(Tiers({v1::TIER_L2, v1::TIER_L1}), Names({}), {}).status();
  EXPECT_TRUE(IsCacheError(l1, absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "tiers[1]"));
  EXPECT_THAT(l1.message(), HasSubstr("TIER_L1"));
  EXPECT_TRUE(IsCacheError(ParseTiers(Tiers({v1::TIER_UNSPECIFIED}), Names({}), {}).status(),
                           absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "tiers[0]"));
  absl::Status unknown = ParseTiers(Tiers({v1::TIER_L2, v1::TIER_L3, 42}), Names({}), {}).status();
  EXPECT_TRUE(IsCacheError(unknown, absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "tiers[2]"));
  EXPECT_THAT(unknown.message(), HasSubstr("42 is not a tier"));
}

TEST(AdminScopeTest, BackendsNeedTierL3AndAConfiguredName) {
  EXPECT_TRUE(IsCacheError(ParseTiers(Tiers({v1::TIER_L2}), Names({"nvme"}), {"nvme"}).status(),
                           absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "l3_backends[0]"));
  absl::Status unknown =
      ParseTiers(Tiers({v1::TIER_L3}), Names({"nvme", "disk"}), {"nvme"}).status();
  EXPECT_TRUE(IsCacheError(unknown, absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "l3_backends[1]"));
  EXPECT_THAT(unknown.message(), HasSubstr("\"disk\""));
  absl::Status none = ParseTiers(Tiers({v1::TIER_L3}), Names({"nvme"}), {}).status();
  EXPECT_THAT(none.message(), HasSubstr("no L3 is configured"));
}

}  // namespace
}  // namespace kvcellar::server::testing
