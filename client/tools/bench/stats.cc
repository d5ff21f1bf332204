#include "client/tools/bench/stats.h"

#include <algorithm>
#include <cmath>

namespace kvcellar::bench {

const char* TimedName(Timed t) {
  switch (t) {
    case Timed::kMatch:
      return "Match";
    case Timed::kLoad:
      return "Load";
    case Timed::kBackup:
      return "Backup";
    case Timed::kWaitOps:
      return "WaitOps";
    case Timed::kRelease:
      return "Release";
    case Timed::kLoadOp:
      return "load op";
    case Timed::kBackupOp:
      return "backup op";
    case Timed::kRequest:
      return "request";
  }
  return "?";
}

void Stats::Record(Timed t, absl::Duration d) {
  const float us = static_cast<float>(absl::ToDoubleMicroseconds(d));
  absl::MutexLock lock(&mu_);
  samples_us_[static_cast<int>(t)].push_back(us);
}

void Stats::Add(const RequestResult& r) {
  absl::MutexLock lock(&mu_);
  RequestResult& s = totals_.sum;
  ++totals_.requests;
  s.prompt_tokens += r.prompt_tokens;
  s.best_case_hit_tokens += r.best_case_hit_tokens;
  s.l2_hit_tokens += r.l2_hit_tokens;
  if (s.l3_hit_tokens_by_tier.size() < r.l3_hit_tokens_by_tier.size()) {
    s.l3_hit_tokens_by_tier.resize(r.l3_hit_tokens_by_tier.size());
  }
  for (size_t i = 0; i < r.l3_hit_tokens_by_tier.size(); ++i) {
    s.l3_hit_tokens_by_tier[i] += r.l3_hit_tokens_by_tier[i];
  }
  s.loaded_tokens += r.loaded_tokens;
  s.load_bytes += r.load_bytes;
  s.backup_bytes += r.backup_bytes;
  s.backup_pages += r.backup_pages;
  for (const auto& [k, v] : r.backup_status) s.backup_status[k] += v;
  s.verified_bytes += r.verified_bytes;
  s.mismatched_bytes += r.mismatched_bytes;
  if (s.first_mismatch.empty()) s.first_mismatch = r.first_mismatch;
  s.degraded_calls += r.degraded_calls;
  s.loads_not_done += r.loads_not_done;
  s.backups_not_done += r.backups_not_done;
}

Stats::Snapshot Stats::snapshot() const {
  absl::MutexLock lock(&mu_);
  return totals_;
}

std::array<Stats::Latency, kNumTimed> Stats::Latencies() const {
  std::array<std::vector<float>, kNumTimed> samples;
  {
    absl::MutexLock lock(&mu_);
    samples = samples_us_;
  }
  std::array<Latency, kNumTimed> out;
  for (int i = 0; i < kNumTimed; ++i) {
    std::vector<float>& v = samples[i];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    // Nearest rank: the smallest sample with at least q of the samples at or below it.
    auto rank = [&](double q) {
      const size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
      return static_cast<double>(v[std::max<size_t>(k, 1) - 1]);
    };
    out[i] = {v.size(), rank(0.50), rank(0.99), static_cast<double>(v.back())};
  }
  return out;
}

}  // namespace kvcellar::bench
