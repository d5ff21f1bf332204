// CudaSummary: the figures of a kvcellar_bench_cuda run beside their same-run baselines, printed as
// Markdown tables after Google Benchmark's own output, so the ratios against issue #14's goals read
// at a glance.
//
// Threading: thread-safe (rows come from the main thread; the lock is cheap insurance).
#ifndef KVCELLAR_TESTS_BENCH_CUDA_CUDA_SUMMARY_H_
#define KVCELLAR_TESTS_BENCH_CUDA_CUDA_SUMMARY_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvcellar::bench {

class CudaSummary {
 public:
  // One Backup or Load case: its bandwidth and the two baselines' of the same bytes.
  void AddCopy(const std::string& shape, const std::string& op, const std::string& path,
               bool signals, double gbps, double bulk_gbps, double per_block_gbps);
  // Several engines at once: aggregate bandwidth against the link (bulk cudaMemcpy).
  void AddEngines(int engines, const std::string& op, const std::string& path, double gbps,
                  double link_gbps);
  // The engine's GEMM time alone and while the daemon copies on `path`.
  void AddInterference(const std::string& shape, const std::string& op, const std::string& path,
                       double copy_alone_gbps, double copy_during_gbps, double gemm_alone_ms,
                       double gemm_during_ms);

  void Print(std::FILE* out) const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> copy_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> engines_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> interference_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_CUDA_CUDA_SUMMARY_H_
