// kvcellar_bench_datapath: the engine data path end to end, through a real kvcellard process on
// the sim device, every figure beside a baseline measured in the same run (issue #4, item 6):
//
//   BM_Backup, BM_Load   bandwidth of Backup and Load for page objects of 64 KiB to 8 MiB over 32
//                        and 80 layers, vs memcpy of the same bytes in the same chunks (goal
//                        >= 0.8x). copy_bench.cc.
//   BM_Match             p50/p99 of a 2048-page Match over the Unix socket at page sizes 16 and
//                        64, key hashing included, vs a no-op gRPC call carrying the same request
//                        bytes + SHA-256 of the same token bytes (goal p50 <= 1.25x), with where
//                        the time goes. match_bench.cc.
//   BM_BackupJournal     Backup with the warm-restart journal vs without; BM_BackupEvents: with
//                        KV events published to a live ZMQ subscriber vs without (goal >= 0.95x).
//                        copy_bench.cc.
//   BM_Concurrent        RPC throughput of 1 vs 8 concurrent clients (Match; Backup+Load mix).
//                        concurrency_bench.cc.
// Google Benchmark's lines come first; the comparison tables (Markdown) are printed at the end.
//
//   build/bin/kvcellar_bench_datapath                       # everything, ~1-2 minutes on 2 cores
//   build/bin/kvcellar_bench_datapath --benchmark_filter=BM_Match
//
// Flags (besides Google Benchmark's --benchmark_*):
//   --kvcellard=PATH                   daemon binary (default: kvcellard next to this binary)
//   --datapath_batch_mib=N             bytes per Load/Backup op, MiB (default 64)
//   --datapath_copy_iterations=N       timed ops per Load/Backup case (default 30)
//   --datapath_match_iterations=N      timed Match calls per page size (default 2000)
//   --datapath_concurrent_seconds=S    seconds per throughput phase (default 2)
//   --datapath_clients=N               concurrent clients (default 8)
//   --datapath_pool_mib=N              kvcellard pool.capacity, MiB (default 1024)
//   --datapath_keep_dir                keep the temp dir with kvcellard.log
// The binary re-executes itself with --datapath_noop_server=SOCK for the baseline's server.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "tests/bench/datapath/benchmarks.h"
#include "tests/bench/datapath/noop_server.h"

namespace {

namespace kb = ::kvcellar::bench;

std::string SelfPath() {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.string();
}

// Takes this binary's own flags out of argv (Google Benchmark rejects unknown ones). False with
// *error on a bad one.
bool ParseFlags(int* argc, char** argv, kb::EnvOptions* env, kb::BenchConfig* config,
                std::string* noop_socket, std::string* error) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name, std::string* v) {
      const std::string prefix = absl::StrCat(name, "=");
      if (!absl::StartsWith(a, prefix)) return false;
      *v = a.substr(prefix.size());
      return true;
    };
    auto number = [&](const char* name, double* d) {
      std::string v;
      if (!value(name, &v)) return false;
      if (!absl::SimpleAtod(v, d) || *d <= 0)
        *error = absl::StrCat(name, ": '", v, "' is not a positive number");
      return true;
    };
    std::string v;
    double d = 0;
    if (value("--datapath_noop_server", noop_socket) || value("--kvcellard", &env->kvcellard)) {
    } else if (number("--datapath_batch_mib", &d)) {
      config->batch_bytes = static_cast<uint64_t>(d * (1 << 20));
    } else if (number("--datapath_copy_iterations", &d)) {
      config->copy_iterations = static_cast<int>(d);
    } else if (number("--datapath_match_iterations", &d)) {
      config->match_iterations = static_cast<int>(d);
    } else if (number("--datapath_concurrent_seconds", &d)) {
      config->concurrent_seconds = d;
    } else if (number("--datapath_clients", &d)) {
      config->clients = static_cast<int>(d);
    } else if (number("--datapath_pool_mib", &d)) {
      env->pool_bytes = static_cast<uint64_t>(d) << 20;
    } else if (a == "--datapath_keep_dir") {
      env->keep_dir = true;
    } else if (absl::StartsWith(a, "--datapath_")) {
      *error = absl::StrCat("unknown flag ", a);
    } else {
      argv[out++] = argv[i];
    }
    if (!error->empty()) return false;
  }
  *argc = out;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  kb::EnvOptions env_options;
  kb::BenchConfig config;
  std::string noop_socket, error;
  env_options.self = SelfPath();
  if (!ParseFlags(&argc, argv, &env_options, &config, &noop_socket, &error)) {
    std::fprintf(stderr, "kvcellar_bench_datapath: %s\n", error.c_str());
    return 2;
  }
  if (!noop_socket.empty()) return kb::RunNoopServer(noop_socket);
  if (env_options.kvcellard.empty()) {
    env_options.kvcellard =
        (std::filesystem::path(env_options.self).parent_path() / "kvcellard").string();
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  absl::StatusOr<std::unique_ptr<kb::DatapathEnv>> env = kb::DatapathEnv::Start(env_options);
  if (!env.ok()) {
    std::fprintf(stderr, "kvcellar_bench_datapath: cannot start: %s\n",
                 env.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "kvcellard %s on %s (logs in %s%s)\n", env_options.kvcellard.c_str(),
               (*env)->daemon_socket().c_str(), (*env)->dir().c_str(),
               env_options.keep_dir ? "" : ", removed at exit; --datapath_keep_dir keeps them");
  kb::Summary summary;
  kb::RegisterCopyBenchmarks(env->get(), &summary, config);
  kb::RegisterMatchBenchmarks(env->get(), &summary, config);
  kb::RegisterConcurrencyBenchmarks(env->get(), &summary, config);
  benchmark::RunSpecifiedBenchmarks();
  summary.Print(stdout);
  const int daemon_status = (*env)->StopDaemon();
  env->reset();
  benchmark::Shutdown();
  if (daemon_status != 0) {
    std::fprintf(stderr, "kvcellard exited with wait status %d\n", daemon_status);
    return 1;
  }
  return 0;
}
