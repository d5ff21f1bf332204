// The case families of kvcellar_bench_cuda, registered by main.cc against one CudaBenchEnv and one
// CudaSummary (the Markdown tables printed at the end), and the same-run baselines they share.
#ifndef KVCELLAR_TESTS_BENCH_CUDA_BENCHMARKS_H_
#define KVCELLAR_TESTS_BENCH_CUDA_BENCHMARKS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tests/bench/cuda/cuda_bench_env.h"
#include "tests/bench/cuda/cuda_summary.h"
#include "tests/gpu/cuda_engine_process.h"

namespace kvcellar::bench {

struct CudaBenchConfig {
  // Bytes one Backup or Load moves (pages = this / page object bytes, at least 1).
  uint64_t batch_bytes = 256ull << 20;
  // Timed ops per case (each beside one bulk and one per-block baseline).
  int iterations = 10;
  // Block = one layer's K (or V) bytes of one page: what one per-block cudaMemcpyAsync moves.
  std::vector<uint64_t> block_bytes = {16 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20};
  std::vector<uint32_t> layers = {32, 80};
  // Several engines at once: engine counts, and each engine's shape and batch.
  std::vector<int> engines = {1, 4, 8};
  uint64_t multi_block_bytes = 32 << 10;
  uint32_t multi_layers = 80;
  uint64_t multi_batch_bytes = 128ull << 20;
  // Interference: the engine's GEMM size and how long each GEMM phase runs; the block sizes and
  // layer count of the copies; the copy kernel's thread-block counts to compare.
  int gemm_n = 4096;
  int gemm_ms = 1500;
  std::vector<uint64_t> interference_block_bytes = {32 << 10, 512 << 10};
  uint32_t interference_layers = 32;
  std::vector<uint32_t> kernel_blocks = {8, 16, 32, 64, 132};
  // The kernel path's thread blocks in the other cases: the daemon's default.
  uint32_t default_kernel_blocks = 32;
};

// Pages per op for blocks of `block_bytes` over `layers` layers.
uint32_t PagesPerOp(uint64_t batch_bytes, uint64_t block_bytes, uint32_t layers);

// Longest wait for one op: a few hundred MiB at even 0.5 GB/s.
inline constexpr absl::Duration kOpWait = absl::Seconds(60);

// Submits one Gather (Backup) or Scatter (Load) of `items` on the backend and waits for it, at
// most kOpWait. With `signals` the Gather waits on the engine's `ready_event` and the Scatter
// signals load slot 0 with `ticket`.
absl::Status BackendOp(Backend& b, gpu::EngineMapping& m, absl::Span<const gpu::CopyItem> items,
                       bool load, bool signals = false, const std::string& ready_event = "",
                       uint64_t ticket = 0);

// The baselines, timed in this process on a device buffer of its own laid out as the engine's pool
// of `pages` blocks (the bytes an op moves), to and from the same pinned host pages as the op.
class CopyBaselines {
 public:
  static absl::StatusOr<std::unique_ptr<CopyBaselines>> Create(
      const gpu::testing::PoolShape& shape);
  ~CopyBaselines();

  // (a) One cudaMemcpy of every byte (page objects back to back in `host`).
  absl::StatusOr<absl::Duration> Bulk(uint8_t* host, bool to_device);
  // (b) One cudaMemcpyAsync per block (page, layer, K/V) between the block and its place in the
  // page-first host object, on one stream, then one synchronize.
  absl::StatusOr<absl::Duration> PerBlock(uint8_t* host, bool to_device);
  uint64_t bytes() const { return shape_.pool_bytes(); }

 private:
  explicit CopyBaselines(const gpu::testing::PoolShape& shape) : shape_(shape) {}
  const gpu::testing::PoolShape shape_;
  uint8_t* dev_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Backup and Load through the backend (copy engine, copy kernel; with and without signals) and
// through kvcellard, for every block size and layer count, beside both baselines.
void RegisterCopyBenchmarks(CudaBenchEnv* env, CudaSummary* summary, const CudaBenchConfig& config);
// 1, 4 and 8 engines copying at once, through the backend and through kvcellard, vs the link.
void RegisterMultiEngineBenchmarks(CudaBenchEnv* env, CudaSummary* summary,
                                   const CudaBenchConfig& config);
// The engine's GEMM alone and while the daemon copies, per copy path and kernel size.
void RegisterInterferenceBenchmarks(CudaBenchEnv* env, CudaSummary* summary,
                                    const CudaBenchConfig& config);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_CUDA_BENCHMARKS_H_
