// Fuzz target: RegisterEngineRequest bytes as an engine sends them, through ParseRegistration
// (server/rpc/request_validation.h): identity, namespace spec, device, KV layout, completion
// channel. A refusal must name its field; an accepted registration must hold what the daemon
// then relies on without checking again (a valid spec and layout, one event per slot).
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/config/cache_limits.h"
#include "server/config/config.h"
#include "server/rpc/request_validation.h"
#include "tests/fuzz/fuzz_util.h"

using kvcellar::fuzz::CheckRefusal;
namespace server = kvcellar::server;
namespace v1 = kvcellar::v1;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcellar::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::RegisterEngineRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;  // gRPC refuses it first.

  static const server::CacheLimits limits =
      server::CacheLimits::FromConfig(server::DefaultConfig());
  // A daemon serving both kinds reaches every branch; DEVICE_UNAVAILABLE has its own unit test.
  static constexpr v1::DeviceKind kServed[] = {v1::DEVICE_KIND_SIM, v1::DEVICE_KIND_CUDA};
  absl::StatusOr<server::Registration> reg = server::ParseRegistration(request, limits, kServed);
  if (!reg.ok()) {
    CheckRefusal(reg.status());
    return 0;
  }

  FUZZ_CHECK(reg->spec.Validate().ok());
  FUZZ_CHECK(reg->spec.ShardsPerPage() >= 1);
  (void)reg->spec.Digest();
  if (!reg->worker) return 0;
  const kvcellar::core::KvLayout& layout = reg->engine.layout;
  FUZZ_CHECK(layout.Validate().ok());
  FUZZ_CHECK(layout.num_blocks > 0);
  FUZZ_CHECK(layout.layers.size() <= limits.max_layers);
  FUZZ_CHECK(layout.regions.size() <= limits.max_regions);
  FUZZ_CHECK(request.rank() < reg->spec.tp_size);
  FUZZ_CHECK(reg->num_load_slots <= limits.max_completion_slots);
  FUZZ_CHECK(reg->num_ready_slots <= limits.max_completion_slots);
  if (reg->device_kind == v1::DEVICE_KIND_CUDA) {
    FUZZ_CHECK(reg->cuda_ready_events.size() == reg->num_ready_slots);
    FUZZ_CHECK(reg->engine.cuda_load_events.size() ==
               static_cast<size_t>(reg->num_load_slots) * layout.layers.size());
  }
  return 0;
}
