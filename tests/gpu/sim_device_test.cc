// The sim device against real shared memory and real threads: the same checks a CUDA device
// would have to pass, on any machine.
#include "gpu/sim_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/signal_region.h"
#include "platform/sim_engine_memory.h"
#include "tests/gpu/sim_test_util.h"

namespace kvcellar::gpu {
namespace {

using ::kvcellar::gpu::testing::CheckBlock;
using ::kvcellar::gpu::testing::CheckPage;
using ::kvcellar::gpu::testing::Done;
using ::kvcellar::gpu::testing::Failed;
using ::kvcellar::gpu::testing::FillEngine;
using ::kvcellar::gpu::testing::SpecOf;
using ::kvcellar::platform::SignalRegion;
using ::kvcellar::platform::SimEngineKvCache;
using ::kvcellar::platform::SimEngineMemory;
using ::kvcellar::platform::SimKvShape;
using ::kvcellar::platform::UniqueShmName;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(30);

std::unique_ptr<SimDevice> MakeDevice(uint64_t task_bytes = 64 << 10, int threads = 3) {
  SimDevice::Options o;
  o.copy_threads = threads;
  o.task_bytes = task_bytes;
  absl::StatusOr<std::unique_ptr<SimDevice>> d = SimDevice::Create(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return *std::move(d);
}

SimEngineKvCache MakeKv(const SimKvShape& shape, uint32_t slots = 4) {
  absl::StatusOr<SimEngineKvCache> kv =
      SimEngineKvCache::Create(UniqueShmName("simtest"), shape, slots);
  EXPECT_TRUE(kv.ok()) << kv.status();
  return *std::move(kv);
}

std::unique_ptr<EngineMapping> Open(SimDevice& dev, const SimEngineKvCache& kv) {
  absl::StatusOr<std::unique_ptr<EngineMapping>> m = dev.OpenEngine(SpecOf(kv));
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

struct Pages {
  Pages(size_t n, uint64_t bytes) : bytes(bytes), data(n * bytes, 0xee) {}
  uint8_t* operator[](size_t i) { return data.data() + i * bytes; }
  uint64_t bytes;
  std::vector<uint8_t> data;
};

// --- Round trips over the arrangements engines use -------------------------------------------

struct ShapeCase {
  const char* name;
  SimKvShape shape;
};

class SimRoundTripTest : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(SimRoundTripTest, GatherThenScatterElsewhereReproducesBytes) {
  const SimKvShape shape = GetParam().shape;
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv(shape);
  FillEngine(kv, 7);
  auto engine = Open(*dev, kv);
  const uint64_t obj = engine->page_object_bytes();
  EXPECT_EQ(obj, kv.layout().PageObjectBytes());

  const std::vector<uint32_t> src = {5, 0, 9, 3, 14, 2};
  Pages pages(src.size(), obj);
  std::vector<CopyItem> items;
  for (size_t i = 0; i < src.size(); ++i) items.push_back({src[i], pages[i]});
  absl::StatusOr<OpHandle> g = dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE((*g)->Wait(kWait));
  ASSERT_TRUE((*g)->status().ok()) << (*g)->status();
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(CheckPage(kv.layout(), pages[i], 7, src[i]), "") << "page " << i;
  }

  // Scatter the pages into other blocks; they must equal the source blocks byte for byte, and
  // no other block may change.
  const std::vector<uint32_t> dst = {15, 10, 11, 4, 1, 12};
  items.clear();
  for (size_t i = 0; i < dst.size(); ++i) items.push_back({dst[i], pages[i]});
  absl::StatusOr<OpHandle> s = dev->SubmitScatter(*engine, items, {1, 42});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->Wait(kWait));
  ASSERT_TRUE((*s)->status().ok()) << (*s)->status();
  EXPECT_EQ((*s)->layers_done(), shape.num_layers);
  for (uint32_t b = 0; b < shape.num_blocks; ++b) {
    auto it = std::find(dst.begin(), dst.end(), b);
    uint32_t expect = it == dst.end() ? b : src[it - dst.begin()];
    EXPECT_EQ(CheckBlock(kv, b, 7, expect), "");
  }
  EXPECT_EQ(kv.completion().op_word(1), Done(42));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SimRoundTripTest,
    ::testing::Values(
        // Small objects: several pages per task.
        ShapeCase{"MhaLayerFirstSmall",
                  {4, 16, 256, false, SimKvShape::Arrangement::kLayerFirst, 0}},
        // Objects larger than a task: pages split by layer runs.
        ShapeCase{"MhaLayerFirstLarge",
                  {32, 16, 8192, false, SimKvShape::Arrangement::kLayerFirst, 0}},
        ShapeCase{"MhaLayerFirstPadded",
                  {3, 16, 1000, false, SimKvShape::Arrangement::kLayerFirst, 1536}},
        ShapeCase{"MlaLayerFirst", {61, 16, 1152, true, SimKvShape::Arrangement::kLayerFirst, 0}},
        ShapeCase{"MhaBlockFirst", {8, 16, 2048, false, SimKvShape::Arrangement::kBlockFirst, 0}},
        ShapeCase{"MlaBlockFirst", {5, 16, 576, true, SimKvShape::Arrangement::kBlockFirst, 0}}),
    [](const ::testing::TestParamInfo<ShapeCase>& info) { return info.param.name; });

TEST(SimDeviceTest, ScatterLeavesStridePaddingAlone) {
  const SimKvShape shape{3, 16, 1000, false, SimKvShape::Arrangement::kLayerFirst, 1536};
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv(shape);
  std::memset(kv.memory().data(), 0x5a, kv.memory().size());
  auto engine = Open(*dev, kv);
  Pages pages(1, engine->page_object_bytes());
  std::memset(pages[0], 0x11, pages.bytes);
  CopyItem item{2, pages[0]};
  absl::StatusOr<OpHandle> s = dev->SubmitScatter(*engine, {&item, 1}, {});
  ASSERT_TRUE(s.ok() && (*s)->Wait(kWait) && (*s)->status().ok());
  size_t written = 0;
  for (uint64_t i = 0; i < kv.memory().size(); ++i) written += kv.memory().data()[i] == 0x11;
  EXPECT_EQ(written, pages.bytes);  // Exactly the page's bytes, none of the padding.
}

// --- Fences -----------------------------------------------------------------------------------

TEST(SimDeviceTest, GatherReadsNothingBeforeTheFence) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({4, 8, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0});
  FillEngine(kv, 1);  // Forward pass 0's bytes.
  kv.completion().PublishReady(0, 10);
  auto engine = Open(*dev, kv);

  Pages pages(3, engine->page_object_bytes());
  std::vector<CopyItem> items = {{1, pages[0]}, {6, pages[1]}, {3, pages[2]}};
  absl::StatusOr<OpHandle> op =
      dev->SubmitGather(*engine, items, ReadyFence::Counter(0, 11), {2, 99});
  ASSERT_TRUE(op.ok()) << op.status();
  // Forward pass 11 is still "running": the op must wait and read nothing.
  EXPECT_FALSE((*op)->Wait(absl::Milliseconds(50)));
  EXPECT_EQ(kv.completion().op_word(2), 0u);
  FillEngine(kv, 2);                    // The pass writes its blocks...
  kv.completion().PublishReady(0, 11);  // ...and then signals.
  ASSERT_TRUE((*op)->Wait(kWait));
  ASSERT_TRUE((*op)->status().ok()) << (*op)->status();
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(CheckPage(kv.layout(), pages[i], 2, items[i].device_block), "") << i;
  }
  EXPECT_EQ(kv.completion().op_word(2), Done(99));
}

TEST(SimDeviceTest, PassedFenceRunsAtOnce) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({2, 4, 512, false, SimKvShape::Arrangement::kLayerFirst, 0});
  FillEngine(kv, 3);
  kv.completion().PublishReady(0, 5);
  auto engine = Open(*dev, kv);
  Pages pages(1, engine->page_object_bytes());
  CopyItem item{2, pages[0]};
  absl::StatusOr<OpHandle> op =
      dev->SubmitGather(*engine, {&item, 1}, ReadyFence::Counter(0, 4), {});
  ASSERT_TRUE(op.ok());
  ASSERT_TRUE((*op)->Wait(kWait));
  EXPECT_TRUE((*op)->status().ok());
  EXPECT_EQ(CheckPage(kv.layout(), pages[0], 3, 2), "");
}

TEST(SimDeviceTest, CancelledFenceWaiterFinishesCancelledAndSignalsFailure) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({2, 4, 512, false, SimKvShape::Arrangement::kLayerFirst, 0});
  auto engine = Open(*dev, kv);
  Pages pages(1, engine->page_object_bytes());
  CopyItem item{0, pages[0]};
  absl::StatusOr<OpHandle> op =
      dev->SubmitGather(*engine, {&item, 1}, ReadyFence::Counter(0, 1), {0, 7});
  ASSERT_TRUE(op.ok());
  (*op)->Cancel();
  ASSERT_TRUE((*op)->Wait(kWait));
  EXPECT_EQ((*op)->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(kv.completion().op_word(0), Failed(7));
  for (uint32_t l = 0; l < 2; ++l) EXPECT_EQ(kv.completion().layer_word(0, l), 7u);
  EXPECT_EQ(pages[0][0], 0xee);  // Nothing was read.
}

// --- Per-layer completion ---------------------------------------------------------------------

TEST(SimDeviceTest, ScatterSignalsEachLayerInOrderOnlyOnceItLanded) {
  // 48 layers x 64 pages x 2 x 8 KiB = 48 MiB, in tasks of 64 KiB: many tasks per layer, several
  // workers, so layers finish out of order inside the device and must still be published in order.
  const SimKvShape shape{48, 128, 8192, false, SimKvShape::Arrangement::kLayerFirst, 0};
  auto dev = MakeDevice(64 << 10, 3);
  SimEngineKvCache kv = MakeKv(shape);
  FillEngine(kv, 5);
  auto engine = Open(*dev, kv);
  const uint32_t n = 64;
  Pages pages(n, engine->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < n; ++i) items.push_back({i, pages[i]});
  absl::StatusOr<OpHandle> g = dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(g.ok() && (*g)->Wait(kWait) && (*g)->status().ok());
  FillEngine(kv, 6);  // Overwrite: the scatter below must bring back seed 5's bytes.

  std::vector<CopyItem> back;
  for (uint32_t i = 0; i < n; ++i) back.push_back({64 + i, pages[i]});
  const uint64_t ticket = 1000;
  absl::StatusOr<OpHandle> s = dev->SubmitScatter(*engine, back, {3, ticket});
  ASSERT_TRUE(s.ok()) << s.status();
  // The engine side: waits for each layer in turn, like a forward pass would, and checks that the
  // layer is entirely there the moment it is signalled, and that no later layer was signalled
  // before an earlier one.
  uint32_t last_seen_done = 0;
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    ASSERT_TRUE(kv.completion().WaitLayer(3, l, ticket, absl::Now() + kWait).ok()) << l;
    for (uint32_t earlier = 0; earlier < l; ++earlier) {
      ASSERT_EQ(kv.completion().layer_word(3, earlier), ticket);
    }
    for (uint32_t i = 0; i < n; ++i) {
      ASSERT_EQ(CheckBlock(kv, 64 + i, 5, i, l), "") << "layer " << l << " signalled early";
    }
    const uint32_t done = (*s)->layers_done();
    EXPECT_GE(done, last_seen_done);
    last_seen_done = done;
  }
  ASSERT_TRUE(kv.completion().WaitOp(3, ticket, absl::Now() + kWait).ok());
  ASSERT_TRUE((*s)->Wait(kWait));
  EXPECT_TRUE((*s)->status().ok());
  EXPECT_EQ((*s)->layers_done(), shape.num_layers);
  EXPECT_EQ(kv.completion().op_word(3), Done(ticket));
}

TEST(SimDeviceTest, LayerCountersNeverRunAhead) {
  // A watcher polls every layer counter as fast as it can while a scatter runs: at every instant
  // the signalled layers form a prefix.
  const SimKvShape shape{40, 64, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0};
  auto dev = MakeDevice(16 << 10, 3);
  SimEngineKvCache kv = MakeKv(shape);
  auto engine = Open(*dev, kv);
  Pages pages(64, engine->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < 64; ++i) items.push_back({i, pages[i]});
  for (uint64_t ticket = 1; ticket <= 5; ++ticket) {
    std::atomic<bool> stop{false};
    std::atomic<bool> violated{false};
    std::thread watcher([&] {
      // Reads from the last layer down: once layer l is seen signalled, every lower layer, read
      // later still, must be signalled too.
      while (!stop.load()) {
        bool seen = false;
        for (uint32_t l = shape.num_layers; l-- > 0;) {
          bool landed = kv.completion().layer_word(0, l) >= ticket;
          if (seen && !landed) violated = true;
          seen = seen || landed;
        }
      }
    });
    absl::StatusOr<OpHandle> s = dev->SubmitScatter(*engine, items, {0, ticket});
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Wait(kWait));
    stop = true;
    watcher.join();
    EXPECT_FALSE(violated) << "ticket " << ticket;
    EXPECT_EQ(kv.completion().op_word(0), Done(ticket));
  }
}

// --- Validation -------------------------------------------------------------------------------

TEST(SimDeviceTest, EngineMemorySmallerThanDeclaredIsRejected) {
  auto dev = MakeDevice();
  const std::string name = UniqueShmName("small");
  absl::StatusOr<SimEngineMemory> mem = SimEngineMemory::Create(name, 64 << 10);
  ASSERT_TRUE(mem.ok());
  EngineSpec spec;
  spec.layout.num_blocks = 32;
  spec.layout.regions.push_back(mem->Region(0, 128 << 10));  // Declares twice what exists.
  spec.layout.layers.push_back({{0, 0, 2048, 2048}, core::BufferLayout{0, 64 << 10, 2048, 2048}});
  absl::StatusOr<std::unique_ptr<EngineMapping>> m = dev->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("regions[0]"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("fewer than"));

  spec.layout.regions[0].handle = UniqueShmName("missing");
  m = dev->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);

  spec.layout.regions[0].handle = "no-slash";
  m = dev->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("regions[0].handle"));

  spec.layout.regions[0] = mem->Region(0, 64 << 10);
  spec.layout.layers[0].v->offset = 32 << 10;  // Fits now.
  spec.layout.num_blocks = 16;
  spec.completion_region = UniqueShmName("nocompletion");
  m = dev->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("completion_region"));
  spec.completion_region.clear();
  EXPECT_TRUE(dev->OpenEngine(spec).ok());
}

TEST(SimDeviceTest, CompletionRegionMustMatchTheLayout) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({3, 4, 256, false, SimKvShape::Arrangement::kLayerFirst, 0}, 0);
  absl::StatusOr<SignalRegion> wrong =
      SignalRegion::Create(UniqueShmName("wrong"), 4, /*num_layers=*/5, 4);
  ASSERT_TRUE(wrong.ok());
  EngineSpec spec = SpecOf(kv);
  spec.completion_region = wrong->name();
  absl::StatusOr<std::unique_ptr<EngineMapping>> m = dev->OpenEngine(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("num_layers 5"));

  // Not a completion region at all.
  absl::StatusOr<SimEngineMemory> junk = SimEngineMemory::Create(UniqueShmName("junk"), 4096);
  ASSERT_TRUE(junk.ok());
  spec.completion_region = junk->name();
  m = dev->OpenEngine(spec);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("magic"));
}

TEST(SimDeviceTest, BadBatchesAreRejectedWithoutCopying) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({2, 8, 256, false, SimKvShape::Arrangement::kLayerFirst, 0});
  FillEngine(kv, 1);
  auto engine = Open(*dev, kv);
  Pages pages(2, engine->page_object_bytes());

  std::vector<CopyItem> items = {{1, pages[0]}, {8, pages[1]}};
  absl::StatusOr<OpHandle> op = dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
  EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(op.status().message()),
              HasSubstr("items[1].device_block (8) out of range [0, 8)"));
  EXPECT_EQ(pages[0][0], 0xee);

  items = {{1, pages[0]}, {2, nullptr}};
  op = dev->SubmitScatter(*engine, items, {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("items[1].host_page is null"));

  items = {{3, pages[0]}, {3, pages[1]}};
  op = dev->SubmitScatter(*engine, items, {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("duplicates"));
  EXPECT_EQ(CheckBlock(kv, 3, 1, 3), "");
  // Gathering one block into two pages is fine.
  op = dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(op.ok());
  ASSERT_TRUE((*op)->Wait(kWait));

  items = {{1, pages[0]}};
  op = dev->SubmitGather(*engine, items, ReadyFence::CudaIpcEvent(std::string(64, 'x')), {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("fence.kind"));
  op = dev->SubmitScatter(*engine, items, {4, 1});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("signal.slot (4) out of range"));
  op = dev->SubmitGather(*engine, items, ReadyFence::Counter(4, 1), {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("fence.slot (4) out of range"));

  std::vector<CopyItem> huge(kMaxCopyItems + 1, CopyItem{0, pages[0]});
  op = dev->SubmitGather(*engine, huge, ReadyFence::Ready(), {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("more than"));

  // Without a completion region there are no counter fences and no signals.
  SimEngineKvCache bare = MakeKv({2, 8, 256, false, SimKvShape::Arrangement::kLayerFirst, 0}, 0);
  auto bare_engine = Open(*dev, bare);
  op = dev->SubmitGather(*bare_engine, items, ReadyFence::Counter(0, 1), {});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("completion_region"));
  op = dev->SubmitScatter(*bare_engine, items, {0, 1});
  EXPECT_THAT(std::string(op.status().message()), HasSubstr("completion_region"));
  op = dev->SubmitScatter(*bare_engine, items, {});
  ASSERT_TRUE(op.ok());
  ASSERT_TRUE((*op)->Wait(kWait));
  EXPECT_TRUE((*op)->status().ok());
}

TEST(SimDeviceTest, EmptyBatchCompletesAtOnce) {
  auto dev = MakeDevice();
  SimEngineKvCache kv = MakeKv({3, 4, 256, false, SimKvShape::Arrangement::kLayerFirst, 0});
  auto engine = Open(*dev, kv);
  absl::StatusOr<OpHandle> op = dev->SubmitScatter(*engine, {}, {1, 5});
  ASSERT_TRUE(op.ok());
  EXPECT_TRUE((*op)->Poll());
  EXPECT_TRUE((*op)->status().ok());
  EXPECT_EQ(kv.completion().layer_word(1, 2), 5u);
  EXPECT_EQ(kv.completion().op_word(1), Done(5));
}

TEST(SimDeviceTest, DeviceUuidIsCheckedWhenConfigured) {
  SimDevice::Options o;
  o.uuid = "sim-0";
  auto dev = *SimDevice::Create(o);
  SimEngineKvCache kv = MakeKv({1, 2, 64, false, SimKvShape::Arrangement::kLayerFirst, 0}, 0);
  EXPECT_EQ(dev->OpenEngine(SpecOf(kv, "sim-1")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(dev->OpenEngine(SpecOf(kv, "sim-0")).ok());
  EXPECT_THAT(dev->DeviceUuids(), ::testing::ElementsAre("sim-0"));
}

// --- Closing with ops in flight ---------------------------------------------------------------

TEST(SimDeviceTest, ClosingAMappingWithPendingOpsIsSafe) {
  auto dev = MakeDevice(16 << 10, 2);
  for (int round = 0; round < 20; ++round) {
    const SimKvShape shape{16, 256, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0};
    SimEngineKvCache kv = MakeKv(shape);
    auto engine = Open(*dev, kv);
    Pages pages(128, engine->page_object_bytes());
    std::vector<CopyItem> items;
    for (uint32_t i = 0; i < 128; ++i) items.push_back({i, pages[i]});
    // One gather that waits for a fence that never comes, and a large scatter still running.
    OpHandle waiting = *dev->SubmitGather(*engine, items, ReadyFence::Counter(0, 1), {0, 11});
    for (uint32_t i = 0; i < 128; ++i) items[i].device_block = 128 + i;
    OpHandle running = *dev->SubmitScatter(*engine, items, {1, 12});
    if (round % 2) absl::SleepFor(absl::Microseconds(200 * round));
    engine.reset();  // Returns only once nothing touches the engine's memory any more.
    ASSERT_TRUE(waiting->Poll());
    ASSERT_TRUE(running->Poll());
    EXPECT_EQ(waiting->status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(kv.completion().op_word(0), Failed(11));
    if (!running->status().ok()) {
      EXPECT_EQ(running->status().code(), absl::StatusCode::kCancelled);
      EXPECT_EQ(kv.completion().op_word(1), Failed(12));
    } else {
      EXPECT_EQ(kv.completion().op_word(1), Done(12));
    }
  }
}

TEST(SimDeviceTest, DestroyingTheDeviceCancelsQueuedOps) {
  SimEngineKvCache kv = MakeKv({8, 64, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0});
  auto dev = MakeDevice(16 << 10, 1);
  auto engine = Open(*dev, kv);
  Pages pages(64, engine->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < 64; ++i) items.push_back({i, pages[i]});
  OpHandle waiting = *dev->SubmitGather(*engine, items, ReadyFence::Counter(0, 1), {});
  OpHandle queued = *dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
  dev.reset();
  EXPECT_TRUE(waiting->Poll());
  EXPECT_TRUE(queued->Poll());
  EXPECT_EQ(waiting->status().code(), absl::StatusCode::kCancelled);
  engine.reset();  // The mapping outlives its device.
}

// --- Concurrency ------------------------------------------------------------------------------

TEST(SimDeviceTest, ConcurrentSubmittersEachGetTheirBytes) {
  const SimKvShape shape{12, 256, 2048, false, SimKvShape::Arrangement::kLayerFirst, 0};
  auto dev = MakeDevice(32 << 10, 3);
  SimEngineKvCache kv = MakeKv(shape, 8);
  FillEngine(kv, 9);
  auto engine = Open(*dev, kv);
  constexpr int kThreads = 4;
  constexpr int kRounds = 40;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      Pages pages(16, engine->page_object_bytes());
      for (int r = 0; r < kRounds; ++r) {
        // Gather 16 random source blocks (0..127, never written), then scatter them into this
        // thread's own blocks (128 + 32 t ...), then check those blocks.
        std::vector<CopyItem> items;
        std::vector<uint32_t> src;
        for (uint32_t i = 0; i < 16; ++i) {
          src.push_back(rng() % 128);
          items.push_back({src.back(), pages[i]});
        }
        OpHandle g = *dev->SubmitGather(*engine, items, ReadyFence::Ready(), {});
        if (!g->Wait(kWait) || !g->status().ok()) ++failures;
        for (uint32_t i = 0; i < 16; ++i) {
          if (!CheckPage(kv.layout(), pages[i], 9, src[i]).empty()) ++failures;
          items[i].device_block = 128 + 32 * t + i + (r % 2) * 16;
        }
        const uint64_t ticket = r + 1;
        OpHandle s = *dev->SubmitScatter(*engine, items, {static_cast<uint32_t>(t), ticket});
        if (!s->Wait(kWait) || !s->status().ok()) ++failures;
        if (kv.completion().op_word(t) != Done(ticket)) ++failures;
        for (uint32_t i = 0; i < 16; ++i) {
          if (!CheckBlock(kv, items[i].device_block, 9, src[i]).empty()) ++failures;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// --- Hostile engines ---------------------------------------------------------------------------

// Shrinks shm object `name` to nothing under every mapping of it, as a buggy or hostile engine
// could at any moment: later accesses to its pages raise SIGBUS.
void TruncateShm(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << name;
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
}

// The engine's KV object.
void Truncate(const SimEngineKvCache& kv) { TruncateShm(kv.layout().regions[0].handle); }

TEST(SimDeviceTest, AnEngineThatTruncatesItsMemoryFailsOnlyItsOwnOps) {
  const SimKvShape shape{4, 64, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0};
  auto dev = MakeDevice(16 << 10, 2);
  SimEngineKvCache victim = MakeKv(shape);
  SimEngineKvCache other = MakeKv(shape);
  FillEngine(victim, 1);
  FillEngine(other, 2);
  auto vm = Open(*dev, victim);
  auto om = Open(*dev, other);
  Pages pages(8, vm->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < 8; ++i) items.push_back({i, pages[i]});

  Truncate(victim);
  // A Gather reads the missing pages: the copy faults, the op fails and names why.
  OpHandle g = *dev->SubmitGather(*vm, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(g->Wait(kWait));
  EXPECT_EQ(g->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(g->status().message()), HasSubstr("truncated"));
  // Every later op of that engine fails at once, Scatters (writes) included.
  absl::StatusOr<OpHandle> s = dev->SubmitScatter(*vm, items, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);

  // The other engine, on the same copy threads, is untouched: both directions, every byte.
  OpHandle og = *dev->SubmitGather(*om, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(og->Wait(kWait));
  ASSERT_TRUE(og->status().ok()) << og->status();
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(CheckPage(other.layout(), pages[i], 2, i), "");
  for (CopyItem& it : items) it.device_block += 32;
  OpHandle os = *dev->SubmitScatter(*om, items, {});
  ASSERT_TRUE(os->Wait(kWait));
  ASSERT_TRUE(os->status().ok()) << os->status();
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(CheckBlock(other, 32 + i, 2, i), "");
}

TEST(SimDeviceTest, AScatterIntoTruncatedMemoryFailsInsteadOfCrashing) {
  const SimKvShape shape{2, 32, 8192, false, SimKvShape::Arrangement::kBlockFirst, 0};
  auto dev = MakeDevice(64 << 10, 2);
  SimEngineKvCache kv = MakeKv(shape);
  auto m = Open(*dev, kv);
  Pages pages(4, m->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < 4; ++i) items.push_back({i, pages[i]});
  Truncate(kv);
  OpHandle s = *dev->SubmitScatter(*m, items, {0, 1});
  ASSERT_TRUE(s->Wait(kWait));
  EXPECT_EQ(s->status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SimDeviceTest, AnEngineThatTruncatesItsCompletionRegionCannotCrashTheDevice) {
  const SimKvShape shape{3, 16, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0};
  auto dev = MakeDevice(16 << 10, 2);
  SimEngineKvCache kv = MakeKv(shape);
  FillEngine(kv, 5);
  auto m = Open(*dev, kv);
  Pages pages(4, m->page_object_bytes());
  std::vector<CopyItem> items;
  for (uint32_t i = 0; i < 4; ++i) items.push_back({i, pages[i]});
  TruncateShm(kv.completion().name());
  // The daemon's layer and done signals fall on missing pages: dropped, the copies still land.
  OpHandle g = *dev->SubmitGather(*m, items, ReadyFence::Ready(), {});
  ASSERT_TRUE(g->Wait(kWait));
  ASSERT_TRUE(g->status().ok()) << g->status();
  for (CopyItem& it : items) it.device_block += 8;
  OpHandle s = *dev->SubmitScatter(*m, items, {0, 1});
  ASSERT_TRUE(s->Wait(kWait));
  EXPECT_TRUE(s->status().ok()) << s->status();
  // A Gather gated on the engine's fence reads 0 there: it waits, and cancels cleanly.
  OpHandle f = *dev->SubmitGather(*m, items, ReadyFence::Counter(0, 1), {});
  EXPECT_FALSE(f->Wait(absl::Milliseconds(100)));
  f->Cancel();
  ASSERT_TRUE(f->Wait(kWait));
  EXPECT_EQ(f->status().code(), absl::StatusCode::kCancelled);
}

// A SIGBUS outside a guarded copy still kills the process, as before the guard existed.
TEST(SimDeviceDeathTest, AFaultOutsideACopyStillKillsTheProcess) {
  auto dev = MakeDevice();  // Installs the handler.
  EXPECT_EXIT(
      {
        SimEngineKvCache kv = MakeKv({1, 4, 4096, false, SimKvShape::Arrangement::kLayerFirst, 0});
        Truncate(kv);
        volatile uint8_t* p = kv.Block(0, 0, 0);
        *p = 1;
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

// --- Across processes -------------------------------------------------------------------------

TEST(SimDeviceTest, DaemonMapsMemoryAnotherProcessCreated) {
  const SimKvShape shape{6, 32, 1024, false, SimKvShape::Arrangement::kLayerFirst, 0};
  const std::string prefix = UniqueShmName("fork");
  int ready[2], done[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(done), 0);
  // Fork before this process starts any thread of its own (the device is created afterwards).
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The engine: owns the memory and the completion region. The body returns its exit code so
    // that the objects' destructors unlink them before _exit.
    auto engine = [&]() -> int {
      close(ready[0]);
      close(done[1]);
      absl::StatusOr<SimEngineKvCache> kv = SimEngineKvCache::Create(prefix, shape, 2);
      if (!kv.ok()) return 10;
      FillEngine(*kv, 21);
      kv->completion().PublishReady(0, 1);
      char c = 'r';
      if (write(ready[1], &c, 1) != 1) return 11;
      // The daemon scatters block 4's page into block 20 and signals ticket 77 on slot 1.
      if (!kv->completion().WaitOp(1, 77, absl::Now() + kWait).ok()) return 12;
      for (uint32_t l = 0; l < shape.num_layers; ++l) {
        if (kv->completion().layer_word(1, l) != 77) return 13;
      }
      if (!CheckBlock(*kv, 20, 21, 4).empty()) return 14;
      if (!CheckBlock(*kv, 21, 21, 21).empty()) return 15;
      if (read(done[0], &c, 1) != 1) return 16;  // Keep the objects until the daemon closed them.
      return 0;
    };
    _exit(engine());
  }
  close(ready[1]);
  close(done[0]);
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);

  absl::StatusOr<core::KvLayout> layout = SimEngineKvCache::Layout(prefix, shape);
  ASSERT_TRUE(layout.ok());
  EngineSpec spec;
  spec.layout = *layout;
  spec.completion_region = SimEngineKvCache::CompletionName(prefix);
  auto dev = MakeDevice();
  absl::StatusOr<std::unique_ptr<EngineMapping>> engine = dev->OpenEngine(spec);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Pages pages(2, (*engine)->page_object_bytes());
  std::vector<CopyItem> items = {{4, pages[0]}, {31, pages[1]}};
  OpHandle g = *dev->SubmitGather(**engine, items, ReadyFence::Counter(0, 1), {});
  ASSERT_TRUE(g->Wait(kWait));
  ASSERT_TRUE(g->status().ok()) << g->status();
  EXPECT_EQ(CheckPage(*layout, pages[0], 21, 4), "");
  EXPECT_EQ(CheckPage(*layout, pages[1], 21, 31), "");
  CopyItem back{20, pages[0]};
  OpHandle s = *dev->SubmitScatter(**engine, {&back, 1}, {1, 77});
  ASSERT_TRUE(s->Wait(kWait));
  EXPECT_TRUE(s->status().ok());
  engine->reset();
  ASSERT_EQ(write(done[1], "d", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child engine failed a check (see exit code)";
  close(ready[0]);
  close(done[1]);
  // Should the child have died early, its objects would outlive it.
  shm_unlink(layout->regions[0].handle.c_str());
  shm_unlink(spec.completion_region.c_str());
}

}  // namespace
}  // namespace kvcellar::gpu
