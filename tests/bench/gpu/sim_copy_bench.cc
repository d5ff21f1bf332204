// Sim device gather and scatter throughput, beside memcpy of the same bytes in the same run.
//
// Page objects of 64 KiB .. 8 MiB for models of 32 and 80 layers (per-layer K and V buffers of
// object / (2 * layers) bytes), in batches of about 64 MiB, engine memory in shm as an engine would
// create it. BM_Memcpy* copy the same total bytes in one memcpy; the goal is sim >= 0.8x memcpy.
//
//   kvcellar_bench_gpu --benchmark_min_time=0.2
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "gpu/sim_device.h"
#include "platform/sim_engine_memory.h"
#include "tests/gpu/sim_test_util.h"

namespace kvcellar::gpu {
namespace {

using ::kvcellar::platform::SimEngineKvCache;
using ::kvcellar::platform::SimKvShape;
using ::kvcellar::platform::UniqueShmName;

constexpr uint64_t kBatchBytes = 64ull << 20;

struct Setup {
  std::unique_ptr<SimDevice> device;
  std::unique_ptr<SimEngineKvCache> kv;
  std::unique_ptr<EngineMapping> engine;
  std::vector<uint8_t> pages;
  std::vector<CopyItem> gather_items;
  std::vector<CopyItem> scatter_items;
  uint64_t object = 0;
};

std::unique_ptr<Setup> MakeSetup(benchmark::State& state) {
  const uint64_t object_target = uint64_t(state.range(0)) << 10;
  const uint32_t layers = static_cast<uint32_t>(state.range(1));
  auto s = std::make_unique<Setup>();
  SimKvShape shape;
  shape.num_layers = layers;
  // Round per-buffer bytes down to 64 so that copies stay aligned as real KV blocks are.
  shape.bytes_per_block = std::max<uint64_t>(64, object_target / (2 * layers) / 64 * 64);
  const uint32_t items = static_cast<uint32_t>(std::max<uint64_t>(1, kBatchBytes / object_target));
  shape.num_blocks = 2 * items;
  absl::StatusOr<SimEngineKvCache> kv = SimEngineKvCache::Create(UniqueShmName("bench"), shape, 0);
  if (!kv.ok()) {
    state.SkipWithError(std::string(kv.status().message()).c_str());
    return nullptr;
  }
  s->kv = std::make_unique<SimEngineKvCache>(*std::move(kv));
  std::memset(s->kv->memory().data(), 1, s->kv->memory().size());  // Fault every page in.
  SimDevice::Options options;
  // KVCELLAR_BENCH_COPY_THREADS overrides the device's default worker count.
  if (const char* t = std::getenv("KVCELLAR_BENCH_COPY_THREADS"))
    options.copy_threads = std::atoi(t);
  absl::StatusOr<std::unique_ptr<SimDevice>> dev = SimDevice::Create(options);
  s->device = *std::move(dev);
  s->engine = *s->device->OpenEngine(testing::SpecOf(*s->kv));
  s->object = s->engine->page_object_bytes();
  s->pages.assign(items * s->object, 2);
  for (uint32_t i = 0; i < items; ++i) {
    s->gather_items.push_back({i, s->pages.data() + i * s->object});
    s->scatter_items.push_back({items + i, s->pages.data() + i * s->object});
  }
  state.counters["object_KiB"] = static_cast<double>(s->object) / 1024;
  state.counters["items"] = items;
  return s;
}

// One scatter (L2 -> engine) or gather (engine -> L2) of every item, waited for; false on error.
bool CopyOnce(Setup& s, bool scatter) {
  absl::StatusOr<OpHandle> op =
      scatter ? s.device->SubmitScatter(*s.engine, s.scatter_items, {})
              : s.device->SubmitGather(*s.engine, s.gather_items, ReadyFence::Ready(), {});
  return op.ok() && (*op)->Wait(absl::Seconds(60)) && (*op)->status().ok();
}

void Run(benchmark::State& state, bool scatter) {
  std::unique_ptr<Setup> s = MakeSetup(state);
  if (!s) return;
  for (auto _ : state) {
    if (!CopyOnce(*s, scatter)) {
      state.SkipWithError("op failed");
      return;
    }
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * s->gather_items.size() * s->object);
}

// The same bytes, one memcpy, engine memory to host pages (or back).
void RunMemcpy(benchmark::State& state, bool scatter) {
  std::unique_ptr<Setup> s = MakeSetup(state);
  if (!s) return;
  const uint64_t bytes = s->pages.size();
  uint8_t* engine = s->kv->memory().data();
  for (auto _ : state) {
    if (scatter) {
      std::memcpy(engine, s->pages.data(), bytes);
    } else {
      std::memcpy(s->pages.data(), engine, bytes);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes);
}

// Sim op and memcpy alternately in each iteration, so that both see the same machine (other
// processes, turbo, page cache): the ratio counter is the figure to compare with the 0.8x goal.
void RunSideBySide(benchmark::State& state, bool scatter) {
  std::unique_ptr<Setup> s = MakeSetup(state);
  if (!s) return;
  const uint64_t bytes = s->pages.size();
  uint8_t* engine = s->kv->memory().data();
  absl::Duration sim_time, memcpy_time;
  for (auto _ : state) {
    absl::Time t0 = absl::Now();
    if (scatter) {
      std::memcpy(engine + bytes, s->pages.data(), bytes);  // The scatter's target half.
    } else {
      std::memcpy(s->pages.data(), engine, bytes);
    }
    benchmark::ClobberMemory();
    absl::Time t1 = absl::Now();
    if (!CopyOnce(*s, scatter)) {
      state.SkipWithError("op failed");
      return;
    }
    absl::Time t2 = absl::Now();
    memcpy_time += t1 - t0;
    sim_time += t2 - t1;
  }
  const double total = double(state.iterations()) * bytes;
  const double sim_gbps = total / absl::ToDoubleSeconds(sim_time) / 1e9;
  const double memcpy_gbps = total / absl::ToDoubleSeconds(memcpy_time) / 1e9;
  state.counters["sim_GBps"] = sim_gbps;
  state.counters["memcpy_GBps"] = memcpy_gbps;
  state.counters["ratio"] = sim_gbps / memcpy_gbps;
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes * 2);
}

void BM_SimGather(benchmark::State& state) { Run(state, false); }
void BM_SimScatter(benchmark::State& state) { Run(state, true); }
void BM_MemcpyGather(benchmark::State& state) { RunMemcpy(state, false); }
void BM_MemcpyScatter(benchmark::State& state) { RunMemcpy(state, true); }

void Shapes(benchmark::internal::Benchmark* b) {
  for (int layers : {32, 80}) {
    for (int kib : {64, 512, 2048, 8192}) b->Args({kib, layers});
  }
  b->ArgNames({"object_KiB", "layers"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

void BM_SideBySideGather(benchmark::State& state) { RunSideBySide(state, false); }
void BM_SideBySideScatter(benchmark::State& state) { RunSideBySide(state, true); }

BENCHMARK(BM_SideBySideGather)->Apply(Shapes);
BENCHMARK(BM_SideBySideScatter)->Apply(Shapes);
BENCHMARK(BM_MemcpyGather)->Apply(Shapes);
BENCHMARK(BM_SimGather)->Apply(Shapes);
BENCHMARK(BM_MemcpyScatter)->Apply(Shapes);
BENCHMARK(BM_SimScatter)->Apply(Shapes);

}  // namespace
}  // namespace kvcellar::gpu

BENCHMARK_MAIN();
