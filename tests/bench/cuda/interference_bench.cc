// BM_CudaInterference: how much the engine's own work slows down while the daemon copies at full
// speed. The engine process runs a compute-bound GEMM (tests/gpu/tiled_gemm.h) on its own stream,
// timed per launch with CUDA events: first alone, then while this process submits Backups (or
// Loads) back to back through the backend for the whole GEMM phase. Per copy path: the copy
// engines (cudaMemcpyBatchAsync), and the copy kernel at each thread-block count
// (CudaDeviceOptions::kernel_max_blocks), so that the path and the kernel's size can be chosen
// from the slowdown against the copy bandwidth each gives.
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "tests/bench/cuda/benchmarks.h"

namespace kvcellar::bench {
namespace {

using gpu::testing::PoolShape;

// How long past its length a GEMM phase may run before the engine counts as stuck (the engine's own
// answer timeout, CudaEngineProcess::FinishGemm).
constexpr absl::Duration kGemmGrace = absl::Seconds(300);

void RunInterference(benchmark::State& state, CudaBenchEnv* env, CudaSummary* summary,
                     const CudaBenchConfig& config, uint64_t block, bool load,
                     const BackendKey& key) {
  const uint32_t layers = config.interference_layers;
  const uint32_t pages = PagesPerOp(config.batch_bytes, block, layers);
  const PoolShape shape{layers, block, 2 * pages};
  const uint64_t batch = pages * shape.object_bytes();
  absl::StatusOr<gpu::testing::CudaEngineProcess*> engine = env->Engine(0, shape);
  absl::StatusOr<Backend*> backend = engine.ok() ? env->GetBackend(key, batch) : engine.status();
  absl::StatusOr<gpu::EngineMapping*> mapping =
      backend.ok() ? env->Mapping(*backend, 0) : backend.status();
  if (!mapping.ok()) {
    state.SkipWithError(mapping.status().ToString().c_str());
    return;
  }
  Backend& b = **backend;
  std::vector<gpu::CopyItem> items;
  for (uint32_t i = 0; i < pages; ++i) {
    items.push_back({load ? pages + i : i, b.host + i * shape.object_bytes()});
  }
  // Copies alone (after one untimed op).
  absl::Status st = BackendOp(b, **mapping, items, load);
  const absl::Time a0 = absl::Now();
  for (int i = 0; i < config.iterations && st.ok(); ++i) st = BackendOp(b, **mapping, items, load);
  const absl::Duration copy_alone = absl::Now() - a0;
  // The GEMM alone (its first call also checks the kernel's result).
  absl::StatusOr<gpu::testing::GemmTiming> alone =
      st.ok() ? (*engine)->Gemm(config.gemm_n, config.gemm_ms) : st;
  if (!alone.ok()) {
    state.SkipWithError(alone.status().ToString().c_str());
    return;
  }
  for (auto _ : state) {
    // One copy before the GEMM phase starts, then copies back to back until its answer arrives.
    st = BackendOp(b, **mapping, items, load);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    if (absl::Status s = (*engine)->StartGemm(config.gemm_n, config.gemm_ms); !s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    int ops = 0;
    const absl::Time t0 = absl::Now();
    const absl::Time give_up = t0 + absl::Milliseconds(config.gemm_ms) + kGemmGrace;
    while (st.ok() && !(*engine)->GemmDone()) {
      if (absl::Now() > give_up) {
        (*engine)->Finish(absl::ZeroDuration());  // Stuck: its answer would come to a later case.
        st = absl::DeadlineExceededError("engine process: GEMM phase did not end; killed it");
        break;
      }
      st = BackendOp(b, **mapping, items, load);
      ++ops;
    }
    const absl::Duration window = absl::Now() - t0;
    // Read even after a failed copy: an answer left in the pipe would be taken as the next
    // case's GEMM timing. (An engine ended above answers "not running" at once.)
    absl::StatusOr<gpu::testing::GemmTiming> during = (*engine)->FinishGemm();
    if (during.ok() && !st.ok()) during = st;
    if (!during.ok()) {
      state.SkipWithError(during.status().ToString().c_str());
      return;
    }
    state.SetIterationTime(absl::ToDoubleSeconds(window));
    const double alone_gbps =
        double(config.iterations) * batch / absl::ToDoubleSeconds(copy_alone) / 1e9;
    const double during_gbps = double(ops) * batch / absl::ToDoubleSeconds(window) / 1e9;
    state.counters["copy_alone_GBps"] = alone_gbps;
    state.counters["copy_during_GBps"] = during_gbps;
    state.counters["gemm_alone_ms"] = alone->median_ms;
    state.counters["gemm_during_ms"] = during->median_ms;
    state.counters["gemm_slowdown_pct"] = 100.0 * (during->median_ms / alone->median_ms - 1.0);
    summary->AddInterference(
        absl::StrCat(block >> 10, " KiB x ", layers, " layers, GEMM n=", config.gemm_n),
        load ? "Load" : "Backup", key.Name(), alone_gbps, during_gbps, alone->median_ms,
        during->median_ms);
  }
}

}  // namespace

void RegisterInterferenceBenchmarks(CudaBenchEnv* env, CudaSummary* summary,
                                    const CudaBenchConfig& config) {
  using Path = gpu::CudaDeviceOptions::CopyPath;
  std::vector<BackendKey> keys = {{Path::kMemcpy, config.default_kernel_blocks}};
  for (uint32_t blocks : config.kernel_blocks) keys.push_back({Path::kKernel, blocks});
  for (uint64_t block : config.interference_block_bytes) {
    for (bool load : {false, true}) {
      for (const BackendKey& key : keys) {
        const std::string name = absl::StrCat("BM_CudaInterference/block_KiB:", block >> 10, "/",
                                              load ? "Load" : "Backup", "/path:", key.Name());
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& state) {
                                       RunInterference(state, env, summary, config, block, load,
                                                       key);
                                     })
            ->Iterations(1)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace kvcellar::bench
