#include "tests/gpu/tiled_gemm.h"

#include <algorithm>
#include <cstdint>

namespace kvcellar::gpu::testing {
namespace {

// A 128 x 128 tile of C per thread block, 8 x 8 of it per thread (16 x 16 threads), stepping
// through K 8 columns at a time. The A slice is stored transposed in shared memory so that the
// inner loop reads both operands along the tile's rows.
constexpr int kTile = kGemmTile;
constexpr int kStep = 8;
constexpr int kPerThread = 8;
constexpr int kThreads = (kTile / kPerThread) * (kTile / kPerThread);  // 256.
static_assert(kTile * kStep == kThreads * 4, "each thread loads one float4 of A and one of B");

__global__ void __launch_bounds__(kThreads)
    TiledGemmKernel(const float* __restrict__ a, const float* __restrict__ b,
                    float* __restrict__ c, int n) {
  // 16-byte aligned: bs takes float4 stores, and a float array's own alignment is only 4.
  __shared__ __align__(16) float as[kStep][kTile];  // as[k][m] = A[row0 + m][k0 + k].
  __shared__ __align__(16) float bs[kStep][kTile];  // bs[k][j] = B[k0 + k][col0 + j].
  const int t = threadIdx.x;
  const int tx = t % (kTile / kPerThread);
  const int ty = t / (kTile / kPerThread);
  const size_t row0 = size_t{blockIdx.y} * kTile;
  const size_t col0 = size_t{blockIdx.x} * kTile;
  // Which float4 this thread loads: A's tile is kTile rows of kStep floats (2 float4 a row), B's
  // is kStep rows of kTile floats (32 float4 a row).
  const int a_row = t / 2;
  const int a_col = (t % 2) * 4;
  const int b_row = t / (kTile / 4);
  const int b_col = (t % (kTile / 4)) * 4;

  float acc[kPerThread][kPerThread] = {};
  for (int k0 = 0; k0 < n; k0 += kStep) {
    const float4 av =
        *reinterpret_cast<const float4*>(a + (row0 + a_row) * size_t(n) + k0 + a_col);
    as[a_col + 0][a_row] = av.x;
    as[a_col + 1][a_row] = av.y;
    as[a_col + 2][a_row] = av.z;
    as[a_col + 3][a_row] = av.w;
    *reinterpret_cast<float4*>(&bs[b_row][b_col]) =
        *reinterpret_cast<const float4*>(b + (size_t(k0) + b_row) * n + col0 + b_col);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kStep; ++k) {
      float ra[kPerThread], rb[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) ra[i] = as[k][ty * kPerThread + i];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) rb[j] = bs[k][tx * kPerThread + j];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) acc[i][j] += ra[i] * rb[j];
      }
    }
    __syncthreads();  // The next step overwrites the tiles.
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    float* out = c + (row0 + ty * kPerThread + i) * size_t(n) + col0 + tx * kPerThread;
#pragma unroll
    for (int j = 0; j < kPerThread; j += 4) {
      *reinterpret_cast<float4*>(out + j) =
          make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
    }
  }
}

__global__ void FillUniformKernel(float* p, size_t count, uint32_t seed) {
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += size_t{gridDim.x} * blockDim.x) {
    uint64_t x = (uint64_t{seed} << 32) ^ i;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    // 24 random bits -> [-1, 1).
    p[i] = static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
}

}  // namespace

cudaError_t LaunchTiledGemm(const float* a, const float* b, float* c, int n, cudaStream_t stream) {
  if (n <= 0 || n % kTile != 0) return cudaErrorInvalidValue;
  const dim3 grid(n / kTile, n / kTile);
  TiledGemmKernel<<<grid, kThreads, 0, stream>>>(a, b, c, n);
  return cudaGetLastError();
}

cudaError_t LaunchFillUniform(float* p, size_t count, uint32_t seed, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kFillThreads = 256;
  constexpr size_t kMaxFillBlocks = 4096;
  const size_t blocks = std::min(kMaxFillBlocks, (count + kFillThreads - 1) / kFillThreads);
  FillUniformKernel<<<static_cast<unsigned>(blocks), kFillThreads, 0, stream>>>(p, count, seed);
  return cudaGetLastError();
}

}  // namespace kvcellar::gpu::testing
