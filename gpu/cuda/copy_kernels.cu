#include <cstdint>

#include "gpu/cuda/copy_kernels.h"

namespace kvcellar::gpu::cuda {
namespace {

// 256 threads x 16 bytes x kUnroll in flight per block: enough outstanding loads to cover PCIe
// latency (~1-2 us) when one side is host memory.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <uint32_t kCap>
struct CopyBatch {
  uint32_t n;
  CopyRun runs[kCap];
};

__device__ void CopyOne(const CopyRun& run) {
  const uint8_t* src = static_cast<const uint8_t*>(run.src);
  uint8_t* dst = static_cast<uint8_t*>(run.dst);
  uint64_t bytes = run.bytes;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint64_t n16 = bytes >> 4;
    const uint64_t step = uint64_t{kThreads} * kUnroll;
    uint64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < n16; i += step) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * kThreads] = v[u];
    }
    for (; i < n16; i += kThreads) d[i] = s[i];
    src += n16 << 4;
    dst += n16 << 4;
    bytes &= 15;
  }
  for (uint64_t i = threadIdx.x; i < bytes; i += kThreads) dst[i] = src[i];
}

template <uint32_t kCap>
__global__ void __launch_bounds__(kThreads)
    CopyRunsKernel(const __grid_constant__ CopyBatch<kCap> batch) {
  for (uint32_t r = blockIdx.x; r < batch.n; r += gridDim.x) CopyOne(batch.runs[r]);
}

__global__ void StoreTicketKernel(unsigned long long* word, unsigned long long value) {
  // Stream order already put every earlier copy before this kernel; the fence orders this
  // store after them for observers outside the GPU.
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(word) = value;
  __threadfence_system();
}

__global__ void StoreFailureKernel(unsigned long long* layers, uint32_t num_layers,
                                   unsigned long long layer_value, unsigned long long* op,
                                   unsigned long long op_value) {
  __threadfence_system();
  volatile unsigned long long* l = layers;
  for (uint32_t i = 0; i < num_layers; ++i) l[i] = layer_value;
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(op) = op_value;
  __threadfence_system();
}

template <uint32_t kCap>
cudaError_t Launch(const CopyRun* runs, uint32_t n, uint32_t max_blocks, cudaStream_t stream) {
  CopyBatch<kCap> batch;
  batch.n = n;
  for (uint32_t i = 0; i < n; ++i) batch.runs[i] = runs[i];
  const uint32_t blocks = n < max_blocks ? n : max_blocks;
  CopyRunsKernel<kCap><<<blocks, kThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopyRuns(const CopyRun* runs, uint32_t n, uint32_t max_blocks,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n > kMaxRunsPerLaunch || max_blocks == 0) return cudaErrorInvalidValue;
  // Small batches pass small parameter blocks: launch cost grows with parameter size.
  if (n <= 16) return Launch<16>(runs, n, max_blocks, stream);
  if (n <= 128) return Launch<128>(runs, n, max_blocks, stream);
  return Launch<kMaxRunsPerLaunch>(runs, n, max_blocks, stream);
}

cudaError_t LaunchStoreTicket(uint64_t* word, uint64_t value, cudaStream_t stream) {
  StoreTicketKernel<<<1, 1, 0, stream>>>(reinterpret_cast<unsigned long long*>(word), value);
  return cudaGetLastError();
}

cudaError_t LaunchStoreFailure(uint64_t* first_layer_word, uint32_t num_layers,
                               uint64_t layer_value, uint64_t* op_word, uint64_t op_value,
                               cudaStream_t stream) {
  using U = unsigned long long;
  StoreFailureKernel<<<1, 1, 0, stream>>>(reinterpret_cast<U*>(first_layer_word), num_layers,
                                          layer_value, reinterpret_cast<U*>(op_word), op_value);
  return cudaGetLastError();
}

cudaError_t LoadKernels() {
  cudaFuncAttributes attr;
  for (const void* kernel : {reinterpret_cast<const void*>(&CopyRunsKernel<16>),
                             reinterpret_cast<const void*>(&CopyRunsKernel<128>),
                             reinterpret_cast<const void*>(&CopyRunsKernel<kMaxRunsPerLaunch>),
                             reinterpret_cast<const void*>(&StoreTicketKernel),
                             reinterpret_cast<const void*>(&StoreFailureKernel)}) {
    if (cudaError_t err = cudaFuncGetAttributes(&attr, kernel); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace kvcellar::gpu::cuda
