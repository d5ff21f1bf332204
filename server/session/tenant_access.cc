#include "server/session/tenant_access.h"

#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

// Tenants come from requests: quote a bounded prefix in errors.
constexpr size_t kMaxQuotedTenant = 64;

std::string QuotedTenant(absl::string_view tenant) {
  return absl::StrCat("'", tenant.substr(0, kMaxQuotedTenant),
                      tenant.size() > kMaxQuotedTenant ? "...'" : "'");
}

}  // namespace

TenantAccess::TenantAccess(const std::vector<TenantGrant>& grants) : open_(grants.empty()) {
  for (const TenantGrant& g : grants) by_tenant_[g.tenant].push_back(g);
}

TenantAccess TenantAccess::FromConfig(absl::string_view allow) {
  absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(allow);
  if (grants.ok()) return TenantAccess(*grants);
  KVLOG(Error, "tenants.allow is invalid: every tenant is refused",
        {{"error", grants.status().message()}});
  TenantAccess closed({});
  closed.open_ = false;
  return closed;
}

bool TenantAccess::Grants(const TenantGrant& grant, const PeerIdentity& peer) {
  switch (grant.kind) {
    case TenantGrant::Kind::kUid:
      return peer.kind == PeerIdentity::Kind::kUnix && peer.uid == grant.id;
    case TenantGrant::Kind::kGid:
      return peer.kind == PeerIdentity::Kind::kUnix && peer.gid == grant.id;
    case TenantGrant::Kind::kSubject:
      return peer.kind == PeerIdentity::Kind::kCertificate && peer.subject == grant.subject;
  }
  return false;
}

absl::Status TenantAccess::Check(absl::string_view tenant, const PeerIdentity& peer) const {
  if (open_ || peer.kind == PeerIdentity::Kind::kInProcess) return absl::OkStatus();
  auto it = by_tenant_.find(tenant);
  if (it == by_tenant_.end()) {
    return CacheError(absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_TENANT_DENIED,
                      "namespace_spec.tenant",
                      absl::StrCat("namespace_spec.tenant: tenant ", QuotedTenant(tenant),
                                   " is not granted to anyone on this daemon (tenants.allow)"));
  }
  for (const TenantGrant& g : it->second) {
    if (Grants(g, peer)) return absl::OkStatus();
  }
  return CacheError(absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_TENANT_DENIED,
                    "namespace_spec.tenant",
                    absl::StrCat("namespace_spec.tenant: tenant ", QuotedTenant(tenant),
                                 " is not granted to ", peer.Describe(),
                                 " (tenants.allow grants it by uid, gid or certificate subject)"));
}

}  // namespace kvcellar::server
