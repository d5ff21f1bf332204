#include "server/admin/admin_scope.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/quote.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {

bool AdminScope::Selects(const Namespace& ns) const {
  if (ns_digest.has_value() && ns.digest() != *ns_digest) return false;
  if (tenant.has_value() && ns.spec().tenant != *tenant) return false;
  return true;
}

absl::StatusOr<std::optional<core::PageKey>> ParseOptionalKey(const std::string& raw,
                                                              absl::string_view field) {
  if (raw.empty()) return std::optional<core::PageKey>();
  if (raw.size() != core::kPageKeyBytes) {
    return InvalidField(field, absl::StrCat(field, ": ", raw.size(), " bytes, want ",
                                            core::kPageKeyBytes, " (or empty for any)"));
  }
  absl::StatusOr<core::PageKey> key = core::PageKey::FromBytes(raw);
  if (!key.ok()) return InvalidField(field, absl::StrCat(field, ": ", key.status().message()));
  return std::optional<core::PageKey>(*key);
}

absl::StatusOr<AdminScope> ParseScope(const v1::Scope& scope, absl::string_view field) {
  AdminScope out;
  absl::StatusOr<std::optional<core::PageKey>> ns =
      ParseOptionalKey(scope.ns_digest(), absl::StrCat(field, ".ns_digest"));
  if (!ns.ok()) return ns.status();
  out.ns_digest = *ns;
  absl::StatusOr<std::optional<core::PageKey>> root =
      ParseOptionalKey(scope.subtree_root_key(), absl::StrCat(field, ".subtree_root_key"));
  if (!root.ok()) return root.status();
  out.subtree_root = *root;
  if (scope.has_tenant()) out.tenant = scope.tenant().tenant();
  return out;
}

absl::StatusOr<AdminTiers> ParseTiers(const google::protobuf::RepeatedField<int>& tiers,
                                      const google::protobuf::RepeatedPtrField<std::string>& backends,
                                      const std::vector<std::string>& known) {
  AdminTiers out;
  if (tiers.empty()) {
    return InvalidField("tiers", "tiers: name at least one of TIER_L2, TIER_L3");
  }
  for (int i = 0; i < tiers.size(); ++i) {
    const std::string name = absl::StrCat("tiers[", i, "]");
    switch (tiers[i]) {
      case v1::TIER_L2: out.l2 = true; break;
      case v1::TIER_L3: out.l3 = true; break;
      case v1::TIER_L1:
        return InvalidField(name, absl::StrCat(name, ": TIER_L1 is the engines' memory; the "
                                               "daemon never evicts or clears it"));
      default:
        return InvalidField(name, absl::StrCat(name, ": ", tiers[i],
                                               " is not a tier (want TIER_L2 or TIER_L3)"));
    }
  }
  for (int i = 0; i < backends.size(); ++i) {
    const std::string name = absl::StrCat("l3_backends[", i, "]");
    if (!out.l3) {
      return InvalidField(name, absl::StrCat(name, ": backends apply to TIER_L3, which tiers "
                                             "does not name"));
    }
    if (std::find(known.begin(), known.end(), backends[i]) == known.end()) {
      return InvalidField(name, absl::StrCat(name, ": no L3 backend is named ",
                                             core::Quote(backends[i]),
                                             known.empty() ? " (no L3 is configured)" : ""));
    }
    out.l3_backends.push_back(backends[i]);
  }
  return out;
}

}  // namespace kvcellar::server
