#include "server/session/namespace_metrics.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace kvcellar::server {
namespace {

struct Sums {
  uint64_t match_requests = 0;
  uint64_t lookup_tokens = 0;
  uint64_t l2_hit_tokens = 0;
  uint64_t l3_hit_tokens = 0;
  uint64_t evicted_objects = 0;
  uint64_t l2_bytes = 0;
  uint64_t token_bytes = 0;
};

}  // namespace

void CollectNamespaceMetrics(absl::Span<const std::shared_ptr<Namespace>> in_creation_order,
                             size_t max_series, MetricWriter& out) {
  using Pair = std::pair<std::string, std::string>;  // (tenant, model)
  const Pair overflow{kOverflowLabelValue, kOverflowLabelValue};
  std::map<Pair, Sums> sums;
  size_t own = 0;  // Pairs with series of their own.
  for (const std::shared_ptr<Namespace>& ns : in_creation_order) {
    Pair pair{ns->spec().tenant, ns->spec().model_id};
    auto it = sums.find(pair);
    if (it == sums.end()) {
      if (own < max_series) {
        ++own;
        it = sums.emplace(std::move(pair), Sums{}).first;
      } else {
        it = sums.try_emplace(overflow).first;
      }
    }
    const NamespaceCounters& c = ns->counters();
    const uint64_t page_size = ns->spec().page_size;
    Sums& s = it->second;
    s.match_requests += NamespaceCounters::Get(c.match_calls);
    s.lookup_tokens += NamespaceCounters::Get(c.lookup_pages) * page_size;
    s.l2_hit_tokens += NamespaceCounters::Get(c.l2_hit_pages) * page_size;
    s.l3_hit_tokens += NamespaceCounters::Get(c.l3_hit_pages) * page_size;
    s.evicted_objects += NamespaceCounters::Get(c.evicted_objects);
    if (ns->index() != nullptr) {
      const core::RadixIndexStats stats = ns->index()->Stats();
      s.l2_bytes += stats.l2_bytes;
      s.token_bytes += stats.label_bytes;
    }
  }
  for (const auto& [pair, s] : sums) {
    const MetricWriter::Label labels[] = {{"tenant", pair.first}, {"model", pair.second}};
    const MetricWriter::Label l2[] = {labels[0], labels[1], {"tier", "l2"}};
    const MetricWriter::Label l3[] = {labels[0], labels[1], {"tier", "l3"}};
    out.AddCounter("kvcellar_namespace_match_requests_total",
                   "Match RPCs by namespace tenant and model (bounded: see docs/metrics.md).",
                   static_cast<double>(s.match_requests), labels);
    out.AddCounter("kvcellar_namespace_lookup_tokens_total",
                   "Tokens Match looked up (after num_computed_pages), by tenant and model.",
                   static_cast<double>(s.lookup_tokens), labels);
    constexpr char kHitHelp[] =
        "Tokens Match found, by tenant, model and tier (l2, or l3: any L3 tier).";
    out.AddCounter("kvcellar_namespace_hit_tokens_total", kHitHelp,
                   static_cast<double>(s.l2_hit_tokens), l2);
    out.AddCounter("kvcellar_namespace_hit_tokens_total", kHitHelp,
                   static_cast<double>(s.l3_hit_tokens), l3);
    out.AddCounter("kvcellar_namespace_evicted_objects_total",
                   "L2 objects evicted (any reason), by tenant and model.",
                   static_cast<double>(s.evicted_objects), labels);
    out.AddGauge("kvcellar_namespace_l2_bytes", "Pool slot bytes held in L2, by tenant and model.",
                 static_cast<double>(s.l2_bytes), labels);
    out.AddGauge("kvcellar_namespace_event_token_bytes",
                 "Memory the index keeps for the KV events' page tokens and engine hashes "
                 "(events.max_token_bytes per namespace), by tenant and model.",
                 static_cast<double>(s.token_bytes), labels);
  }
}

}  // namespace kvcellar::server
