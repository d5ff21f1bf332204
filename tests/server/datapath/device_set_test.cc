// Tests server/datapath/device_set.h: which backend serves which DeviceKind, with one backend (the sim
// device alone, as `device: sim` runs) and with two (CUDA primary plus the host-memory sim).
#include "server/datapath/device_set.h"

#include <memory>

#include "gmock/gmock.h"
#include "gpu/sim_device.h"
#include "gtest/gtest.h"
#include "tests/gpu/sim_test_util.h"
#include "tests/server/fake_cuda_device.h"

namespace kvcellar::server {
namespace {

using ::testing::ElementsAre;
using testing::FakeCudaDevice;
using ::testing::HasSubstr;

TEST(DeviceSetTest, EmptyServesNothing) {
  DeviceSet none;
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.primary(), nullptr);
  EXPECT_EQ(none.primary_kind(), v1::DEVICE_KIND_UNSPECIFIED);
  EXPECT_EQ(none.For(v1::DEVICE_KIND_SIM), nullptr);
  EXPECT_EQ(none.For(v1::DEVICE_KIND_CUDA), nullptr);
  EXPECT_EQ(none.KindNames(), "none");
  EXPECT_TRUE(DeviceSet(nullptr).empty());
}

TEST(DeviceSetTest, SimAloneServesSim) {
  std::unique_ptr<gpu::SimDevice> sim = gpu::testing::OneThreadSimDevice();
  DeviceSet set(sim.get());
  EXPECT_EQ(set.primary(), sim.get());
  EXPECT_EQ(set.primary_kind(), v1::DEVICE_KIND_SIM);
  EXPECT_EQ(set.For(v1::DEVICE_KIND_SIM), sim.get());
  EXPECT_EQ(set.For(v1::DEVICE_KIND_CUDA), nullptr);
  EXPECT_EQ(set.For(v1::DEVICE_KIND_UNSPECIFIED), nullptr);
  EXPECT_THAT(set.kinds(), ElementsAre(v1::DEVICE_KIND_SIM));
  EXPECT_EQ(set.KindNames(), "DEVICE_KIND_SIM");
}

TEST(DeviceSetTest, CudaPrimaryWithHostMemorySimPicksByKind) {
  FakeCudaDevice cuda;
  std::unique_ptr<gpu::SimDevice> sim = gpu::testing::OneThreadSimDevice();
  DeviceSet set(&cuda);
  ASSERT_TRUE(set.Add(sim.get()).ok());
  EXPECT_EQ(set.primary(), &cuda);
  EXPECT_EQ(set.primary_kind(), v1::DEVICE_KIND_CUDA);
  EXPECT_EQ(set.For(v1::DEVICE_KIND_CUDA), &cuda);
  EXPECT_EQ(set.For(v1::DEVICE_KIND_SIM), sim.get());
  EXPECT_EQ(set.For(v1::DEVICE_KIND_UNSPECIFIED), nullptr);
  EXPECT_THAT(set.kinds(), ElementsAre(v1::DEVICE_KIND_CUDA, v1::DEVICE_KIND_SIM));
  EXPECT_EQ(set.KindNames(), "DEVICE_KIND_CUDA, DEVICE_KIND_SIM");
  // A copy (as CacheServiceOptions takes it) selects the same backends.
  DeviceSet copy = set;
  EXPECT_EQ(copy.For(v1::DEVICE_KIND_SIM), sim.get());
}

TEST(DeviceSetTest, OneBackendPerKind) {
  std::unique_ptr<gpu::SimDevice> a = gpu::testing::OneThreadSimDevice();
  std::unique_ptr<gpu::SimDevice> b = gpu::testing::OneThreadSimDevice();
  DeviceSet set(a.get());
  absl::Status s = set.Add(b.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("DEVICE_KIND_SIM is already served"));
  EXPECT_EQ(set.For(v1::DEVICE_KIND_SIM), a.get());  // The first stays.
  EXPECT_THAT(set.kinds(), ElementsAre(v1::DEVICE_KIND_SIM));
  EXPECT_EQ(set.Add(nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceSetTest, KindOfNamesTheBackend) {
  FakeCudaDevice cuda;
  std::unique_ptr<gpu::SimDevice> sim = gpu::testing::OneThreadSimDevice();
  EXPECT_EQ(KindOf(&cuda), v1::DEVICE_KIND_CUDA);
  EXPECT_EQ(KindOf(sim.get()), v1::DEVICE_KIND_SIM);
  EXPECT_EQ(KindOf(nullptr), v1::DEVICE_KIND_UNSPECIFIED);
}

}  // namespace
}  // namespace kvcellar::server
