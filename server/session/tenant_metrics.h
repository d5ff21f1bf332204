// Per-tenant usage: the tenant ledger's accounts (tenant_ledger.h) joined with the namespace
// counters of each tenant's namespaces (namespace_counters.h), for AdminService.GetStatus,
// `kvcellarctl tenants` and the kvcellar_tenant_* series.
//
// Series are bounded as the per-namespace ones are (namespace_metrics.h): the first
// `max_series` tenants, in account order (quotas first, in config order, then tenants as their
// first namespace appeared), get series of their own; the rest are summed into
// tenant="other" (kOverflowLabelValue). The cap is http.max_namespace_series. Everything is read
// at scrape time; nothing is counted on the data path that was not counted already, except the
// ledger's own charge per slot.
//
// Threads: any thread (relaxed reads; one tenant's figures may be a little ahead of another's).
#ifndef KVCELLAR_SERVER_SESSION_TENANT_METRICS_H_
#define KVCELLAR_SERVER_SESSION_TENANT_METRICS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/tenant_ledger.h"

namespace kvcellar::server {

struct TenantUsage {
  std::string tenant;
  bool has_quota = false;
  uint64_t guarantee_bytes = 0;
  uint64_t ceiling_bytes = 0;  // The pool's capacity when it has no ceiling.
  uint64_t l2_bytes = 0;       // Slot bytes charged to it (TenantAccount::used_bytes).
  uint64_t l2_pages = 0;       // Pages with a committed L2 shard, over its namespaces.
  uint32_t namespaces = 0;
  uint64_t match_requests = 0;
  uint64_t lookup_pages = 0;  // Pages Match looked up (after num_computed_pages).
  uint64_t l2_hit_pages = 0;
  uint64_t l3_hit_pages = 0;  // Beyond the L2 hit.
  uint64_t ceiling_refusals = 0;
  std::array<uint64_t, kTenantEvictCauses> evicted_pages{};  // By TenantEvictCause.

  uint64_t l2_miss_pages() const { return lookup_pages - std::min(lookup_pages, l2_hit_pages); }
  uint64_t l3_miss_pages() const {
    return l2_miss_pages() - std::min(l2_miss_pages(), l3_hit_pages);
  }
};

// One entry per account, in account order. `pool_bytes`: what "no ceiling" reads as.
std::vector<TenantUsage> CollectTenantUsage(const TenantLedger& ledger,
                                            absl::Span<const std::shared_ptr<Namespace>> spaces,
                                            uint64_t pool_bytes);

// The kvcellar_tenant_* series (docs/metrics.md), bounded as above.
void WriteTenantMetrics(absl::Span<const TenantUsage> usage, size_t max_series, MetricWriter& out);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_TENANT_METRICS_H_
