// Host pool allocate + free throughput, beside malloc + free of the same sizes.
//
// items_per_second counts allocate+free pairs (one pair = two operations). The pool never
// touches slot memory, so the 1 GiB mapping costs nothing but address space here; malloc of the
// same sizes is likewise never touched.
//
// Patterns:
//   Cold:  the class has no other live slot, so every pair also takes a region from the free list
//          and gives it back (the worst case for a pair).
//   Warm:  one slot of the class stays allocated, so its region stays assigned (the steady state
//          of a pool that is mostly full, which is how a cache runs).
//   Batch: 256 allocations then 256 frees, as a Backup or an eviction sweep does.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/host_pool.h"

namespace kvcellar::core {
namespace {

constexpr int kBatch = 256;

std::unique_ptr<HostPool> MakePool() {
  HostPoolOptions o;
  o.capacity_bytes = 1 * kGiB;
  absl::StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(o);
  if (!pool.ok()) std::abort();
  return *std::move(pool);
}

HostPool& SharedPool() {
  static HostPool* pool = MakePool().release();  // Shared by the threads of one benchmark.
  return *pool;
}

void BM_PoolAllocateFreeCold(benchmark::State& state) {
  std::unique_ptr<HostPool> pool = MakePool();
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  for (auto _ : state) {
    absl::StatusOr<SlotRef> r = pool->Allocate(bytes);
    benchmark::DoNotOptimize(r);
    if (!pool->Free(*r).ok()) state.SkipWithError("free failed");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PoolAllocateFreeCold)->Arg(64 << 10)->Arg(2 << 20);

void BM_PoolAllocateFreeWarm(benchmark::State& state) {
  HostPool& pool = SharedPool();
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  // Each thread holds one slot, which keeps a region of the class assigned.
  absl::StatusOr<SlotRef> held = pool.Allocate(bytes);
  for (auto _ : state) {
    absl::StatusOr<SlotRef> r = pool.Allocate(bytes);
    benchmark::DoNotOptimize(r);
    if (!pool.Free(*r).ok()) state.SkipWithError("free failed");
  }
  if (!pool.Free(*held).ok()) state.SkipWithError("free failed");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PoolAllocateFreeWarm)->Arg(64 << 10)->Arg(2 << 20)->Threads(1)->Threads(2);

void BM_PoolBatch(benchmark::State& state) {
  std::unique_ptr<HostPool> pool = MakePool();
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  std::vector<SlotRef> refs(kBatch);
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) refs[i] = *pool->Allocate(bytes);
    for (int i = 0; i < kBatch; ++i) {
      if (!pool->Free(refs[i]).ok()) state.SkipWithError("free failed");
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_PoolBatch)->Arg(64 << 10)->Arg(2 << 20);

void BM_MallocFree(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_MallocFree)->Arg(64 << 10)->Arg(2 << 20);

void BM_MallocBatch(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<void*> ptrs(kBatch);
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) ptrs[i] = std::malloc(bytes);
    benchmark::DoNotOptimize(ptrs.data());
    for (int i = 0; i < kBatch; ++i) std::free(ptrs[i]);
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_MallocBatch)->Arg(64 << 10)->Arg(2 << 20);

}  // namespace
}  // namespace kvcellar::core
