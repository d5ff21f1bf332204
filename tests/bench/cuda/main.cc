// kvcellar_bench_cuda: the CUDA data path (issue #14). Engine processes (this binary re-executed)
// export layer-first KV pools through CUDA IPC; Backup and Load run through the daemon's CUDA
// backend in this process and end to end through a real kvcellard, each beside (a) one bulk
// cudaMemcpy of the same bytes and (b) one cudaMemcpyAsync per block, timed in the same iteration:
//
//   BM_CudaBackup, BM_CudaLoad  blocks of 16 KiB to 2 MiB, 32 and 80 layers; copy engine, copy
//                               kernel, kvcellard; with and without ready events / per-layer load
//                               signals. copy_bench.cc.
//   BM_CudaEngines              1, 4 and 8 engines at once: aggregate vs the link.
//                               multi_engine_bench.cc.
//   BM_CudaInterference         the engine's GEMM slowdown while the daemon copies, per copy path
//                               and copy-kernel size. interference_bench.cc.
// Google Benchmark's lines come first; the comparison tables (Markdown) are printed at the end.
// Without a CUDA device (or without CUDA compiled in) it says so in one line and exits 0.
//
//   build/bin/kvcellar_bench_cuda                     # everything, a few minutes on an H100
//   build/bin/kvcellar_bench_cuda --cuda_smoke        # one small case of each (ctest)
//
// Flags (besides Google Benchmark's --benchmark_*):
//   --kvcellard=PATH        daemon binary (default: kvcellard next to this binary)
//   --cuda_smoke            one small shape, 2 iterations, 1 and 2 engines, a short GEMM
//   --cuda_batch_mib=N      bytes per Backup/Load op, MiB (default 256)
//   --cuda_iterations=N     timed ops per case (default 10)
//   --cuda_gemm_n=N         GEMM size, a multiple of 128 (default 4096)
//   --cuda_gemm_ms=N        length of each GEMM phase, ms (default 1500)
//   --cuda_pool_mib=N       kvcellard pool.capacity, MiB, a multiple of 512 (default 8192)
//   --cuda_keep_dir         keep the temp dir with kvcellard.log
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "gpu/cuda/cuda_device.h"

#if KVCELLAR_HAVE_CUDA
#include "tests/bench/cuda/benchmarks.h"
#include "tests/bench/cuda/cuda_bench_env.h"
#include "tests/bench/cuda/cuda_summary.h"
#include "tests/gpu/cuda_engine_process.h"
#include "tests/gpu/tiled_gemm.h"
#endif

namespace {

constexpr char kName[] = "kvcellar_bench_cuda";

struct Flags {
  std::string kvcellard;
  bool smoke = false;
  bool keep_dir = false;
  double batch_mib = 0;
  double iterations = 0;
  double gemm_n = 0;
  double gemm_ms = 0;
  double pool_mib = 0;
};

// Takes this binary's own flags out of argv (Google Benchmark rejects unknown ones). False with
// *error on a bad one.
bool ParseFlags(int* argc, char** argv, Flags* flags, std::string* error) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    auto number = [&](const char* name, double* d) {
      const std::string prefix = absl::StrCat(name, "=");
      if (!absl::StartsWith(a, prefix)) return false;
      const std::string v = a.substr(prefix.size());
      if (!absl::SimpleAtod(v, d) || *d <= 0) {
        *error = absl::StrCat(name, ": '", v, "' is not a positive number");
      }
      return true;
    };
    if (absl::StartsWith(a, "--kvcellard=")) {
      flags->kvcellard = a.substr(std::string("--kvcellard=").size());
    } else if (a == "--cuda_smoke") {
      flags->smoke = true;
    } else if (a == "--cuda_keep_dir") {
      flags->keep_dir = true;
    } else if (number("--cuda_batch_mib", &flags->batch_mib) ||
               number("--cuda_iterations", &flags->iterations) ||
               number("--cuda_gemm_n", &flags->gemm_n) ||
               number("--cuda_gemm_ms", &flags->gemm_ms) ||
               number("--cuda_pool_mib", &flags->pool_mib)) {
    } else if (absl::StartsWith(a, "--cuda_")) {
      *error = absl::StrCat("unknown flag ", a);
    } else {
      argv[out++] = argv[i];
    }
    if (!error->empty()) return false;
  }
  *argc = out;
  return true;
}

#if KVCELLAR_HAVE_CUDA

namespace kb = ::kvcellar::bench;

std::string SelfPath() {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.string();
}

kb::CudaBenchConfig MakeConfig(const Flags& f) {
  kb::CudaBenchConfig c;
  if (f.smoke) {
    // Proves every family starts, runs and reports, in seconds.
    c.batch_bytes = 8ull << 20;
    c.iterations = 2;
    c.block_bytes = {32 << 10};
    c.layers = {32};
    c.engines = {1, 2};
    c.multi_layers = 32;
    c.multi_batch_bytes = 8ull << 20;
    c.gemm_n = 512;
    c.gemm_ms = 100;
    c.interference_block_bytes = {32 << 10};
    c.kernel_blocks = {32};
  }
  if (f.batch_mib > 0) c.batch_bytes = static_cast<uint64_t>(f.batch_mib * (1 << 20));
  if (f.iterations > 0) c.iterations = static_cast<int>(f.iterations);
  if (f.gemm_n > 0) c.gemm_n = static_cast<int>(f.gemm_n);
  if (f.gemm_ms > 0) c.gemm_ms = static_cast<int>(f.gemm_ms);
  return c;
}

int Run(int argc, char** argv, const Flags& flags) {
  const kb::CudaBenchConfig config = MakeConfig(flags);
  if (config.gemm_n % kvcellar::gpu::testing::kGemmTile != 0) {
    std::fprintf(stderr, "%s: --cuda_gemm_n must be a multiple of %d\n", kName,
                 kvcellar::gpu::testing::kGemmTile);
    return 2;
  }
  kb::CudaEnvOptions options;
  options.self = SelfPath();
  options.kvcellard =
      flags.kvcellard.empty()
          ? (std::filesystem::path(options.self).parent_path() / "kvcellard").string()
          : flags.kvcellard;
  options.keep_dir = flags.keep_dir;
  if (flags.smoke) options.daemon_pool_bytes = 512ull << 20;
  if (flags.pool_mib > 0) options.daemon_pool_bytes = static_cast<uint64_t>(flags.pool_mib) << 20;

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  kb::CudaSummary summary;
  {
    kb::CudaBenchEnv env(options);
    kb::RegisterCopyBenchmarks(&env, &summary, config);
    kb::RegisterMultiEngineBenchmarks(&env, &summary, config);
    kb::RegisterInterferenceBenchmarks(&env, &summary, config);
    benchmark::RunSpecifiedBenchmarks();
  }  // Sessions, mappings, engines and kvcellard end before the tables are printed.
  summary.Print(stdout);
  benchmark::Shutdown();
  return 0;
}

#endif  // KVCELLAR_HAVE_CUDA

}  // namespace

int main(int argc, char** argv) {
#if KVCELLAR_HAVE_CUDA
  // Re-executed as an engine process: that and nothing else.
  if (std::optional<int> rc = kvcellar::gpu::testing::MaybeRunCudaEngineProcess()) return *rc;
#endif
  Flags flags;
  std::string error;
  if (!ParseFlags(&argc, argv, &flags, &error)) {
    std::fprintf(stderr, "%s: %s\n", kName, error.c_str());
    return 2;
  }
#if !KVCELLAR_HAVE_CUDA
  std::printf("%s: built without CUDA (KVCELLAR_CUDA=OFF or no nvcc): nothing to measure\n", kName);
  return 0;
#else
  absl::StatusOr<int> devices = kvcellar::gpu::CudaDeviceCount();
  if (!devices.ok() || *devices == 0) {
    std::printf("%s: no CUDA device (%s): skipping\n", kName,
                devices.ok() ? "none visible" : std::string(devices.status().message()).c_str());
    return 0;
  }
  return Run(argc, argv, flags);
#endif
}
