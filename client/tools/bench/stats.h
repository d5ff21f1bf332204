// Stats: what kvcellar-bench measured: per-request counters (tokens, hits per tier, bytes per
// direction, verification) and client-side latencies per RPC, for the progress line and the
// summary.
//
// Threading: thread-safe. Request threads call Record and Add; the progress thread and main()
// call Snapshot and Latencies.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_STATS_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_STATS_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcellar::bench {

// Timed calls: the five RPCs as the engine sees them (one call of one rank), then the ops from
// submission to terminal state, and whole requests.
enum class Timed : int { kMatch, kLoad, kBackup, kWaitOps, kRelease, kLoadOp, kBackupOp, kRequest };
inline constexpr int kNumTimed = 8;
const char* TimedName(Timed t);

// What one request did, over every rank of the engine group.
struct RequestResult {
  uint64_t prompt_tokens = 0;
  uint64_t best_case_hit_tokens = 0;
  // Match's group-consistent answer, in tokens: the L2 hit and the L3 hit per tier (index i is
  // the daemon's L3 tier i).
  uint64_t l2_hit_tokens = 0;
  std::vector<uint64_t> l3_hit_tokens_by_tier;
  // Prompt tokens the engine did not recompute: pages every rank loaded and verified.
  uint64_t loaded_tokens = 0;
  uint64_t load_bytes = 0;    // L2 -> engine, every rank.
  uint64_t backup_bytes = 0;  // Engine -> L2, every rank, pages the daemon stored.
  uint64_t backup_pages = 0;  // Page objects sent to Backup.
  std::map<std::string, uint64_t> backup_status;  // Final PageStatus name -> page objects.
  uint64_t verified_bytes = 0;
  uint64_t mismatched_bytes = 0;
  std::string first_mismatch;
  uint64_t degraded_calls = 0;  // Match/Load/Backup answered as a miss without the daemon.
  uint64_t loads_not_done = 0;
  uint64_t backups_not_done = 0;
};

class Stats {
 public:
  struct Snapshot {
    uint64_t requests = 0;
    RequestResult sum;  // Every field summed; first_mismatch is the first one seen.
  };
  struct Latency {
    uint64_t count = 0;
    double p50_us = 0;
    double p99_us = 0;
    double max_us = 0;
  };

  void Record(Timed t, absl::Duration d);
  void Add(const RequestResult& r);
  Snapshot snapshot() const;
  std::array<Latency, kNumTimed> Latencies() const;

 private:
  mutable absl::Mutex mu_;
  Snapshot totals_ ABSL_GUARDED_BY(mu_);
  std::array<std::vector<float>, kNumTimed> samples_us_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_STATS_H_
