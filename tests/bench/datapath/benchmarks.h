// The benchmark families of kvcellar_bench_datapath, registered by main.cc against one
// DatapathEnv (the daemon they all use) and one Summary (the tables printed at the end).
#ifndef KVCELLAR_TESTS_BENCH_DATAPATH_BENCHMARKS_H_
#define KVCELLAR_TESTS_BENCH_DATAPATH_BENCHMARKS_H_

#include <cstdint>

#include "tests/bench/datapath/bench_env.h"
#include "tests/bench/datapath/summary.h"

namespace kvcellar::bench {

struct BenchConfig {
  // Bytes one Load or Backup moves (pages = this / page object bytes, at least 1).
  uint64_t batch_bytes = 64ull << 20;
  // Timed ops per Load/Backup case (fixed, so setup runs once per case).
  int copy_iterations = 30;
  // Timed Match calls per page size (each case and baseline that many times, interleaved).
  int match_iterations = 2000;
  // Seconds each phase (1 client, N clients) of a throughput case runs.
  double concurrent_seconds = 2;
  int clients = 8;
};

// BM_Load / BM_Backup: bandwidth for page objects of 64 KiB to 8 MiB, 32 and 80 layers.
void RegisterCopyBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config);
// BM_Match: latency of 2048-page Match at page sizes 16 and 64, with its baseline and breakdown.
void RegisterMatchBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config);
// BM_Concurrent: RPC throughput with 1 and with N clients.
void RegisterConcurrencyBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_DATAPATH_BENCHMARKS_H_
