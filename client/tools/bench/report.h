// Report: kvcellar-bench's output: the progress line printed while it runs, the summary table,
// and the same summary as JSON. Rates are over the run's wall time; byte rates stand beside a
// memcpy baseline measured by the same process in the same run.
//
// Threading: pure functions.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_REPORT_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_REPORT_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "client/client_types.h"
#include "client/tools/bench/model_shape.h"
#include "client/tools/bench/stats.h"
#include "client/tools/bench/workload.h"

namespace kvcellar::bench {

// What was run, against what.
struct RunInfo {
  std::string socket;
  std::string daemon_version;
  std::string instance_id;
  std::string revision;
  WorkloadSpec workload;
  uint32_t parallel = 0;
  uint64_t requests = 0;
  uint64_t total_prompt_tokens = 0;
  uint64_t best_case_hit_tokens = 0;
  ModelShape shape;
  bool auto_scaled = false;
  double fill = 0;             // Target: workload L2 bytes / L2 capacity.
  double footprint_ratio = 0;  // Actual.
  uint64_t distinct_pages = 0;
  uint64_t l2_capacity = 0;
  uint64_t l2_used_at_start = 0;
  // A shape's run (WorkloadSpec::shape): its name, the pages L2 holds (capacity / page bytes)
  // and Belady's bound on the shape's trace at that many pages (core/eviction_sim.h).
  std::string shape_name;
  uint64_t l2_pages = 0;
  double bound_hit_rate = 0;
  std::vector<std::string> l3_tiers;
  uint32_t gpu_blocks = 0;
  double memcpy_gb_s = 0;
  // Filled at the end.
  double wall_s = 0;
  uint64_t quarantined_blocks = 0;
  client::ClientStats client;
};

std::string ProgressLine(const RunInfo& info, const Stats::Snapshot& s, double elapsed_s);
std::string SummaryText(const RunInfo& info, const Stats::Snapshot& s,
                        const std::array<Stats::Latency, kNumTimed>& latencies);
std::string SummaryJson(const RunInfo& info, const Stats::Snapshot& s,
                        const std::array<Stats::Latency, kNumTimed>& latencies);

std::string HumanBytes(double bytes);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_REPORT_H_
