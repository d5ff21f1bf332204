// Device code of the CUDA backend: the copy kernel for many small runs and the one-thread kernels
// that store op ids into the engine's (host-mapped) signal region (core/signal_layout.h).
//
// Callable from host code compiled by the C++ compiler; the kernels live in copy_kernels.cu.
#ifndef KVCELLAR_GPU_CUDA_COPY_KERNELS_H_
#define KVCELLAR_GPU_CUDA_COPY_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvcellar::gpu::cuda {

// One contiguous copy. Either side may be device memory or registered, mapped host memory (given
// by its device-side address).
struct CopyRun {
  const void* src;
  void* dst;
  uint64_t bytes;
};

// Runs per launch. Descriptors travel as kernel parameters (no staging buffer whose lifetime
// would have to outlast the launch): 8 + 24 * 1024 bytes, inside the 32764-byte parameter limit
// that CUDA 12.1+ gives Volta and newer.
inline constexpr uint32_t kMaxRunsPerLaunch = 1024;

// Copies runs[0..n) (n <= kMaxRunsPerLaunch) on `stream`: one thread block per run, at most
// `max_blocks` blocks, 16-byte accesses when both sides are 16-byte aligned.
cudaError_t LaunchCopyRuns(const CopyRun* runs, uint32_t n, uint32_t max_blocks,
                           cudaStream_t stream);

// Stores `value` into the 8-byte word at `word` (device-side address of host-mapped memory)
// after everything before it on `stream`, visible system-wide.
cudaError_t LaunchStoreTicket(uint64_t* word, uint64_t value, cudaStream_t stream);

// How a failed op ends on one load slot (device-side addresses of its words): `layer_value` into
// each of the `num_layers` words from `first_layer_word` on, then `op_value` into the op word,
// each fenced system-wide, so no waiter of a layer blocks and the op word says it failed.
cudaError_t LaunchStoreFailure(uint64_t* first_layer_word, uint32_t num_layers,
                               uint64_t layer_value, uint64_t* op_word, uint64_t op_value,
                               cudaStream_t stream);

// Loads every kernel above into the current device's context. With CUDA's lazy loading (the
// default since 12.2) a kernel is otherwise loaded at its first launch, and loading may
// synchronize the context: a first Backup enqueued behind an engine's ready event would then hold
// its RPC until the engine's forward pass ends (seen on an H200). Called for each engine's device
// before any op is enqueued there; cheap once loaded.
cudaError_t LoadKernels();

}  // namespace kvcellar::gpu::cuda

#endif  // KVCELLAR_GPU_CUDA_COPY_KERNELS_H_
