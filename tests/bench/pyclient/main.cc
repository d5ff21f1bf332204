// kvcellar_bench_pyclient: per-call latency of Match, Load and Backup from the C++ client, for
// 2048-page batches, against a kvcellard that is already running (call_bench.h). The reference
// half of client/python/bench/bench_calls.py, which starts the daemon, runs this binary beside
// the Python package's same calls, and prints the comparison; run that rather than this alone.
//
//   build/bin/kvcellar_bench_pyclient --socket=/tmp/d/kvcellard.sock --benchmark_format=json
//
// Flags (besides Google Benchmark's --benchmark_*):
//   --socket=PATH                  the daemon's Unix socket (else $KVCELLAR_BENCH_SOCKET)
//   --pyclient_iterations=N        timed calls per case (default 200)
//   --pyclient_warmup=N            untimed calls before them (default 20)
//   --pyclient_pages=N             pages per call (default 2048)
//   --pyclient_layers=N            layers of the sim engine (default 1)
//   --pyclient_bytes_per_block=N   bytes per layer per K/V buffer (default 256)
//   --pyclient_blocks=N            engine blocks (default 2 * pages)
//   --pyclient_page_size=N         tokens per page (default 16)
//   --pyclient_model=NAME          namespace model id (default kvcellar-bench-pyclient)
//   --pyclient_seed=N              seeds the prompt and the Backup keys (default 1); give every
//                                  run against one daemon its own
//   --pyclient_instance=ID         engine instance id (default pyclient-cxx-<pid>)
//   --pyclient_lockstep=IN,OUT     alternate every call with a peer process over these two pipe
//                                  fds (lockstep.h), as bench_calls.py runs it: the peer takes
//                                  warmup + iterations turns per case, in the order of
//                                  RegisterCallBenchmarks (call_bench.h)
//   --pyclient_samples=PATH        append every case's timed calls (us) to PATH, a line each
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "tests/bench/pyclient/call_bench.h"

namespace {

namespace kb = ::kvcellar::bench;

// Takes this binary's own flags out of argv (Google Benchmark rejects unknown ones). False with
// *error on a bad one.
bool ParseFlags(int* argc, char** argv, kb::CallBenchConfig* config, std::string* error) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name, std::string* v) {
      const std::string prefix = absl::StrCat(name, "=");
      if (!absl::StartsWith(a, prefix)) return false;
      *v = a.substr(prefix.size());
      return true;
    };
    // A non-negative integer flag; true when `a` is that flag.
    auto number = [&](const char* name, auto* n) {
      std::string v;
      if (!value(name, &v)) return false;
      uint64_t u = 0;
      if (!absl::SimpleAtoi(v, &u)) {
        *error = absl::StrCat(name, ": '", v, "' is not a non-negative integer");
      }
      *n = static_cast<std::remove_reference_t<decltype(*n)>>(u);
      return true;
    };
    std::string fds;
    if (value("--pyclient_lockstep", &fds)) {
      const std::vector<std::string> p = absl::StrSplit(fds, ',');
      if (p.size() != 2 || !absl::SimpleAtoi(p[0], &config->lockstep_in_fd) ||
          !absl::SimpleAtoi(p[1], &config->lockstep_out_fd) || config->lockstep_in_fd < 0 ||
          config->lockstep_out_fd < 0) {
        *error = absl::StrCat("--pyclient_lockstep: '", fds, "' is not IN_FD,OUT_FD");
      }
    } else if (value("--socket", &config->socket) || value("--pyclient_model", &config->model) ||
               value("--pyclient_instance", &config->instance_id) ||
               value("--pyclient_samples", &config->samples_path) ||
               number("--pyclient_iterations", &config->iterations) ||
               number("--pyclient_warmup", &config->warmup) ||
               number("--pyclient_pages", &config->pages) ||
               number("--pyclient_layers", &config->layers) ||
               number("--pyclient_bytes_per_block", &config->bytes_per_block) ||
               number("--pyclient_blocks", &config->blocks) ||
               number("--pyclient_page_size", &config->page_size) ||
               number("--pyclient_seed", &config->seed)) {
    } else if (absl::StartsWith(a, "--pyclient_")) {
      *error = absl::StrCat("unknown flag ", a);
    } else {
      argv[out++] = argv[i];
    }
    if (!error->empty()) return false;
  }
  *argc = out;
  if (config->socket.empty()) {
    const char* env = std::getenv("KVCELLAR_BENCH_SOCKET");
    if (env != nullptr) config->socket = env;
  }
  if (config->socket.empty()) {
    *error = "no daemon: give --socket=PATH or set KVCELLAR_BENCH_SOCKET";
    return false;
  }
  if (config->iterations <= 0) *error = "--pyclient_iterations must be > 0";
  return error->empty();
}

}  // namespace

int main(int argc, char** argv) {
  kb::CallBenchConfig config;
  std::string error;
  if (!ParseFlags(&argc, argv, &config, &error)) {
    std::fprintf(stderr, "kvcellar_bench_pyclient: %s\n", error.c_str());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  absl::StatusOr<std::unique_ptr<kb::CallBench>> bench = kb::CallBench::Start(config);
  if (!bench.ok()) {
    std::fprintf(stderr, "kvcellar_bench_pyclient: cannot start against %s: %s\n",
                 config.socket.c_str(), bench.status().ToString().c_str());
    return 1;
  }
  // The peer's end may close first; a write to it must fail, not kill this process.
  std::signal(SIGPIPE, SIG_IGN);
  if (!(*bench)->lockstep().Pass(&error)) {  // Set up: the peer's turn.
    std::fprintf(stderr, "kvcellar_bench_pyclient: %s\n", error.c_str());
    return 1;
  }
  kb::RegisterCallBenchmarks(bench->get());
  const size_t ran = benchmark::RunSpecifiedBenchmarks();
  bench->reset();
  benchmark::Shutdown();
  return ran > 0 ? 0 : 1;
}
