// AdminScope: the parsed, validated selection of an AdminService request (which namespaces,
// which subtree, which tiers and backends), and the checks that name the offending field.
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_SERVER_ADMIN_ADMIN_SCOPE_H_
#define KVCELLAR_SERVER_ADMIN_ADMIN_SCOPE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/page_key.h"
#include "google/protobuf/repeated_field.h"
#include "kvcellar/v1/admin_service.pb.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

struct AdminScope {
  std::optional<core::PageKey> ns_digest;
  std::optional<std::string> tenant;  // Present: exactly this tenant ("" is a tenant).
  std::optional<core::PageKey> subtree_root;

  bool Selects(const Namespace& ns) const;
};

// Tiers an Evict or Clear applies to.
struct AdminTiers {
  bool l2 = false;
  bool l3 = false;
  std::vector<std::string> l3_backends;  // Empty: every backend.
};

// A digest or key field: empty is "not set"; otherwise exactly 32 bytes (INVALID_ARGUMENT naming
// `field` and the length).
absl::StatusOr<std::optional<core::PageKey>> ParseOptionalKey(const std::string& raw,
                                                              absl::string_view field);

// `scope` of a request, its fields named under `field` ("scope.ns_digest").
absl::StatusOr<AdminScope> ParseScope(const v1::Scope& scope, absl::string_view field);

// `tiers` and `l3_backends`: at least one tier, each TIER_L2 or TIER_L3 (TIER_L1, unspecified
// and unknown values are INVALID_ARGUMENT naming tiers[i]); backends only with TIER_L3, each one
// of `known` (l3_backends[i]).
absl::StatusOr<AdminTiers> ParseTiers(const google::protobuf::RepeatedField<int>& tiers,
                                      const google::protobuf::RepeatedPtrField<std::string>& backends,
                                      const std::vector<std::string>& known);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_ADMIN_ADMIN_SCOPE_H_
