// TenantQuota: a tenant's share of the L2 pool, as the operator writes it in `tenants.quotas`
// (issue #24; docs/security.md "Quotas"; server/session/tenant_ledger.h keeps the accounts and
// server/l2/l2_space.h enforces them).
//
// Like tenants.allow, the list is one string: entries separated by ';' (or a YAML list of them).
// Each entry names one tenant and up to two amounts, separated by ',':
//
//   team-a=guarantee:0.5,ceiling:0.8     half the pool guaranteed, at most 80% of it
//   team-b=guarantee:4GiB                4 GiB guaranteed, no ceiling (the whole pool)
//   =ceiling:25%                         the empty tenant ("" in NamespaceSpec.tenant)
//
// An amount is a fraction of pool.capacity when it holds a '.' ("0.5", "1.0") or ends in '%'
// ("50%"), else a size in the config's syntax ("4GiB", "512MB", "65536"). A guarantee left out is
// 0, a ceiling left out is the whole pool. A tenant not listed has guarantee 0 and no ceiling: it
// only ever uses what others do not hold by guarantee, which is also how every tenant behaves with
// no quotas at all (the default, "").
//
// Threads: pure functions.
#ifndef KVCELLAR_SERVER_CONFIG_TENANT_QUOTA_H_
#define KVCELLAR_SERVER_CONFIG_TENANT_QUOTA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::server {

// Bytes, or a fraction of the pool.
struct QuotaAmount {
  bool is_fraction = false;
  double fraction = 0;  // In [0, 1] when is_fraction.
  uint64_t bytes = 0;
  // Bytes of a pool of `pool_bytes` (a fraction rounds down).
  uint64_t Resolve(uint64_t pool_bytes) const;
  bool operator==(const QuotaAmount&) const = default;
};

struct TenantQuotaSpec {
  std::string tenant;
  QuotaAmount guarantee;              // Default 0.
  QuotaAmount ceiling{true, 1.0, 0};  // Default: the whole pool.
  bool operator==(const TenantQuotaSpec&) const = default;
};

// A quota in bytes of one pool.
struct TenantQuotaBytes {
  std::string tenant;
  uint64_t guarantee_bytes = 0;
  uint64_t ceiling_bytes = 0;
};

// Parses the whole list. InvalidArgument naming the entry (its position and text) and what is
// wrong, e.g. "quota 2 'team-b=guarantee:lots': guarantee 'lots' is not a fraction (0.5, 50%) or
// a size (4GiB)". A tenant listed twice is an error.
absl::StatusOr<std::vector<TenantQuotaSpec>> ParseTenantQuotas(absl::string_view text);

// The quotas in bytes of a pool of `pool_bytes`. InvalidArgument, naming 'tenants.quotas' and the
// tenant, when a ceiling is below its guarantee, an amount exceeds the pool, or the guarantees sum
// above the pool (each one's bytes and the pool's are in the message).
absl::StatusOr<std::vector<TenantQuotaBytes>> ResolveTenantQuotas(
    const std::vector<TenantQuotaSpec>& specs, uint64_t pool_bytes);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CONFIG_TENANT_QUOTA_H_
