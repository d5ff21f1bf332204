// CudaBenchEnv: what every kvcellar_bench_cuda case runs against. Engine processes (this binary
// re-executed: tests/gpu/cuda_engine_process.h), each with a layer-first KV pool exported by CUDA
// IPC; the daemon's CUDA backend in this process, one instance per copy-path configuration, each
// with its own pinned, registered host pages (as the daemon's host pool is); and, for the
// end-to-end cases, a real kvcellard child process on the CUDA device with the engines registered
// through libkvcellar-client.
//
// Engines, backends and the daemon start on first use, so a filtered run starts only what it
// needs. Asking for an engine with another pool shape first closes every mapping and session of
// that engine (the daemon's cudaIpcCloseMemHandle must come before the engine's cudaFree).
//
// Threading: everything but Keys() runs on the benchmark's main thread. The objects it hands out
// (mappings, backends, sessions) may then be used by several threads at once, as the daemon does.
#ifndef KVCELLAR_TESTS_BENCH_CUDA_CUDA_BENCH_ENV_H_
#define KVCELLAR_TESTS_BENCH_CUDA_CUDA_BENCH_ENV_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kvcellar_client.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/device_backend.h"
#include "tests/bench/datapath/child_process.h"
#include "tests/gpu/cuda_engine_process.h"

namespace kvcellar::bench {

// The pattern seed every engine pool is filled with.
inline constexpr uint32_t kPoolSeed = 11;

struct CudaEnvOptions {
  std::string self;       // This binary: re-executed as the engine processes.
  std::string kvcellard;  // The daemon binary, for the end-to-end cases.
  // kvcellard's pinned pool: a multiple of its 512 MiB regions, one region at least for each of
  // the ten page object sizes the copy cases use, and room for 8 engines' batches.
  uint64_t daemon_pool_bytes = 8ull << 30;
  bool keep_dir = false;  // Keep the temp dir (kvcellard.log) after the run.
};

// One configuration of the daemon's CUDA backend (CudaDeviceOptions).
struct BackendKey {
  gpu::CudaDeviceOptions::CopyPath path = gpu::CudaDeviceOptions::CopyPath::kAuto;
  uint32_t kernel_blocks = 32;  // CudaDeviceOptions::kernel_max_blocks.

  // "copy engine", "kernel x32", "auto".
  std::string Name() const;
  bool operator<(const BackendKey& o) const {
    return path != o.path ? path < o.path : kernel_blocks < o.kernel_blocks;
  }
};

// A backend instance and its registered host pages.
struct Backend {
  BackendKey key;
  std::unique_ptr<gpu::DeviceBackend> device;
  uint8_t* host = nullptr;  // Pinned (cudaHostRegister through the backend) and faulted in.
  uint64_t host_bytes = 0;
  std::map<int, std::unique_ptr<gpu::EngineMapping>> mappings;  // By engine index.
};

// Engine i registered with kvcellard: destroy the session before the client.
struct DaemonEngine {
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
};

class CudaBenchEnv {
 public:
  explicit CudaBenchEnv(CudaEnvOptions options) : options_(std::move(options)) {}
  ~CudaBenchEnv();  // Sessions, mappings and backends, then engines, then the daemon.
  CudaBenchEnv(const CudaBenchEnv&) = delete;
  CudaBenchEnv& operator=(const CudaBenchEnv&) = delete;

  // Engine `i` (started on first use) holding a pool of `shape` filled with kPoolSeed's pattern.
  absl::StatusOr<gpu::testing::CudaEngineProcess*> Engine(int i,
                                                          const gpu::testing::PoolShape& shape);
  // The backend for `key`, with at least `host_bytes` of registered host pages.
  absl::StatusOr<Backend*> GetBackend(const BackendKey& key, uint64_t host_bytes);
  // Engine i's current pool opened by `backend`, with the engine's per-layer load events.
  absl::StatusOr<gpu::EngineMapping*> Mapping(Backend* backend, int i);
  // Engine i's current pool registered with kvcellard (started on first use) as a CUDA engine
  // with a completion channel of kLoadSlots load and kReadySlots ready slots.
  absl::StatusOr<client::Session*> Session(int i);

  // Fresh opaque page keys, never returned before in this run.
  std::vector<core::PageKey> Keys(size_t n);

 private:
  // Ends every use of engine i's pool: its mappings in every backend and its daemon session.
  void ReleaseEngine(int i);
  absl::Status StartDaemon();

  const CudaEnvOptions options_;
  std::vector<std::unique_ptr<gpu::testing::CudaEngineProcess>> engines_;
  std::vector<core::KvLayout> layouts_;  // Of engines_[i]'s current pool.
  std::map<BackendKey, std::unique_ptr<Backend>> backends_;
  std::map<int, DaemonEngine> daemon_engines_;
  std::string dir_;
  std::string daemon_socket_;
  std::optional<ChildProcess> daemon_;
  std::atomic<uint64_t> next_key_{1};
  uint64_t next_instance_ = 0;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_CUDA_CUDA_BENCH_ENV_H_
