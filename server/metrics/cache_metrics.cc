#include "server/metrics/cache_metrics.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// Where a series goes when its family could not be registered (a name clash is a programming
// error, logged once at startup): counting into it keeps hot paths free of null checks.
Counter& Discard() {
  static Counter* discard = new Counter();
  return *discard;
}

CounterFamily* Family(MetricsRegistry* registry, absl::string_view name, absl::string_view help,
                      std::initializer_list<absl::string_view> labels) {
  absl::StatusOr<CounterFamily*> family =
      registry->RegisterCounter(name, help, std::vector<absl::string_view>(labels));
  if (!family.ok()) {
    KVLOG(Error, "metric family not registered",
          {{"name", name}, {"error", family.status().ToString()}});
    return nullptr;
  }
  return *family;
}

Counter* Series(CounterFamily* family, std::initializer_list<absl::string_view> values) {
  if (family == nullptr) return &Discard();
  return &family->WithLabels(std::vector<absl::string_view>(values));
}

Histogram& DiscardHistogram() {
  static Histogram* discard = new Histogram(DefaultLatencyBuckets());
  return *discard;
}

// Transfer duration buckets: 25 µs (one page over a local copy) to 10 s (a large prefetch from a
// remote Redis), the latency buckets' range, so rate(bytes)/rate(seconds) is the bandwidth.
HistogramFamily* TransferFamily(MetricsRegistry* registry) {
  const absl::string_view labels[] = {"direction"};
  absl::StatusOr<HistogramFamily*> family = registry->RegisterHistogram(
      "kvcellar_transfer_duration_seconds",
      "Seconds each transfer counted in kvcellar_moved_bytes_total took, by direction: a device "
      "copy (h2d, d2h) from submission to completion, one tier's L3 put batch (l2_to_l3), one "
      "prefetch's L3 reads (l3_to_l2).",
      labels);
  if (!family.ok()) {
    KVLOG(Error, "metric family not registered",
          {{"name", "kvcellar_transfer_duration_seconds"}, {"error", family.status().ToString()}});
    return nullptr;
  }
  return *family;
}

// "PAGE_STATUS_ALREADY_PRESENT" -> "already_present".
std::string StatusLabel(int status) {
  std::string name = v1::PageStatus_Name(static_cast<v1::PageStatus>(status));
  absl::string_view rest = name;
  absl::ConsumePrefix(&rest, "PAGE_STATUS_");
  return absl::AsciiStrToLower(rest);
}

}  // namespace

CacheMetrics::CacheMetrics(MetricsRegistry* registry) : registry_(registry) {
  match_requests_ = Series(Family(registry, "kvcellar_match_requests_total",
                                  "Match RPCs answered, memoized included.", {}),
                           {});
  CounterFamily* pages = Family(registry, "kvcellar_match_pages_total",
                                "Pages looked up by Match (after num_computed_pages), by tier and "
                                "result; a hit counts only when the whole TP group's shards are "
                                "present.",
                                {"tier", "result"});
  CounterFamily* tokens = Family(registry, "kvcellar_match_tokens_total",
                                 "Tokens looked up by Match (pages x page size), by tier and "
                                 "result.",
                                 {"tier", "result"});
  l2_hit_pages_ = Series(pages, {"l2", "hit"});
  l2_miss_pages_ = Series(pages, {"l2", "miss"});
  l2_hit_tokens_ = Series(tokens, {"l2", "hit"});
  l2_miss_tokens_ = Series(tokens, {"l2", "miss"});

  CounterFamily* moved = Family(
      registry, "kvcellar_moved_bytes_total",
      "Bytes moved between tiers: h2d by Load, d2h by Backup (device <-> L2), l2_to_l3 by L3 "
      "writes, l3_to_l2 by prefetches.", {"direction"});
  h2d_bytes_ = Series(moved, {"h2d"});
  d2h_bytes_ = Series(moved, {"d2h"});
  l2_to_l3_ = Series(moved, {"l2_to_l3"});
  l3_to_l2_ = Series(moved, {"l3_to_l2"});
  HistogramFamily* transfer = TransferFamily(registry);
  const absl::string_view directions[] = {"h2d", "d2h", "l2_to_l3", "l3_to_l2"};
  for (size_t d = 0; d < transfer_seconds_.size(); ++d) {
    const absl::string_view label[] = {directions[d]};
    transfer_seconds_[d] = transfer == nullptr ? &DiscardHistogram() : &transfer->WithLabels(label);
  }
  l3_hit_pages_ = Series(pages, {"l3", "hit"});
  l3_miss_pages_ = Series(pages, {"l3", "miss"});
  l3_hit_tokens_ = Series(tokens, {"l3", "hit"});
  l3_miss_tokens_ = Series(tokens, {"l3", "miss"});
  CounterFamily* prefetch = Family(registry, "kvcellar_prefetch_pages_total",
                                   "Pages of terminal prefetch ops (L3 -> L2) by the policy they "
                                   "ran under and final status.",
                                   {"policy", "status"});
  const absl::string_view policies[kPolicies] = {"unspecified", "none", "best_effort",
                                                 "wait_complete", "timeout"};
  for (int p = 0; p < kPolicies; ++p) {
    for (int s = 0; s < kStatuses; ++s) {
      const bool used = p >= v1::PREFETCH_POLICY_BEST_EFFORT && v1::PageStatus_IsValid(s) &&
                        s != v1::PAGE_STATUS_UNSPECIFIED;
      prefetch_pages_[p][s] = used ? Series(prefetch, {policies[p], StatusLabel(s)}) : &Discard();
    }
  }

  CounterFamily* ops =
      Family(registry, "kvcellar_ops_total",
             "Load, Backup and Prefetch ops that reached a terminal state, by outcome.", {"kind", "outcome"});
  CounterFamily* op_pages =
      Family(registry, "kvcellar_op_pages_total",
             "Pages of terminal Load, Backup and Prefetch ops, by final page status.", {"kind", "status"});
  const absl::string_view kinds[kKinds] = {"load", "backup", "prefetch"};
  const absl::string_view outcomes[kOutcomes] = {"done", "failed", "cancelled"};
  for (int k = 0; k < kKinds; ++k) {
    for (int o = 0; o < kOutcomes; ++o) ops_[k][o] = Series(ops, {kinds[k], outcomes[o]});
    for (int s = 0; s < kStatuses; ++s) {
      if (!v1::PageStatus_IsValid(s) || s == v1::PAGE_STATUS_UNSPECIFIED) {
        pages_[k][s] = &Discard();
        continue;
      }
      pages_[k][s] = Series(op_pages, {kinds[k], StatusLabel(s)});
    }
  }

  session_lease_expiries_ = Series(
      Family(registry, "kvcellar_session_lease_expiries_total",
             "Sessions ended because their lease lapsed (no Heartbeat): engine crash or hang.", {}),
      {});
  pin_lease_expiries_ =
      Series(Family(registry, "kvcellar_pin_lease_expiries_total",
                    "Pins ended because their lease lapsed before Load or Release.", {}),
             {});
  CounterFamily* evicted_pages =
      Family(registry, "kvcellar_evicted_pages_total",
             "Pages evicted from L2, by reason: pool_full (a Backup found no free slot), watermark "
             "(the pool passed pool.high_watermark), admin (AdminService.Evict), region_release (a "
             "whole host-pool region emptied for another object size).",
             {"reason"});
  CounterFamily* evicted_bytes = Family(registry, "kvcellar_evicted_bytes_total",
                                        "L2 slot bytes freed by eviction, by reason.", {"reason"});
  evicted_pages_[0] = Series(evicted_pages, {"pool_full"});
  evicted_pages_[1] = Series(evicted_pages, {"watermark"});
  evicted_bytes_[0] = Series(evicted_bytes, {"pool_full"});
  evicted_bytes_[1] = Series(evicted_bytes, {"watermark"});
  evicted_pages_[2] = Series(evicted_pages, {"admin"});
  evicted_bytes_[2] = Series(evicted_bytes, {"admin"});
  evicted_pages_[3] = Series(evicted_pages, {"region_release"});
  evicted_bytes_[3] = Series(evicted_bytes, {"region_release"});
  cleared_objects_ = Series(Family(registry, "kvcellar_cleared_objects_total",
                                   "L2 page objects removed by AdminService.Clear.", {}),
                            {});
  pins_revoked_ = Series(Family(registry, "kvcellar_pins_revoked_total",
                                "Match pins revoked by AdminService.Clear.", {}),
                         {});
}

CacheCountersSnapshot CacheMetrics::Snapshot() const {
  const auto v = [](const Counter* c) { return static_cast<uint64_t>(c->Value()); };
  CacheCountersSnapshot out;
  out.match_requests = v(match_requests_);
  out.l2_hit_pages = v(l2_hit_pages_);
  out.l2_miss_pages = v(l2_miss_pages_);
  out.l2_hit_tokens = v(l2_hit_tokens_);
  out.l2_miss_tokens = v(l2_miss_tokens_);
  out.h2d_bytes = v(h2d_bytes_);
  out.d2h_bytes = v(d2h_bytes_);
  out.l3_hit_pages = v(l3_hit_pages_);
  out.l3_hit_tokens = v(l3_hit_tokens_);
  out.l3_miss_pages = v(l3_miss_pages_);
  out.l3_miss_tokens = v(l3_miss_tokens_);
  out.l2_to_l3_bytes = v(l2_to_l3_);
  out.l3_to_l2_bytes = v(l3_to_l2_);
  static_assert(kKinds == std::tuple_size_v<decltype(out.ops)>);
  for (int k = 0; k < kKinds; ++k) {
    for (int o = 0; o < kOutcomes; ++o) out.ops[k][o] = v(ops_[k][o]);
    for (int s = 0; s < kStatuses; ++s) {
      if (pages_[k][s] != &Discard()) out.pages[k][s] = v(pages_[k][s]);
    }
  }
  out.session_lease_expiries = v(session_lease_expiries_);
  out.pin_lease_expiries = v(pin_lease_expiries_);
  out.pins_revoked = v(pins_revoked_);
  for (int r = 0; r < kEvictReasons; ++r) {
    out.evicted_pages += v(evicted_pages_[r]);
    out.evicted_bytes += v(evicted_bytes_[r]);
  }
  out.cleared_objects = v(cleared_objects_);
  return out;
}

CacheMetrics::~CacheMetrics() { RemoveCollectors(); }

void CacheMetrics::RemoveCollectors() {
  std::vector<CollectorId> ids;
  {
    absl::MutexLock lock(&mu_);
    ids.swap(collectors_);
  }
  for (CollectorId id : ids) registry_->RemoveCollector(id);
}

void CacheMetrics::AddCollector(std::function<void(MetricWriter&)> collect) {
  CollectorId id = registry_->AddCollector(std::move(collect));
  absl::MutexLock lock(&mu_);
  collectors_.push_back(id);
}

void CacheMetrics::CountMatch(uint64_t l2_hit_pages, uint64_t l2_miss_pages, uint32_t page_size) {
  match_requests_->Increment();
  l2_hit_pages_->Add(l2_hit_pages);
  l2_miss_pages_->Add(l2_miss_pages);
  l2_hit_tokens_->Add(l2_hit_pages * page_size);
  l2_miss_tokens_->Add(l2_miss_pages * page_size);
}

void CacheMetrics::CountMovedBytes(v1::OpKind kind, uint64_t bytes, double seconds) {
  if (bytes == 0) return;
  const bool d2h = kind == v1::OP_KIND_BACKUP;
  (d2h ? d2h_bytes_ : h2d_bytes_)->Add(bytes);
  transfer_seconds_[d2h ? 1 : 0]->Observe(seconds);
}

void CacheMetrics::CountL3Bytes(bool write, uint64_t bytes, double seconds) {
  if (bytes == 0) return;
  (write ? l2_to_l3_ : l3_to_l2_)->Add(bytes);
  transfer_seconds_[write ? 2 : 3]->Observe(seconds);
}

void CacheMetrics::CountOp(v1::OpKind kind, v1::OpState state) {
  const int outcome = state == v1::OP_STATE_DONE ? 0 : state == v1::OP_STATE_FAILED ? 1 : 2;
  ops_[KindIndex(kind)][outcome]->Increment();
}

void CacheMetrics::CountPages(v1::OpKind kind, v1::PageStatus status, uint64_t pages) {
  if (pages == 0 || status < 0 || status >= kStatuses) return;
  pages_[KindIndex(kind)][status]->Add(pages);
}

void CacheMetrics::SetL3Tiers(const std::vector<std::string>& names) {
  CounterFamily* hits = Family(registry_, "kvcellar_match_l3_tier_pages_total",
                               "L3 hit pages reported by Match, by the first tier holding each.",
                               {"tier"});
  CounterFamily* writes =
      Family(registry_, "kvcellar_l3_writes_total",
             "L2 -> L3 object writes by tier and result: ok, failed (the backend refused or "
             "failed it), dropped (storage.max_pending_write_bytes reached), not_resident (the "
             "page left L2 before it could be written).",
             {"tier", "result"});
  CounterFamily* tokens =
      Family(registry_, "kvcellar_match_l3_tier_tokens_total",
             "Tokens Match looked up in each L3 tier (missed in L2 and every earlier tier), by "
             "result: hit (this tier is the first holding the page) or miss.",
             {"tier", "result"});
  const absl::string_view results[kWriteResults] = {"ok", "failed", "dropped", "not_resident"};
  for (const std::string& name : names) {
    l3_tier_hit_pages_.push_back(Series(hits, {name}));
    l3_tier_hit_tokens_.push_back(Series(tokens, {name, "hit"}));
    l3_tier_miss_tokens_.push_back(Series(tokens, {name, "miss"}));
    std::array<Counter*, kWriteResults> w{};
    for (int r = 0; r < kWriteResults; ++r) w[r] = Series(writes, {name, results[r]});
    l3_tier_writes_.push_back(w);
  }
}

void CacheMetrics::CountL3Match(absl::Span<const uint32_t> hit_pages_by_tier, uint64_t miss_pages,
                                uint32_t page_size) {
  uint64_t hits = 0;
  const size_t tiers = std::min(hit_pages_by_tier.size(), l3_tier_hit_pages_.size());
  for (size_t t = 0; t < tiers; ++t) {
    l3_tier_hit_pages_[t]->Add(hit_pages_by_tier[t]);
    l3_tier_hit_tokens_[t]->Add(uint64_t{hit_pages_by_tier[t]} * page_size);
    hits += hit_pages_by_tier[t];
  }
  // A page missed tier t when it reached it (missed L2 and every earlier tier) and was not there:
  // it missed everywhere, or a later tier held it. Walk the tiers backwards, summing later hits.
  uint64_t later_hits = 0;
  for (size_t t = tiers; t-- > 0;) {
    l3_tier_miss_tokens_[t]->Add((miss_pages + later_hits) * page_size);
    later_hits += hit_pages_by_tier[t];
  }
  l3_hit_pages_->Add(hits);
  l3_hit_tokens_->Add(hits * page_size);
  l3_miss_pages_->Add(miss_pages);
  l3_miss_tokens_->Add(miss_pages * page_size);
}

void CacheMetrics::CountL3Writes(size_t tier, L3WriteResult result, uint64_t objects) {
  if (tier >= l3_tier_writes_.size() || objects == 0) return;
  l3_tier_writes_[tier][static_cast<int>(result)]->Add(objects);
}

void CacheMetrics::CountPrefetchPages(v1::PrefetchPolicy policy, v1::PageStatus status,
                                      uint64_t pages) {
  if (pages == 0 || policy < 0 || policy >= kPolicies || status < 0 || status >= kStatuses) return;
  prefetch_pages_[policy][status]->Add(pages);
}

void CacheMetrics::CountEviction(EvictReason reason, uint64_t pages, uint64_t bytes) {
  const int r = static_cast<int>(reason);
  evicted_pages_[r]->Add(pages);
  evicted_bytes_[r]->Add(bytes);
}

}  // namespace kvcellar::server
