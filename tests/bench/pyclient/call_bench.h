// CallBench: per-call latency of the engine-facing calls of the C++ client (Session::Match,
// Load, Backup) against a kvcellard that is already running, one 2048-page batch per call.
//
// It is the C++ half of a comparison: client/python/bench/bench_calls.py starts the daemon, runs
// this binary, and runs the same calls with the same shapes from the Python package
// (client/python/kvcellar) against the same daemon, to bound what the package adds per call. So
// every request here is the one the package's defaults send (kvcellar_client_c.cc): Match without
// pin or prefetch; Load signalled per layer on a completion slot; Backup with a sim ready token;
// WaitOps without per-page statuses, and none for an op already DONE at submission.
//
// Page objects are small (by default 1 layer, K and V of 256 B per block) so that the figures are
// the calls' fixed costs, not the daemon's copies.
//
// Threading: one thread (the benchmark runner's) uses a CallBench at a time.
#ifndef KVCELLAR_TESTS_BENCH_PYCLIENT_CALL_BENCH_H_
#define KVCELLAR_TESTS_BENCH_PYCLIENT_CALL_BENCH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kvcellar_client.h"
#include "client/sim_engine.h"
#include "core/page_key.h"
#include "tests/bench/pyclient/lockstep.h"

namespace kvcellar::bench {

struct CallBenchConfig {
  std::string socket;  // The daemon's Unix socket.
  std::string model = "kvcellar-bench-pyclient";
  std::string instance_id;  // Empty: "pyclient-cxx-<pid>".
  uint32_t page_size = 16;
  uint32_t pages = 2048;  // Pages per call.
  uint32_t layers = 1;
  uint64_t bytes_per_block = 256;  // Per layer per K/V buffer.
  uint32_t blocks = 0;             // Engine blocks; 0: 2 * pages (Backup reads, Load writes).
  // Seeds the prompt's tokens and the fresh keys every Backup writes: two runs against one daemon
  // with different seeds neither hit nor collide with each other's pages.
  uint64_t seed = 1;
  int iterations = 200;  // Timed calls per case.
  int warmup = 20;       // Untimed calls before them.
  // Lockstep with a peer process (lockstep.h), or -1 and -1: alone. With it, Start passes the
  // turn once set up, and every call of every case (warm-up included, in registration order)
  // awaits the peer's turn first and passes it back after.
  int lockstep_in_fd = -1;
  int lockstep_out_fd = -1;
  // When set, every case appends a line "<name> <us> <us> ..." of its timed calls, in order (so a
  // peer in lockstep can pair them with its own).
  std::string samples_path;
};

// One case's per-call times, in microseconds.
struct CallSamples {
  std::vector<double> us;
  double Quantile(double q) const;
  double Mean() const;
};

class CallBench {
 public:
  // Connects, registers a sim engine, caches the prompt's pages (a Backup from blocks
  // [0, pages)) and pins them for the run, checking that a Match then hits every one.
  static absl::StatusOr<std::unique_ptr<CallBench>> Start(const CallBenchConfig& config);
  ~CallBench();

  const CallBenchConfig& config() const { return config_; }
  client::Session& session() { return *session_; }
  Lockstep& lockstep() { return lockstep_; }

  // One call each; false with *error when it did not do the whole batch. Timed by the caller
  // from entry to return.
  bool MatchKeys(std::string* error);
  bool MatchTokens(std::string* error);
  // Load of the cached prompt into blocks [pages, 2 * pages). `wait`: until WaitOps says DONE;
  // otherwise the submission only (the caller then calls FinishLoad, untimed).
  bool Load(bool wait, std::string* error);
  bool FinishLoad(std::string* error);
  // Backup of `keys` from blocks [0, pages), with a ready token; `wait` as for Load.
  bool Backup(const std::vector<core::PageKey>& keys, bool wait, std::string* error);
  bool FinishBackup(std::string* error);

  // Keys no Backup of this run (or of a run with another seed) used before.
  void FreshKeys(std::vector<core::PageKey>* keys);

 private:
  explicit CallBench(CallBenchConfig config)
      : config_(std::move(config)), lockstep_(config_.lockstep_in_fd, config_.lockstep_out_fd) {}
  absl::Status CacheAndPinPrompt();
  bool Finish(uint32_t want, std::string* error);

  const CallBenchConfig config_;
  Lockstep lockstep_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::SimEngine> sim_;
  std::unique_ptr<client::Session> session_;  // Closed before sim_ and client_ go.
  std::vector<uint32_t> tokens_;
  std::vector<core::PageKey> keys_;  // The prompt's, cached and pinned by Start.
  uint64_t pin_id_ = 0;              // Released by the destructor.
  std::vector<uint32_t> src_blocks_;
  std::vector<uint32_t> dst_blocks_;
  client::OpResult pending_;  // The op a submit-only call left running.
  uint32_t next_load_slot_ = 0;
  uint32_t next_ready_slot_ = 0;
  uint64_t next_key_ = 0;
};

// BM_MatchKeys, BM_MatchTokens, BM_Load, BM_LoadSubmit, BM_Backup, BM_BackupSubmit, in that
// order, each config.iterations timed calls after config.warmup untimed ones, reporting p50_us,
// p90_us, p99_us, mean_us and min_us (and the samples, to config.samples_path). In lockstep, each
// call waits for the peer's turn.
void RegisterCallBenchmarks(CallBench* bench);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_PYCLIENT_CALL_BENCH_H_
