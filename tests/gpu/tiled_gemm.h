// A compute-bound stand-in for an engine's forward pass: C = A x B in float32 with a shared-memory
// tiled kernel of our own (no cuBLAS: the benchmark binary needs only the driver at run time).
//
// It occupies every SM with long-running thread blocks, so it slows down when the daemon's copy
// kernel takes SMs from it, and much less when copies run on the copy engines: the interference
// the CUDA benchmark reports per copy path. It is not meant to be fast: about 10-20% of an H100's
// float32 peak.
#ifndef KVCELLAR_TESTS_GPU_TILED_GEMM_H_
#define KVCELLAR_TESTS_GPU_TILED_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvcellar::gpu::testing {

// Matrices are n x n, row-major; n must be a positive multiple of kGemmTile.
inline constexpr int kGemmTile = 128;

cudaError_t LaunchTiledGemm(const float* a, const float* b, float* c, int n, cudaStream_t stream);

// Fills p[0..count) with values in [-1, 1) drawn from `seed` (never all zeros: zeros can run
// faster than real data).
cudaError_t LaunchFillUniform(float* p, size_t count, uint32_t seed, cudaStream_t stream);

}  // namespace kvcellar::gpu::testing

#endif  // KVCELLAR_TESTS_GPU_TILED_GEMM_H_
