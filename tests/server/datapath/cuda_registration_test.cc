// Tests the CUDA side of registration parsing (server/rpc/request_validation.h): per-layer Load
// events and ready events as IPC handles. No GPU is needed: parsing opens nothing; the CUDA
// device opens the handles at OpenEngine (gpu/cuda/cuda_device.cc, tested on a GPU).
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config/cache_limits.h"
#include "server/config/config.h"
#include "server/rpc/request_validation.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kLayers = 2;
constexpr uint64_t kBlockBytes = 4096;
constexpr uint32_t kBlocks = 16;

v1::RegisterEngineRequest CudaRegistration(uint32_t load_slots, uint32_t ready_slots) {
  v1::RegisterEngineRequest r;
  r.set_instance_id("gpu-engine");
  r.set_role(v1::SESSION_ROLE_WORKER);
  v1::NamespaceSpec* s = r.mutable_namespace_spec();
  s->set_tenant("t");
  s->set_model_id("m");
  s->set_model_revision("rev1");
  s->set_kv_dtype("bf16");
  s->set_page_size_tokens(16);
  s->set_layout_kind(v1::LAYOUT_KIND_MHA_GQA);
  s->set_tp_size(1);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  r.mutable_device()->set_uuid(std::string(16, '\x42'));
  v1::KvLayout* l = r.mutable_layout();
  v1::MemoryRegion* region = l->add_regions();
  region->set_cuda_ipc_handle(std::string(64, 'h'));
  region->set_offset_bytes(0);
  region->set_size_bytes(uint64_t{kLayers} * 2 * kBlocks * kBlockBytes);
  uint64_t offset = 0;
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    v1::LayerLayout* ll = l->add_layers();
    for (v1::BlockBuffer* b : {ll->mutable_k(), ll->mutable_v()}) {
      b->set_region(0);
      b->set_offset_bytes(offset);
      b->set_block_stride_bytes(kBlockBytes);
      b->set_bytes_per_block(kBlockBytes);
      offset += kBlocks * kBlockBytes;
    }
  }
  l->set_num_blocks(kBlocks);
  v1::CompletionChannel* c = r.mutable_completion();
  c->set_num_load_slots(load_slots);
  c->set_num_ready_slots(ready_slots);
  std::string load;
  for (uint32_t i = 0; i < load_slots * kLayers; ++i) load += std::string(64, 'a' + i);
  c->mutable_cuda_events()->set_load_event_handles(load);
  c->mutable_cuda_events()->set_ready_event_handles(std::string(64 * ready_slots, 'r'));
  return r;
}

TEST(CudaRegistrationTest, LoadEventsAreSplitSlotMajor) {
  const CacheLimits limits = CacheLimits::FromConfig(DefaultConfig());
  absl::StatusOr<Registration> reg =
      ParseRegistration(CudaRegistration(2, 1), limits, {v1::DEVICE_KIND_CUDA});
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_EQ(reg->engine.cuda_load_events.size(), 2u * kLayers);
  for (uint32_t i = 0; i < 2 * kLayers; ++i) {
    EXPECT_EQ(reg->engine.cuda_load_events[i], std::string(64, 'a' + i)) << i;
  }
  EXPECT_EQ(reg->num_load_slots, 2u);
  ASSERT_EQ(reg->cuda_ready_events.size(), 1u);
}

TEST(CudaRegistrationTest, WrongLoadEventBytesNameTheField) {
  const CacheLimits limits = CacheLimits::FromConfig(DefaultConfig());
  v1::RegisterEngineRequest r = CudaRegistration(2, 0);
  r.mutable_completion()->mutable_cuda_events()->set_load_event_handles(std::string(64 * 3, 'x'));
  absl::StatusOr<Registration> reg = ParseRegistration(r, limits, {v1::DEVICE_KIND_CUDA});
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reg.status().message()),
              HasSubstr("completion.cuda_events.load_event_handles is 192 bytes; expected "
                        "num_load_slots x layers x 64 = 256"));
}

TEST(CudaRegistrationTest, NoLoadSlotsNeedNoLoadEvents) {
  const CacheLimits limits = CacheLimits::FromConfig(DefaultConfig());
  absl::StatusOr<Registration> reg =
      ParseRegistration(CudaRegistration(0, 2), limits, {v1::DEVICE_KIND_CUDA});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(reg->engine.cuda_load_events.empty());
}

TEST(CudaRegistrationTest, KindMustBeOneTheDaemonServes) {
  const CacheLimits limits = CacheLimits::FromConfig(DefaultConfig());
  // A CUDA daemon that also serves host-memory (SIM) engines takes CUDA registrations.
  absl::StatusOr<Registration> reg = ParseRegistration(CudaRegistration(0, 0), limits,
                                                       {v1::DEVICE_KIND_CUDA, v1::DEVICE_KIND_SIM});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->device_kind, v1::DEVICE_KIND_CUDA);
  // A sim-only daemon refuses them and says what it serves.
  reg = ParseRegistration(CudaRegistration(0, 0), limits, {v1::DEVICE_KIND_SIM});
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(reg.status().message()),
              HasSubstr("device.kind DEVICE_KIND_CUDA is not served: this daemon serves "
                        "DEVICE_KIND_SIM"));
  reg = ParseRegistration(CudaRegistration(0, 0), limits, {});
  ASSERT_FALSE(reg.ok());
  EXPECT_THAT(std::string(reg.status().message()), HasSubstr("serves no device backend"));
}

}  // namespace
}  // namespace kvcellar::server
