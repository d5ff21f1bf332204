// TenantAccess: whether a peer identity may register engines under a tenant, from the operator's
// grants (`tenants.allow`, server/config/tenant_grant.h).
//
// No grants: every identity may use every tenant. Grants: an identity may use a tenant when one
// of the tenant's grants names its uid, its gid (Unix socket peers) or its certificate subject
// (mutual TLS); a tenant without grants is refused to everyone. Refusals are PERMISSION_DENIED
// with ERROR_REASON_TENANT_DENIED, naming the field `namespace_spec.tenant`, the identity and
// what the operator would have to grant.
//
// Threads: immutable after construction; Check from any thread.
#ifndef KVCELLAR_SERVER_SESSION_TENANT_ACCESS_H_
#define KVCELLAR_SERVER_SESSION_TENANT_ACCESS_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/config/tenant_grant.h"
#include "server/session/peer_identity.h"

namespace kvcellar::server {

class TenantAccess {
 public:
  explicit TenantAccess(const std::vector<TenantGrant>& grants);
  // From `tenants.allow`. Text that does not parse (a Config that skipped LoadConfig's checks)
  // grants nothing to anyone, and says so in the log: a typo must not open every tenant.
  static TenantAccess FromConfig(absl::string_view allow);

  // OK, or PERMISSION_DENIED (TENANT_DENIED) saying why.
  absl::Status Check(absl::string_view tenant, const PeerIdentity& peer) const;

  bool open() const { return open_; }

 private:
  static bool Grants(const TenantGrant& grant, const PeerIdentity& peer);

  bool open_ = true;
  absl::flat_hash_map<std::string, std::vector<TenantGrant>> by_tenant_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_TENANT_ACCESS_H_
