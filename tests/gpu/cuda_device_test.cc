// The CUDA device. Without a CUDA build these tests check the "not compiled in" answer; without a
// GPU they skip. With one, a second process (this binary, re-executed as the engine) exports a KV
// cache through CUDA IPC and the daemon side gathers and scatters it over both copy paths.
#include "gpu/cuda/cuda_device.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if KVCELLAR_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "platform/signal_region.h"
#include "platform/sim_engine_memory.h"
#include "tests/gpu/sim_test_util.h"

extern char** environ;
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
  core::KvLayout l;
  l.num_blocks = kBlocks;
  const uint64_t layer_bytes = 2 * kBlocks * kBytesPerBlock;
  for (uint32_t i = 0; i < kLayers; ++i) {
    l.regions.push_back({mem_handle, i * layer_bytes, layer_bytes});
    l.layers.push_back(
        {{i, 0, kBytesPerBlock, kBytesPerBlock},
         core::BufferLayout{i, kBlocks * kBytesPerBlock, kBytesPerBlock, kBytesPerBlock}});
  }
  return l;
}

uint64_t Offset(uint32_t layer, uint32_t buffer, uint32_t block) {
  return layer * 2 * kBlocks * kBytesPerBlock + buffer * kBlocks * kBytesPerBlock +
         block * kBytesPerBlock;
}

// Runs only as the child that CudaDeviceTest.IpcGatherAndScatterRoundTrip starts.
TEST(CudaIpcEngineChild, Run) {
  const char* out_fd = getenv("KVCELLAR_CUDA_ENGINE_OUT");
  const char* in_fd = getenv("KVCELLAR_CUDA_ENGINE_IN");
  const char* shm = getenv("KVCELLAR_CUDA_ENGINE_SHM");
  if (out_fd == nullptr || in_fd == nullptr || shm == nullptr) {
    GTEST_SKIP()
        << "runs only as the engine process of CudaDeviceTest.IpcGatherAndScatterRoundTrip";
  }
  int out = -1, in = -1;
  ASSERT_TRUE(absl::SimpleAtoi(out_fd, &out) && absl::SimpleAtoi(in_fd, &in));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const uint64_t total = kLayers * 2 * kBlocks * kBytesPerBlock;
  std::vector<uint8_t> host(total);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t b = 0; b < 2; ++b) {
      for (uint32_t k = 0; k < kBlocks; ++k) {
        testing::FillPattern(host.data() + Offset(l, b, k), kBytesPerBlock, kSeed, l, b, k);
      }
    }
  }
  void* kv = nullptr;
  ASSERT_EQ(cudaMalloc(&kv, total), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(kv, host.data(), total, cudaMemcpyHostToDevice), cudaSuccess);
  cudaEvent_t ev;
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev, 0), cudaSuccess);  // "The forward pass is done."
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  ASSERT_EQ(cudaIpcGetMemHandle(&mh, kv), cudaSuccess);
  ASSERT_EQ(cudaIpcGetEventHandle(&eh, ev), cudaSuccess);
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  absl::StatusOr<platform::SignalRegion> completion =
      platform::SignalRegion::Create(shm, 2, kLayers, 2);
  ASSERT_TRUE(completion.ok()) << completion.status();

  const std::string line = absl::StrCat(
      FormatGpuUuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes)), " ",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&mh), sizeof(mh))),
      " ",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&eh), sizeof(eh))),
      "\n");
  ASSERT_EQ(write(out, line.data(), line.size()), static_cast<ssize_t>(line.size()));

  // The daemon scatters block 3's page into block 20 and block 7's into block 21.
  ASSERT_TRUE(completion->WaitOp(kSlot, kTicket, absl::Now() + absl::Seconds(120)).ok());
  for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(completion->layer_word(kSlot, l), kTicket);
  ASSERT_EQ(cudaMemcpy(host.data(), kv, total, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t b = 0; b < 2; ++b) {
      EXPECT_TRUE(
          testing::HoldsPattern(host.data() + Offset(l, b, 20), kBytesPerBlock, kSeed, l, b, 3));
      EXPECT_TRUE(
          testing::HoldsPattern(host.data() + Offset(l, b, 21), kBytesPerBlock, kSeed, l, b, 7));
      EXPECT_TRUE(
          testing::HoldsPattern(host.data() + Offset(l, b, 22), kBytesPerBlock, kSeed, l, b, 22));
    }
  }
  char c;
  ASSERT_EQ(read(in, &c, 1), 1);  // Free only once the daemon closed its mapping.
  cudaFree(kv);
}

TEST(CudaDeviceTest, IpcGatherAndScatterRoundTrip) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const std::string shm = platform::UniqueShmName("cudaipc");
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  env_strings.push_back(absl::StrCat("KVCELLAR_CUDA_ENGINE_OUT=", to_parent[1]));
  env_strings.push_back(absl::StrCat("KVCELLAR_CUDA_ENGINE_IN=", to_child[0]));
  env_strings.push_back(absl::StrCat("KVCELLAR_CUDA_ENGINE_SHM=", shm));
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=CudaIpcEngineChild.Run";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  // The child keeps only its own ends, so that either side dying shows as EOF to the other.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addclose(&actions, to_parent[0]);
  posix_spawn_file_actions_addclose(&actions, to_child[1]);
  pid_t child;
  ASSERT_EQ(posix_spawn(&child, exe.c_str(), &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(to_parent[1]);
  close(to_child[0]);

  std::string line;
  char c;
  while (read(to_parent[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  std::vector<std::string> parts = absl::StrSplit(line, ' ');
  ASSERT_EQ(parts.size(), 3u) << "engine child said: " << line;
  const std::string mem_handle = absl::HexStringToBytes(parts[1]);
  const std::string event_handle = absl::HexStringToBytes(parts[2]);
  EngineSpec spec;
  spec.device_uuid = parts[0];
  spec.layout = EngineLayout(mem_handle);
  spec.completion_region = shm;
  const uint64_t object = spec.layout.PageObjectBytes();

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
      absl::StatusOr<std::unique_ptr<EngineMapping>> engine = (*dev)->OpenEngine(spec);
      ASSERT_TRUE(engine.ok()) << engine.status();
      std::memset(pages, 0, page_area);
      std::vector<CopyItem> items = {{3, pages}, {7, pages + object}, {31, pages + 2 * object}};
      absl::StatusOr<OpHandle> g =
          (*dev)->SubmitGather(**engine, items, ReadyFence::CudaIpcEvent(event_handle), {});
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE((*g)->Wait(absl::Seconds(60)));
      ASSERT_TRUE((*g)->status().ok()) << (*g)->status();
      for (const CopyItem& it : items) {
        EXPECT_EQ(testing::CheckPage(spec.layout, it.host_page, kSeed, it.device_block), "")
            << "path " << static_cast<int>(path);
      }
      if (path == Path::kAuto) {
        std::vector<CopyItem> back = {{20, pages}, {21, pages + object}};
        absl::StatusOr<OpHandle> s = (*dev)->SubmitScatter(**engine, back, {kSlot, kTicket});
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_TRUE((*s)->Wait(absl::Seconds(60)));
        EXPECT_TRUE((*s)->status().ok()) << (*s)->status();
      }
    }
    EXPECT_TRUE((*dev)->UnregisterHostMemory(area).ok());
  }
  free(area);
  ASSERT_EQ(write(to_child[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "engine child failed";
  close(to_parent[0]);
  close(to_child[1]);
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
