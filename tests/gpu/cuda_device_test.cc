// The CUDA device. Without a CUDA build these tests check the "not compiled in" answer; without a
// GPU they skip. With one, a second process (this binary, re-executed as the engine:
// tests/gpu/cuda_engine_process.h) exports a KV cache through CUDA IPC and the daemon side
// gathers and scatters it over both copy paths.
#include "gpu/cuda/cuda_device.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if KVCELLAR_HAVE_CUDA
#include <stdlib.h>
#include <sys/wait.h>

#include <cstring>
#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "platform/signal_region.h"
#include "platform/sim_engine_memory.h"
#include "tests/gpu/cuda_engine_process.h"
#include "tests/gpu/sim_test_util.h"
#endif

namespace kvcellar::gpu {
namespace {

TEST(CudaDeviceTest, CreateAgreesWithDeviceCount) {
  absl::StatusOr<int> count = CudaDeviceCount();
#if !KVCELLAR_HAVE_CUDA
  EXPECT_EQ(count.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(CreateCudaDevice({}).status().code(), absl::StatusCode::kUnimplemented);
#else
  if (!count.ok() || *count == 0) {
    EXPECT_EQ(CreateCudaDevice({}).status().code(), absl::StatusCode::kUnavailable);
    GTEST_SKIP() << "no CUDA device: " << (count.ok() ? "count 0" : count.status().ToString());
  }
  absl::StatusOr<std::unique_ptr<DeviceBackend>> dev = CreateCudaDevice({});
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->name(), "cuda");
  std::vector<std::string> uuids = (*dev)->DeviceUuids();
  ASSERT_EQ(uuids.size(), static_cast<size_t>(*count));
  for (const std::string& u : uuids) {
    EXPECT_THAT(u, ::testing::StartsWith("GPU-"));
    EXPECT_TRUE(NormalizeDeviceUuid(u).ok()) << u;
  }
#endif
}

#if KVCELLAR_HAVE_CUDA

bool HaveDevice() {
  absl::StatusOr<int> count = CudaDeviceCount();
  return count.ok() && *count > 0;
}

// The engine's KV cache: one cudaMalloc, one region per layer, K blocks then V blocks.
constexpr uint32_t kLayers = 6;
constexpr uint32_t kBlocks = 32;
constexpr uint64_t kBytesPerBlock = 2048;
constexpr uint32_t kSeed = 31;
constexpr uint64_t kTicket = 5;
constexpr uint32_t kSlot = 1;

core::KvLayout EngineLayout(const std::string& mem_handle) {
  return testing::LayerFirstLayout(mem_handle, {kLayers, kBytesPerBlock, kBlocks});
}

// Runs only as the engine process that CudaDeviceTest.IpcGatherAndScatterRoundTrip starts
// (tests/gpu/cuda_engine_process.h).
TEST(CudaIpcEngineChild, Run) {
  std::optional<int> rc = testing::MaybeRunCudaEngineProcess();
  if (!rc.has_value()) {
    GTEST_SKIP()
        << "runs only as the engine process of CudaDeviceTest.IpcGatherAndScatterRoundTrip";
  }
  EXPECT_EQ(*rc, 0);
}

TEST(CudaDeviceTest, IpcGatherAndScatterRoundTrip) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<testing::CudaEngineProcess>> engine =
      testing::CudaEngineProcess::Spawn(
          {"/proc/self/exe", "--gtest_filter=CudaIpcEngineChild.Run"});
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<core::KvLayout> layout =
      (*engine)->Alloc({kLayers, kBytesPerBlock, kBlocks}, kSeed);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::string shm = platform::UniqueShmName("cudaipc");
  absl::StatusOr<platform::SignalRegion> completion =
      platform::SignalRegion::Create(shm, 2, kLayers, 2);
  ASSERT_TRUE(completion.ok()) << completion.status();
  EngineSpec spec;
  spec.device_uuid = (*engine)->device_uuid();
  spec.layout = *layout;
  spec.completion_region = shm;
  const uint64_t object = spec.layout.PageObjectBytes();
  const std::string ready_event = (*engine)->ready_event(0);

  // Pinned, registered pages (the host pool's case) for every path.
  const size_t page_area = 4 * object;
  void* area = aligned_alloc(4096, page_area);
  ASSERT_NE(area, nullptr);
  uint8_t* pages = static_cast<uint8_t*>(area);
  using Path = CudaDeviceOptions::CopyPath;
  for (Path path : {Path::kMemcpy, Path::kKernel, Path::kAuto}) {
    CudaDeviceOptions o;
    o.copy_path = path;
    absl::StatusOr<std::unique_ptr<DeviceBackend>> dev = CreateCudaDevice(o);
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_TRUE((*dev)->RegisterHostMemory(area, page_area).ok());
    {
      absl::StatusOr<std::unique_ptr<EngineMapping>> mapping = (*dev)->OpenEngine(spec);
      ASSERT_TRUE(mapping.ok()) << mapping.status();
      std::memset(pages, 0, page_area);
      std::vector<CopyItem> items = {{3, pages}, {7, pages + object}, {31, pages + 2 * object}};
      absl::StatusOr<OpHandle> g =
          (*dev)->SubmitGather(**mapping, items, ReadyFence::CudaIpcEvent(ready_event), {});
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE((*g)->Wait(absl::Seconds(60)));
      ASSERT_TRUE((*g)->status().ok()) << (*g)->status();
      for (const CopyItem& it : items) {
        EXPECT_EQ(testing::CheckPage(spec.layout, it.host_page, kSeed, it.device_block), "")
            << "path " << static_cast<int>(path);
      }
      if (path == Path::kAuto) {
        // Block 3's page into block 20 and block 7's into block 21; block 22 stays as it was.
        std::vector<CopyItem> back = {{20, pages}, {21, pages + object}};
        absl::StatusOr<OpHandle> s = (*dev)->SubmitScatter(**mapping, back, {kSlot, kTicket});
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_TRUE((*s)->Wait(absl::Seconds(60)));
        EXPECT_TRUE((*s)->status().ok()) << (*s)->status();
        EXPECT_TRUE(completion->WaitOp(kSlot, kTicket, absl::Now() + absl::Seconds(60)).ok());
        for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(completion->layer_word(kSlot, l), kTicket);
        EXPECT_TRUE((*engine)->Check(20, 3, 1, kSeed).ok());
        EXPECT_TRUE((*engine)->Check(21, 7, 1, kSeed).ok());
        EXPECT_TRUE((*engine)->Check(22, 22, 1, kSeed).ok());
      }
    }
    EXPECT_TRUE((*dev)->UnregisterHostMemory(area).ok());
  }
  free(area);
  // Every mapping is closed: the engine may free its pool and exit.
  EXPECT_TRUE((*engine)->Free().ok());
  const int status = (*engine)->Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "engine process failed";
}

TEST(CudaDeviceTest, BadRequestsNameTheField) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<DeviceBackend>> dev = CreateCudaDevice({});
  ASSERT_TRUE(dev.ok());
  EngineSpec spec;
  spec.device_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  spec.layout = EngineLayout(std::string(64, '\0'));
  EXPECT_EQ((*dev)->OpenEngine(spec).status().code(), absl::StatusCode::kNotFound);
  spec.device_uuid = (*dev)->DeviceUuids().front();
  spec.layout.regions[0].handle = "short";
  absl::StatusOr<std::unique_ptr<EngineMapping>> m = (*dev)->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("regions[0].handle"));
  // A handle of the right size that no process exported.
  spec.layout = EngineLayout(std::string(64, '\x5a'));
  m = (*dev)->OpenEngine(spec);
  EXPECT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("regions[0].handle"));
}

#endif  // KVCELLAR_HAVE_CUDA

}  // namespace
}  // namespace kvcellar::gpu
