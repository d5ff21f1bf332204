// DatapathEnv: what every kvcellar_bench_datapath benchmark runs against: a real kvcellard child
// process on a temp Unix socket (sim device, config through --set), the no-op gRPC server of the
// Match baseline in a second child process, and helpers to register sim engines with
// libkvcellar-client as an engine rank would.
//
// A real daemon process rather than an in-process server::Daemon: the figures are then what an
// engine sees (its own process, the socket, the daemon's threads scheduled beside the engine's),
// the bench process holds only client code, and the daemon's build (Release, its own allocator
// state) is the one shipped.
//
// Threading: Start and the destructor on the main thread; Connect, RegisterEngine and NextKey from
// any thread.
#ifndef KVCELLAR_TESTS_BENCH_DATAPATH_BENCH_ENV_H_
#define KVCELLAR_TESTS_BENCH_DATAPATH_BENCH_ENV_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kvcellar_client.h"
#include "client/sim_engine.h"
#include "tests/bench/datapath/child_process.h"

namespace kvcellar::bench {

struct EnvOptions {
  std::string kvcellard;  // Path of the daemon binary.
  std::string self;       // Path of this benchmark binary (runs the no-op server).
  uint64_t pool_bytes = 1ull << 30;
  bool keep_dir = false;                // Keep the temp dir (logs) after the run.
  std::vector<std::string> extra_sets;  // More --set key=value for kvcellard.
  // Clients' per-RPC deadline. Above the library's 250 ms default: a submission that passes its
  // deadline makes the library replace the session (its outcome is unknown), which would end a
  // benchmark; slow submissions show up in the figures (and warmup_max_ms) instead.
  absl::Duration rpc_timeout = absl::Seconds(5);
};

// One engine rank on the sim device.
struct EngineSpec {
  std::string model;  // Namespace model id: one namespace per page-object geometry.
  uint32_t page_size = 16;
  bool opaque_keys = false;
  uint32_t layers = 2;
  uint64_t bytes_per_block = 1024;  // Per layer per K/V buffer.
  uint32_t blocks = 64;
  // ClientOptions::key_cache_bytes of the rank's client. 0 by default: a benchmark that matches
  // one prompt again and again must hash it every time, as an engine meeting it first would.
  size_t key_cache_bytes = 0;
};

// Destroy in member order reversed: the session closes (the daemon unmaps the engine memory)
// before the memory and the client go.
struct SimEngineRank {
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::SimEngine> sim;
  std::unique_ptr<client::Session> session;
};

class DatapathEnv {
 public:
  static absl::StatusOr<std::unique_ptr<DatapathEnv>> Start(EnvOptions options);
  ~DatapathEnv();

  const EnvOptions& options() const { return options_; }
  const std::string& daemon_socket() const { return daemon_socket_; }
  const std::string& noop_socket() const { return noop_socket_; }
  const std::string& dir() const { return dir_; }

  // A client of its own (its own channel and connection) to the daemon.
  absl::StatusOr<std::unique_ptr<client::Client>> Connect(size_t key_cache_bytes = 0) const;
  // A new sim KV cache registered under a fresh instance id, session active.
  absl::StatusOr<SimEngineRank> RegisterEngine(const EngineSpec& spec);
  // A fresh opaque page key (never returned before in this run).
  core::PageKey NextKey() { return KeyOf(next_key_.fetch_add(1)); }
  static core::PageKey KeyOf(uint64_t n);

  // Exit status of kvcellard at shutdown (wait(2) encoding); for the final report.
  int StopDaemon();

 private:
  explicit DatapathEnv(EnvOptions options) : options_(std::move(options)) {}

  EnvOptions options_;
  std::string dir_;
  std::string daemon_socket_;
  std::string noop_socket_;
  std::optional<ChildProcess> daemon_;
  std::optional<ChildProcess> noop_;
  std::atomic<uint64_t> next_instance_{0};
  std::atomic<uint64_t> next_key_{1};
};

// Waits until the op is terminal or `wait` passes (WaitOps, retried after transport errors).
client::OpResult WaitTerminal(client::Session& session, client::OpResult op, absl::Duration wait);
// Makes every page of `keys` (a chain from page 0) an L2 hit for `session`'s namespace: Backs
// them up from blocks 0.. (their bytes do not matter) unless they hit already, then pins them with
// a Match and keeps the pin alive, so that other benchmarks' Backups cannot evict them. Returns
// the pin id; Release it when done.
absl::StatusOr<uint64_t> CacheAndPin(client::Session& session,
                                     const std::vector<core::PageKey>& keys);
// first, first + 1, ..., first + n - 1.
std::vector<uint32_t> BlockRange(uint32_t first, size_t n);

// Token i of a prompt of `seed`: a pure function, as an engine's token ids would be.
std::vector<uint32_t> PromptTokens(uint64_t seed, size_t n);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_DATAPATH_BENCH_ENV_H_
