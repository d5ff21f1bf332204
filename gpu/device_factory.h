// Chooses the DeviceBackend at daemon start: `device: auto | cuda | sim` in kvcellard.yaml.
//
// auto picks CUDA when the build has it and a device is visible, the sim device otherwise, and
// logs which and why. cuda fails rather than fall back: an operator who asked for GPUs wants to
// know they are missing.
#ifndef KVCELLAR_GPU_DEVICE_FACTORY_H_
#define KVCELLAR_GPU_DEVICE_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/device_backend.h"
#include "gpu/sim_device.h"

namespace kvcellar::gpu {

enum class DeviceKind { kAuto, kCuda, kSim };

// "auto", "cuda" or "sim" (any case); INVALID_ARGUMENT otherwise.
absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view name);
absl::string_view DeviceKindName(DeviceKind kind);

struct DeviceBackendOptions {
  DeviceKind kind = DeviceKind::kAuto;
  SimDevice::Options sim;
  CudaDeviceOptions cuda;
};

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateDeviceBackend(
    const DeviceBackendOptions& options);

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_DEVICE_FACTORY_H_
