// Summary: the figures of a kvcellar_bench_datapath run beside their same-run baselines, printed
// as Markdown tables after Google Benchmark's own output, so the ratios against the goals of
// issue #4 read at a glance. Also the percentile helper the latency benchmarks share.
//
// Threading: thread-safe (benchmarks add rows from the main thread; the lock is cheap insurance).
#ifndef KVCELLAR_TESTS_BENCH_DATAPATH_SUMMARY_H_
#define KVCELLAR_TESTS_BENCH_DATAPATH_SUMMARY_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvcellar::bench {

// The q-quantile (0..1) of `samples` (nearest rank; sorts them). 0 when empty.
double Quantile(std::vector<double>* samples, double q);

class Summary {
 public:
  // Load/Backup bandwidth against memcpy of the same bytes, same chunking.
  void AddCopy(std::string name, double kvcellar_gbps, double memcpy_gbps);
  // Backup bandwidth with the warm-restart journal against without, same run.
  void AddJournal(std::string name, double journal_gbps, double plain_gbps);
  // Backup bandwidth with KV events published to a live subscriber against without, same run.
  void AddEvents(std::string name, double events_gbps, double plain_gbps);
  // Backup bandwidth with each page's tokens carried into the events against without, both
  // publishing, same run.
  void AddTokens(std::string name, double tokens_gbps, double plain_gbps);
  // Latency percentiles (microseconds) against the baseline's.
  void AddLatency(std::string name, std::string baseline, double p50_us, double p99_us,
                  double base_p50_us, double base_p99_us);
  // Where the time of one case goes: one p50 per part.
  void AddBreakdown(std::string name, std::string part, double p50_us, double p99_us);
  // Throughput with 1 and with N concurrent clients.
  void AddThroughput(std::string name, std::string unit, int clients, double one, double many,
                     double many_p50_us, double many_p99_us);

  void Print(std::FILE* out) const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> copy_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> journal_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> latency_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> breakdown_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> throughput_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_DATAPATH_SUMMARY_H_
