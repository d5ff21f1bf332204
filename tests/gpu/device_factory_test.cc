#include "gpu/device_factory.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::gpu {
namespace {

TEST(DeviceFactoryTest, ParsesKinds) {
  EXPECT_EQ(*ParseDeviceKind("auto"), DeviceKind::kAuto);
  EXPECT_EQ(*ParseDeviceKind("CUDA"), DeviceKind::kCuda);
  EXPECT_EQ(*ParseDeviceKind("sim"), DeviceKind::kSim);
  absl::StatusOr<DeviceKind> bad = ParseDeviceKind("rocm");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("rocm"));
  EXPECT_EQ(DeviceKindName(DeviceKind::kSim), "sim");
}

TEST(DeviceFactoryTest, SimIsAlwaysAvailable) {
  DeviceBackendOptions o;
  o.kind = DeviceKind::kSim;
  absl::StatusOr<std::unique_ptr<DeviceBackend>> d = CreateDeviceBackend(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->name(), "sim");
}

TEST(DeviceFactoryTest, AutoPicksCudaOnlyWithADevice) {
  absl::StatusOr<int> count = CudaDeviceCount();
  DeviceBackendOptions o;
  absl::StatusOr<std::unique_ptr<DeviceBackend>> d = CreateDeviceBackend(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->name(), count.ok() && *count > 0 ? "cuda" : "sim");
}

TEST(DeviceFactoryTest, CudaWithoutCudaIsAnError) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (count.ok() && *count > 0) GTEST_SKIP() << "a CUDA device is present";
  DeviceBackendOptions o;
  o.kind = DeviceKind::kCuda;
  absl::StatusOr<std::unique_ptr<DeviceBackend>> d = CreateDeviceBackend(o);
  EXPECT_FALSE(d.ok());
#if KVCELLAR_HAVE_CUDA
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable) << d.status();
#else
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(d.status().message()),
              ::testing::HasSubstr("CUDA support not compiled in"));
#endif
}

}  // namespace
}  // namespace kvcellar::gpu
