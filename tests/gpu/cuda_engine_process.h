// CudaEngineProcess: a CUDA "engine" in a process of its own, for tests and benchmarks of the CUDA
// device. CUDA IPC handles can only be opened by another process than the one that exported them,
// so the daemon side (the test, the benchmark) re-executes its own binary as the engine and drives
// it over two pipes with one-line text commands.
//
// The engine process owns what an inference engine would: a layer-first KV pool in one cudaMalloc
// (LayerFirstLayout), exported with cudaIpcGetMemHandle; interprocess events for Load signals and
// Backup readiness (each recorded once at start, so that a wait on one completes: "the forward
// pass is done"); and, for interference measurements, a compute-bound matrix multiply
// (tests/gpu/tiled_gemm.h) it times with CUDA events while the daemon copies.
//
// Protocol (parent -> engine, one line each; the engine answers "ok ..." or "err <why>"):
//   alloc LAYERS BYTES_PER_BLOCK BLOCKS SEED  frees the previous pool, allocates a new one and
//                                             fills block b of (layer, buffer) with SEED's
//                                             pattern (tests/gpu/sim_test_util.h); answers the
//                                             pool's 64-byte IPC handle in hex
//   check DST SRC N SEED                      blocks DST..DST+N-1 hold the pattern of blocks
//                                             SRC..SRC+N-1 in every layer and buffer
//   gemm N MILLIS                             C = A x B (N x N, float) back to back for about
//                                             MILLIS ms; answers "ok COUNT MEDIAN_MS MEAN_MS".
//                                             The first call also checks C against a float64
//                                             reference on sampled elements
//   free                                      frees the pool
// At start the engine writes one line: "hello GPU_UUID READY_HEX LOAD_HEX" (its GPU, then the
// concatenated 64-byte handles of kReadySlots ready events and kLoadSlots x kEventLayers load
// events, slot-major). EOF on its command pipe ends it; it frees everything first.
//
// The parent must close every mapping of a pool (the daemon's cudaIpcCloseMemHandle) before it
// asks for the next alloc, a free, or ends the engine.
//
// Threading: a CudaEngineProcess is used by one thread at a time.
#ifndef KVCELLAR_TESTS_GPU_CUDA_ENGINE_PROCESS_H_
#define KVCELLAR_TESTS_GPU_CUDA_ENGINE_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/kv_layout.h"

namespace kvcellar::gpu::testing {

// Events the engine creates: enough load slots for a Load in flight while the next is submitted,
// and layers for the largest model the benchmarks use (80, Llama 70B) with room to spare.
inline constexpr uint32_t kLoadSlots = 2;
inline constexpr uint32_t kEventLayers = 128;
inline constexpr uint32_t kReadySlots = 2;
// The environment variable naming the engine's command and reply fds ("IN,OUT").
inline constexpr char kEngineFdsEnv[] = "KVCELLAR_CUDA_ENGINE_FDS";

// The KV pool an engine allocates: per layer a K then a V buffer of `blocks` blocks, layers one
// after another in one allocation (vLLM's layer-first layout; one region per layer).
struct PoolShape {
  uint32_t layers = 0;
  uint64_t bytes_per_block = 0;  // Per layer per K/V buffer: what one per-block copy moves.
  uint32_t blocks = 0;

  uint64_t object_bytes() const { return 2ull * layers * bytes_per_block; }
  uint64_t pool_bytes() const { return object_bytes() * blocks; }
  bool operator==(const PoolShape& o) const {
    return layers == o.layers && bytes_per_block == o.bytes_per_block && blocks == o.blocks;
  }
};

// The layout the daemon registers for a pool of `shape` exported as `mem_handle`.
core::KvLayout LayerFirstLayout(const std::string& mem_handle, const PoolShape& shape);
// Byte offset of block `block` of (layer, buffer) in that pool.
uint64_t LayerFirstOffset(const PoolShape& shape, uint32_t layer, uint32_t buffer,
                          uint32_t block);

struct GemmTiming {
  int count = 0;
  double median_ms = 0;
  double mean_ms = 0;
};

class CudaEngineProcess {
 public:
  // Starts `argv` (argv[0] a path: this binary, with whatever arguments make it call
  // MaybeRunCudaEngineProcess) and reads its hello line. Sets SIGPIPE to SIG_IGN in this process
  // if it was SIG_DFL, so that a command to a dead engine fails instead of killing the caller.
  static absl::StatusOr<std::unique_ptr<CudaEngineProcess>> Spawn(
      const std::vector<std::string>& argv, absl::Duration start_timeout = absl::Seconds(60));
  ~CudaEngineProcess();  // Finish(), bounded.
  CudaEngineProcess(const CudaEngineProcess&) = delete;
  CudaEngineProcess& operator=(const CudaEngineProcess&) = delete;

  const std::string& device_uuid() const { return device_uuid_; }  // "GPU-xxxxxxxx-...".
  // The 64-byte handle of ready event `slot`.
  std::string ready_event(uint32_t slot) const;
  // The handles of load events (slot, layer) for slot < slots and layer < layers, slot-major: what
  // EngineSpec::cuda_load_events and the RegisterEngine completion channel take.
  std::vector<std::string> load_events(uint32_t slots, uint32_t layers) const;

  // Allocates a pool of `shape` filled with `seed`'s pattern; returns its layout. The shape of
  // the current pool, if any.
  absl::StatusOr<core::KvLayout> Alloc(const PoolShape& shape, uint32_t seed);
  const std::optional<PoolShape>& shape() const { return shape_; }
  absl::Status Free();
  // Blocks dst..dst+n-1 hold the pattern of blocks src..src+n-1 under `seed`.
  absl::Status Check(uint32_t dst, uint32_t src, uint32_t n, uint32_t seed);
  // Runs GEMMs for about `millis` ms and waits for the answer.
  absl::StatusOr<GemmTiming> Gemm(int n, int millis);
  // The same in two halves, so that the caller can work while the engine computes:
  // StartGemm sends the command; GemmDone() says whether the answer has arrived (never blocks);
  // FinishGemm reads it (blocking).
  absl::Status StartGemm(int n, int millis);
  bool GemmDone();
  absl::StatusOr<GemmTiming> FinishGemm();

  // Closes the command pipe and waits for the engine to exit (SIGKILL after `grace`); its wait
  // status, or -1 when it was not running. Idempotent. A command whose answer does not come in
  // time, or finds the engine gone, ends it this way too: a late answer could no longer be told
  // from the next command's.
  int Finish(absl::Duration grace = absl::Seconds(30));
  // Whether the engine process is still there to take commands.
  bool running() const { return pid_ > 0; }

 private:
  CudaEngineProcess() = default;
  absl::Status Send(const std::string& line);
  // The next reply line; its text after "ok" (and a space), or the engine's error.
  absl::StatusOr<std::string> Reply(absl::Duration timeout);

  pid_t pid_ = -1;
  int to_engine_ = -1;
  int from_engine_ = -1;
  std::string buffer_;  // Bytes read past the last line.
  std::string device_uuid_;
  std::string ready_handles_;
  std::string load_handles_;
  std::optional<PoolShape> shape_;
};

// The engine's side. When kEngineFdsEnv is set, runs the engine on those fds until EOF and
// returns its exit code (0 when every command it was given could be carried out or answered);
// otherwise nullopt, and the caller goes on as itself.
std::optional<int> MaybeRunCudaEngineProcess();

}  // namespace kvcellar::gpu::testing

#endif  // KVCELLAR_TESTS_GPU_CUDA_ENGINE_PROCESS_H_
