#include "server/session/tenant_metrics.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"

namespace kvcellar::server {

std::vector<TenantUsage> CollectTenantUsage(const TenantLedger& ledger,
                                            absl::Span<const std::shared_ptr<Namespace>> spaces,
                                            uint64_t pool_bytes) {
  std::vector<TenantUsage> out;
  absl::flat_hash_map<const TenantAccount*, size_t> row;
  for (const TenantAccount* a : ledger.Snapshot()) {
    row[a] = out.size();
    TenantUsage& u = out.emplace_back();
    u.tenant = a->tenant();
    u.has_quota = a->has_quota();
    u.guarantee_bytes = a->guarantee_bytes();
    u.ceiling_bytes = std::min(a->ceiling_bytes(), pool_bytes);
    u.l2_bytes = a->used_bytes();
    u.ceiling_refusals = a->ceiling_refusals();
    for (int c = 0; c < kTenantEvictCauses; ++c) {
      u.evicted_pages[c] = a->evicted_pages(static_cast<TenantEvictCause>(c));
    }
  }
  for (const std::shared_ptr<Namespace>& ns : spaces) {
    auto it = row.find(ns->tenant_account());
    if (it == row.end()) continue;
    TenantUsage& u = out[it->second];
    const NamespaceCounters& c = ns->counters();
    ++u.namespaces;
    u.match_requests += NamespaceCounters::Get(c.match_calls);
    u.lookup_pages += NamespaceCounters::Get(c.lookup_pages);
    u.l2_hit_pages += NamespaceCounters::Get(c.l2_hit_pages);
    u.l3_hit_pages += NamespaceCounters::Get(c.l3_hit_pages);
    if (ns->index() != nullptr) u.l2_pages += ns->index()->Stats().l2_pages;
  }
  return out;
}

void WriteTenantMetrics(absl::Span<const TenantUsage> usage, size_t max_series, MetricWriter& out) {
  // Rows past the cap are summed into one "other" row (quotas too: a sum of guarantees).
  std::vector<TenantUsage> rows(usage.begin(), usage.begin() + std::min(max_series, usage.size()));
  if (usage.size() > rows.size()) {
    TenantUsage& other = rows.emplace_back();
    other.tenant = std::string(kOverflowLabelValue);
    for (size_t i = max_series; i < usage.size(); ++i) {
      const TenantUsage& u = usage[i];
      other.guarantee_bytes += u.guarantee_bytes;
      other.ceiling_bytes = std::max(other.ceiling_bytes, u.ceiling_bytes);
      other.l2_bytes += u.l2_bytes;
      other.l2_pages += u.l2_pages;
      other.lookup_pages += u.lookup_pages;
      other.l2_hit_pages += u.l2_hit_pages;
      other.l3_hit_pages += u.l3_hit_pages;
      other.ceiling_refusals += u.ceiling_refusals;
      for (int c = 0; c < kTenantEvictCauses; ++c) other.evicted_pages[c] += u.evicted_pages[c];
    }
  }
  for (const TenantUsage& u : rows) {
    const MetricWriter::Label t[] = {{"tenant", u.tenant}};
    out.AddGauge("kvcellar_tenant_l2_bytes",
                 "Pool slot bytes charged to the tenant (its pages, in flight ones included).",
                 static_cast<double>(u.l2_bytes), t);
    out.AddGauge("kvcellar_tenant_l2_pages", "Pages of the tenant with a committed L2 shard.",
                 static_cast<double>(u.l2_pages), t);
    out.AddGauge("kvcellar_tenant_l2_guarantee_bytes",
                 "The tenant's guaranteed share of the L2 pool (tenants.quotas; 0: none).",
                 static_cast<double>(u.guarantee_bytes), t);
    out.AddGauge("kvcellar_tenant_l2_ceiling_bytes",
                 "The most L2 pool bytes the tenant may hold (tenants.quotas; the pool: none).",
                 static_cast<double>(u.ceiling_bytes), t);
    out.AddCounter("kvcellar_tenant_l2_ceiling_refusals_total",
                   "Slots refused because the tenant was at its ceiling and none of its own pages "
                   "could go (each a NO_SPACE page: a miss, never an engine failure).",
                   static_cast<double>(u.ceiling_refusals), t);
    constexpr char kLookupHelp[] =
        "Pages Match looked up for the tenant, by tier and result (l3: of the pages L2 missed).";
    const std::pair<const char*, const char*> kinds[] = {
        {"l2", "hit"}, {"l2", "miss"}, {"l3", "hit"}, {"l3", "miss"}};
    const uint64_t values[] = {u.l2_hit_pages, u.l2_miss_pages(), u.l3_hit_pages,
                               u.l3_miss_pages()};
    for (size_t i = 0; i < 4; ++i) {
      const MetricWriter::Label l[] = {t[0], {"tier", kinds[i].first}, {"result", kinds[i].second}};
      out.AddCounter("kvcellar_tenant_lookup_pages_total", kLookupHelp,
                     static_cast<double>(values[i]), l);
    }
    for (int c = 0; c < kTenantEvictCauses; ++c) {
      const MetricWriter::Label l[] = {
          t[0], {"cause", TenantEvictCauseName(static_cast<TenantEvictCause>(c))}};
      out.AddCounter("kvcellar_tenant_l2_evicted_pages_total",
                     "L2 pages of the tenant evicted, by cause: own (its own allocation), "
                     "other_tenant (another tenant's, above this one's guarantee), watermark, "
                     "region_release, admin.",
                     static_cast<double>(u.evicted_pages[c]), l);
    }
  }
}

}  // namespace kvcellar::server
