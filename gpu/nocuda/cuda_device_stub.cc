// The CUDA backend in a build without CUDA (KVCELLAR_CUDA=OFF or no nvcc): every entry point
// says so, and the factory's "auto" falls back to the sim device.
#include "gpu/cuda/cuda_device.h"

namespace kvcellar::gpu {
namespace {

absl::Status NotCompiled() {
  return absl::UnimplementedError(
      "CUDA support not compiled in (configure with -DKVCELLAR_CUDA=ON and nvcc installed)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaDevice(const CudaDeviceOptions&) {
  return NotCompiled();
}

absl::StatusOr<int> CudaDeviceCount() { return NotCompiled(); }

}  // namespace kvcellar::gpu
