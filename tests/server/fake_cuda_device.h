// A DeviceBackend named "cuda" that maps nothing: stands in for the CUDA device on machines
// without a GPU, so tests can check which backend a session's calls reach.
#ifndef KVCELLAR_TESTS_SERVER_FAKE_CUDA_DEVICE_H_
#define KVCELLAR_TESTS_SERVER_FAKE_CUDA_DEVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device_backend.h"

namespace kvcellar::server::testing {

class FakeCudaDevice final : public gpu::DeviceBackend {
 public:
  static constexpr char kOpenError[] = "fake cuda device: no GPU here";

  absl::string_view name() const override { return "cuda"; }
  std::vector<std::string> DeviceUuids() const override { return {}; }
  absl::StatusOr<std::unique_ptr<gpu::EngineMapping>> OpenEngine(
      const gpu::EngineSpec& spec) override {
    open_calls.fetch_add(1);
    return absl::UnavailableError(kOpenError);
  }
  absl::StatusOr<gpu::OpHandle> SubmitGather(gpu::EngineMapping& engine,
                                             absl::Span<const gpu::CopyItem> items,
                                             const gpu::ReadyFence& fence,
                                             gpu::OpSignal signal) override {
    return absl::UnimplementedError("fake cuda device");
  }
  absl::StatusOr<gpu::OpHandle> SubmitScatter(gpu::EngineMapping& engine,
                                              absl::Span<const gpu::CopyItem> items,
                                              gpu::OpSignal signal) override {
    return absl::UnimplementedError("fake cuda device");
  }
  absl::Status RegisterHostMemory(void* addr, size_t bytes) override { return absl::OkStatus(); }
  absl::Status UnregisterHostMemory(void* addr) override { return absl::OkStatus(); }

  std::atomic<int> open_calls{0};
};

}  // namespace kvcellar::server::testing

#endif  // KVCELLAR_TESTS_SERVER_FAKE_CUDA_DEVICE_H_
