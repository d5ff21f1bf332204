#include "tests/bench/cuda/cuda_summary.h"

#include "absl/strings/str_format.h"
#include "tests/bench/markdown_table.h"

namespace kvcellar::bench {

void CudaSummary::AddCopy(const std::string& shape, const std::string& op, const std::string& path,
                          bool signals, double gbps, double bulk_gbps, double per_block_gbps) {
  absl::MutexLock lock(&mu_);
  copy_.push_back(absl::StrFormat("| %s | %s | %s | %s | %.2f | %.2f | %.2f | %.2fx | %.2fx |",
                                  shape, op, path, signals ? "yes" : "no", gbps, bulk_gbps,
                                  per_block_gbps, gbps / bulk_gbps, gbps / per_block_gbps));
}

void CudaSummary::AddEngines(int engines, const std::string& op, const std::string& path,
                             double gbps, double link_gbps) {
  absl::MutexLock lock(&mu_);
  engines_.push_back(absl::StrFormat("| %d | %s | %s | %.2f | %.2f | %.2fx |", engines, op, path,
                                     gbps, link_gbps, gbps / link_gbps));
}

void CudaSummary::AddInterference(const std::string& shape, const std::string& op,
                                  const std::string& path, double copy_alone_gbps,
                                  double copy_during_gbps, double gemm_alone_ms,
                                  double gemm_during_ms) {
  absl::MutexLock lock(&mu_);
  interference_.push_back(absl::StrFormat("| %s | %s | %s | %.2f | %.2f | %.3f | %.3f | %+.1f%% |",
                                          shape, op, path, copy_alone_gbps, copy_during_gbps,
                                          gemm_alone_ms, gemm_during_ms,
                                          100.0 * (gemm_during_ms / gemm_alone_ms - 1.0)));
}

void CudaSummary::Print(std::FILE* out) const {
  absl::MutexLock lock(&mu_);
  PrintMarkdownTable(
      out,
      "Backup and Load through the daemon's CUDA backend (and end to end through kvcellard) vs "
      "(a) one bulk cudaMemcpy and (b) one cudaMemcpyAsync per block, same bytes, same pinned "
      "pages (goals: >= 0.9x bulk; >= 3x per-block for blocks <= 32 KiB)",
      "| shape | op | path | signals | GB/s | bulk GB/s | per-block GB/s | vs bulk | vs per-block "
      "|",
      "|---|---|---|---|---|---|---|---|---|", copy_);
  PrintMarkdownTable(
      out,
      "Several engines at once: aggregate vs the link (bulk cudaMemcpy, one stream, same run; "
      "goal >= 0.9x)",
      "| engines | op | path | aggregate GB/s | link GB/s | ratio |", "|---|---|---|---|---|---|",
      engines_);
  PrintMarkdownTable(
      out,
      "Interference: the engine's GEMM (its own process and stream) while the daemon copies "
      "at full speed (goal < 5%)",
      "| shape | op | path | copy GB/s alone | copy GB/s during GEMM | GEMM ms alone | GEMM ms "
      "during copies | GEMM slowdown |",
      "|---|---|---|---|---|---|---|---|", interference_);
  std::fflush(out);
}

}  // namespace kvcellar::bench
