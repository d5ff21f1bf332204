#include "client/tools/bench/report.h"
#include "client/tools/json_object.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvcellar::bench {
namespace {

double Ratio(double num, double den) { return den > 0 ? num / den : 0; }
double Pct(uint64_t num, uint64_t den) {
  return 100.0 * Ratio(static_cast<double>(num), static_cast<double>(den));
}

std::string HumanCount(double v) {
  if (v >= 1e9) return absl::StrFormat("%.2fG", v / 1e9);
  if (v >= 1e6) return absl::StrFormat("%.2fM", v / 1e6);
  if (v >= 1e3) return absl::StrFormat("%.1fK", v / 1e3);
  return absl::StrFormat("%.0f", v);
}

// One JSON object built in insertion order.
using Json = ::kvcellar::tools::JsonObject;

}  // namespace

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.1f %s", bytes, units[u]);
}

std::string ProgressLine(const RunInfo& info, const Stats::Snapshot& s, double elapsed_s) {
  const RequestResult& r = s.sum;
  return absl::StrFormat(
      "[%6.1fs] %llu/%llu requests  hit %.1f%% (best case %.1f%%)  %s prompt tok/s  "
      "load %.2f GB/s  backup %.2f GB/s%s",
      elapsed_s, s.requests, info.requests, Pct(r.loaded_tokens, r.prompt_tokens),
      Pct(r.best_case_hit_tokens, r.prompt_tokens),
      HumanCount(Ratio(static_cast<double>(r.prompt_tokens), elapsed_s)),
      Ratio(static_cast<double>(r.load_bytes), elapsed_s) / 1e9,
      Ratio(static_cast<double>(r.backup_bytes), elapsed_s) / 1e9,
      r.mismatched_bytes > 0 ? absl::StrCat("  MISMATCHED BYTES ", r.mismatched_bytes) : "");
}

std::string SummaryText(const RunInfo& info, const Stats::Snapshot& s,
                        const std::array<Stats::Latency, kNumTimed>& latencies) {
  const RequestResult& r = s.sum;
  const WorkloadSpec& w = info.workload;
  std::string o;
  auto line = [&o](const std::string& l) { absl::StrAppend(&o, l, "\n"); };
  if (info.shape_name.empty()) {
    line(absl::StrFormat(
        "kvcellar-bench: %llu requests (%u clients x %u rounds, %u new + %u output tokens per "
        "round, %u in parallel%s) in %.1f s",
        s.requests, w.clients, w.rounds, w.new_tokens, w.output_tokens, info.parallel,
        w.system_prompt_tokens > 0
            ? absl::StrCat(", ", w.system_prompt_tokens, " shared system prompt tokens")
            : "",
        info.wall_s));
  } else {
    line(absl::StrFormat(
        "kvcellar-bench: %llu requests (shape %s at scale %g, %u in parallel) in %.1f s",
        s.requests, info.shape_name, w.shape_scale, info.parallel, info.wall_s));
  }
  line(absl::StrFormat("daemon:     %s at %s, L2 %s (%s in use at start), L3 %s",
                       info.daemon_version, info.socket, HumanBytes(info.l2_capacity),
                       HumanBytes(info.l2_used_at_start),
                       info.l3_tiers.empty() ? "none" : absl::StrJoin(info.l3_tiers, ", ")));
  line(absl::StrFormat("model:      %s; %s/token, %s page objects%s", info.shape.Describe(),
                       HumanBytes(info.shape.BytesPerToken()), HumanBytes(info.shape.ObjectBytes()),
                       info.auto_scaled ? " (scaled to L2)" : ""));
  line(absl::StrFormat(
      "footprint:  %llu distinct pages = %s = %.2f of L2 (target --fill %.2f)", info.distinct_pages,
      HumanBytes(static_cast<double>(info.distinct_pages) * info.shape.L2BytesPerPage()),
      info.footprint_ratio, info.fill));
  line("");
  line("hit rate (share of prompt tokens served by the cache):");
  line(absl::StrFormat("  best case (unbounded cache)   %6.2f%%",
                       Pct(r.best_case_hit_tokens, r.prompt_tokens)));
  if (!info.shape_name.empty()) {
    line(
        absl::StrFormat("  Belady's bound at %-10llu  %6.2f%%  (the most any eviction order "
                        "serves with L2 = %llu pages)",
                        info.l2_pages, 100 * info.bound_hit_rate, info.l2_pages));
  }
  line(absl::StrFormat("  measured (loaded, verified)   %6.2f%%",
                       Pct(r.loaded_tokens, r.prompt_tokens)));
  line(absl::StrFormat("    L2 (Match)                  %6.2f%%",
                       Pct(r.l2_hit_tokens, r.prompt_tokens)));
  for (size_t i = 0; i < info.l3_tiers.size(); ++i) {
    const uint64_t t = i < r.l3_hit_tokens_by_tier.size() ? r.l3_hit_tokens_by_tier[i] : 0;
    line(absl::StrFormat("    L3 %-24s %6.2f%%", absl::StrCat(info.l3_tiers[i], " (Match)"),
                         Pct(t, r.prompt_tokens)));
  }
  line("");
  const double wall = info.wall_s;
  line("throughput (over the run's wall time):");
  line(absl::StrFormat("  prompt tokens       %s tok/s (%s of them from the cache)",
                       HumanCount(Ratio(static_cast<double>(r.prompt_tokens), wall)),
                       HumanCount(Ratio(static_cast<double>(r.loaded_tokens), wall))));
  const double load = Ratio(static_cast<double>(r.load_bytes), wall) / 1e9;
  const double backup = Ratio(static_cast<double>(r.backup_bytes), wall) / 1e9;
  line(absl::StrFormat("  load   L2 -> engine %6.2f GB/s  (%s, %.3fx memcpy)", load,
                       HumanBytes(r.load_bytes), Ratio(load, info.memcpy_gb_s)));
  line(absl::StrFormat("  backup engine -> L2 %6.2f GB/s  (%s, %.3fx memcpy)", backup,
                       HumanBytes(r.backup_bytes), Ratio(backup, info.memcpy_gb_s)));
  line(absl::StrFormat("  memcpy baseline     %6.2f GB/s  (one thread of this process, same run)",
                       info.memcpy_gb_s));
  line("");
  std::vector<std::string> statuses;
  for (const auto& [k, v] : r.backup_status) statuses.push_back(absl::StrCat(k, " ", v));
  line(absl::StrFormat("backup:     %llu page objects sent: %s", r.backup_pages,
                       statuses.empty() ? "-" : absl::StrJoin(statuses, ", ")));
  line(absl::StrFormat(
      "verified:   %s loaded, %llu mismatched bytes%s", HumanBytes(r.verified_bytes),
      r.mismatched_bytes,
      r.first_mismatch.empty() ? "" : absl::StrCat(" (first: ", r.first_mismatch, ")")));
  line(absl::StrFormat(
      "misses:     %llu degraded calls, %llu loads and %llu backups not done, %llu blocks "
      "quarantined, %llu RPCs failed",
      r.degraded_calls, r.loads_not_done, r.backups_not_done, info.quarantined_blocks,
      info.client.rpcs_failed));
  line("");
  line("latency (client side, per call of one rank)   count       p50       p99       max");
  for (int i = 0; i < kNumTimed; ++i) {
    const Stats::Latency& l = latencies[i];
    if (l.count == 0) continue;
    line(absl::StrFormat("  %-40s %9llu %7.0fus %7.0fus %7.0fus", TimedName(static_cast<Timed>(i)),
                         l.count, l.p50_us, l.p99_us, l.max_us));
  }
  return o;
}

std::string SummaryJson(const RunInfo& info, const Stats::Snapshot& s,
                        const std::array<Stats::Latency, kNumTimed>& latencies) {
  const RequestResult& r = s.sum;
  const WorkloadSpec& w = info.workload;
  Json workload;
  workload.Num("clients", w.clients)
      .Num("rounds", w.rounds)
      .Num("new_tokens", w.new_tokens)
      .Num("output_tokens", w.output_tokens)
      .Num("system_prompt_tokens", w.system_prompt_tokens)
      .Num("parallel", info.parallel)
      .Num("seed", w.seed)
      .Num("requests", info.requests)
      .Num("prompt_tokens", info.total_prompt_tokens)
      .Str("shape", w.shape)
      .Real("shape_scale", w.shape_scale);
  Json model;
  model.Num("layers", info.shape.layers)
      .Num("kv_heads", info.shape.mla() ? 0 : info.shape.kv_heads)
      .Num("head_dim", info.shape.mla() ? 0 : info.shape.head_dim)
      .Num("mla_latent", info.shape.mla_latent)
      .Str("dtype", info.shape.dtype)
      .Num("page_size", info.shape.page_size)
      .Num("tp", info.shape.tp)
      .Num("bytes_per_token", info.shape.BytesPerToken())
      .Num("page_object_bytes", info.shape.ObjectBytes())
      .Raw("auto_scaled", info.auto_scaled ? "true" : "false");
  Json daemon;
  daemon.Str("socket", info.socket)
      .Str("version", info.daemon_version)
      .Num("l2_capacity_bytes", info.l2_capacity)
      .Num("l2_used_at_start_bytes", info.l2_used_at_start)
      .Raw("l3_tiers", absl::StrCat("[",
                                    absl::StrJoin(info.l3_tiers, ", ",
                                                  [](std::string* out, const std::string& t) {
                                                    out->append(Json::Quote(t));
                                                  }),
                                    "]"));
  Json footprint;
  footprint.Num("distinct_pages", info.distinct_pages)
      .Num("l2_bytes", info.distinct_pages * info.shape.L2BytesPerPage())
      .Real("l2_fraction", info.footprint_ratio)
      .Real("fill_target", info.fill);
  const double pt = static_cast<double>(r.prompt_tokens);
  Json by_tier;
  by_tier.Real("L2", Ratio(static_cast<double>(r.l2_hit_tokens), pt));
  for (size_t i = 0; i < info.l3_tiers.size(); ++i) {
    const uint64_t t = i < r.l3_hit_tokens_by_tier.size() ? r.l3_hit_tokens_by_tier[i] : 0;
    by_tier.Real(absl::StrCat("L3:", info.l3_tiers[i]), Ratio(static_cast<double>(t), pt));
  }
  Json hit;
  hit.Real("best_case", Ratio(static_cast<double>(r.best_case_hit_tokens), pt))
      .Real("measured", Ratio(static_cast<double>(r.loaded_tokens), pt))
      .Obj("matched_by_tier", by_tier)
      .Num("l2_pages", info.l2_pages)
      .Real("bound", info.bound_hit_rate)
      .Num("prompt_tokens", r.prompt_tokens)
      .Num("best_case_hit_tokens", r.best_case_hit_tokens)
      .Num("loaded_tokens", r.loaded_tokens)
      .Num("l2_hit_tokens", r.l2_hit_tokens);
  const double wall = info.wall_s;
  Json throughput;
  throughput.Real("prompt_tokens_per_s", Ratio(pt, wall))
      .Real("load_gb_per_s", Ratio(static_cast<double>(r.load_bytes), wall) / 1e9)
      .Real("backup_gb_per_s", Ratio(static_cast<double>(r.backup_bytes), wall) / 1e9)
      .Real("memcpy_gb_per_s", info.memcpy_gb_s)
      .Num("load_bytes", r.load_bytes)
      .Num("backup_bytes", r.backup_bytes);
  Json statuses;
  for (const auto& [k, v] : r.backup_status) statuses.Num(k, v);
  Json verify;
  verify.Num("verified_bytes", r.verified_bytes)
      .Num("mismatched_bytes", r.mismatched_bytes)
      .Str("first_mismatch", r.first_mismatch);
  Json misses;
  misses.Num("degraded_calls", r.degraded_calls)
      .Num("loads_not_done", r.loads_not_done)
      .Num("backups_not_done", r.backups_not_done)
      .Num("quarantined_blocks", info.quarantined_blocks)
      .Num("rpcs_failed", info.client.rpcs_failed);
  Json lat;
  for (int i = 0; i < kNumTimed; ++i) {
    const Stats::Latency& l = latencies[i];
    Json one;
    one.Num("count", l.count)
        .Real("p50_us", l.p50_us)
        .Real("p99_us", l.p99_us)
        .Real("max_us", l.max_us);
    lat.Obj(TimedName(static_cast<Timed>(i)), one);
  }
  Json top;
  top.Num("requests_done", s.requests)
      .Real("wall_s", wall)
      .Str("instance_id", info.instance_id)
      .Str("revision", info.revision)
      .Obj("workload", workload)
      .Obj("model", model)
      .Obj("daemon", daemon)
      .Obj("footprint", footprint)
      .Obj("hit_rate", hit)
      .Obj("throughput", throughput)
      .Num("backup_pages", r.backup_pages)
      .Obj("backup_status", statuses)
      .Obj("verification", verify)
      .Obj("misses", misses)
      .Obj("latency", lat);
  return top.Dump();
}

}  // namespace kvcellar::bench
