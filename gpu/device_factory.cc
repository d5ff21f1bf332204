#include "gpu/device_factory.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "platform/log.h"

namespace kvcellar::gpu {

absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "auto") return DeviceKind::kAuto;
  if (n == "cuda") return DeviceKind::kCuda;
  if (n == "sim") return DeviceKind::kSim;
  return absl::InvalidArgumentError(
      absl::StrCat("device \"", name, "\": expected auto, cuda or sim"));
}

absl::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCuda:
      return "cuda";
    case DeviceKind::kSim:
      return "sim";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateDeviceBackend(
    const DeviceBackendOptions& options) {
  switch (options.kind) {
    case DeviceKind::kCuda:
      return CreateCudaDevice(options.cuda);
    case DeviceKind::kSim: {
      absl::StatusOr<std::unique_ptr<SimDevice>> sim = SimDevice::Create(options.sim);
      if (!sim.ok()) return sim.status();
      return std::unique_ptr<DeviceBackend>(*std::move(sim));
    }
    case DeviceKind::kAuto:
      break;
  }
  absl::StatusOr<int> count = CudaDeviceCount();
  if (count.ok() && *count > 0) {
    absl::StatusOr<std::unique_ptr<DeviceBackend>> cuda = CreateCudaDevice(options.cuda);
    if (cuda.ok()) return cuda;
    count = cuda.status();
  }
  const std::string reason =
      count.ok() ? std::string("no CUDA device visible") : std::string(count.status().message());
  KVLOG(Warn, "device auto: using the sim device", {{"reason", reason}});
  absl::StatusOr<std::unique_ptr<SimDevice>> sim = SimDevice::Create(options.sim);
  if (!sim.ok()) return sim.status();
  return std::unique_ptr<DeviceBackend>(*std::move(sim));
}

}  // namespace kvcellar::gpu
