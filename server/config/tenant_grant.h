// TenantGrant: who may register engines under a tenant, as the operator writes it in
// `tenants.allow` (DESIGN.md, Security; docs/security.md).
//
// The config schema is flat, so the list is one string: grants separated by ';' (or a YAML list
// of them). Each grant names one tenant and one identity:
//
//   team-a=uid:1001                          Unix socket peers running as uid 1001 (name or number)
//   team-a=gid:kv-team-a                     Unix socket peers whose group is kv-team-a
//   team-b=subject:CN=engine-b,O=team-b      TCP peers with this verified client certificate
//   =uid:1000                                the empty tenant ("" in NamespaceSpec.tenant)
//
// The tenant is everything before the first '=' (so a tenant listed here cannot contain '=');
// the identity's value is everything after "KIND:" (a subject may hold ',', '=' and ':').
// An empty list grants every tenant to every peer (a node used by one team); a non-empty list
// grants each tenant only to the identities listed for it, and a tenant not listed to nobody.
//
// Threads: pure functions (user and group names are resolved with the reentrant NSS calls).
#ifndef KVCELLAR_SERVER_CONFIG_TENANT_GRANT_H_
#define KVCELLAR_SERVER_CONFIG_TENANT_GRANT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::server {

struct TenantGrant {
  enum class Kind { kUid, kGid, kSubject };
  std::string tenant;
  Kind kind = Kind::kUid;
  uint32_t id = 0;      // kUid, kGid: the numeric id (names are resolved when parsed).
  std::string subject;  // kSubject: the certificate subject, as gRPC reports it (RFC 2253).
  bool operator==(const TenantGrant&) const = default;
};

// Parses the whole list. InvalidArgument naming the grant (its position and text) and what is
// wrong, e.g. "grant 2 'team-a=uid:nobody-here': no user 'nobody-here'".
absl::StatusOr<std::vector<TenantGrant>> ParseTenantGrants(absl::string_view text);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CONFIG_TENANT_GRANT_H_
