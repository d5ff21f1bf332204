// Benchmarks of core/radix_index.h, each beside a baseline that does strictly less work.
//
//  - BM_Match2048: a 2048-page Match on an index of 1M pages (512 prompts x 2048 pages; target
//    <= 60 us), beside BM_UnorderedMapLookup2048 / BM_FlatHashMapLookup2048: plain lookups of the
//    same 2048 keys in a 1M-entry map, the floor for any key-to-state index. Prompts rotate, so
//    most lookups miss the CPU caches as they would on a large index.
//  - BM_InsertEvict: steady state at 100k resident pages: insert a 64-page prompt (BeginWrite +
//    Commit), then evict 64 pages through the policy (target >= 2M pages/s), beside
//    BM_UnorderedMapLruInsertEvict, the textbook LRU cache (unordered_map + std::list): no tree,
//    no shards, no pins, no in-flight state.
//  - BM_IndexMemoryPerObject: heap bytes per indexed (page, shard) object, measured with mallinfo2
//    around building the index (target <= 256), with the index's own estimate beside it.
//
//  - BM_IndexScale: memory per page and Match latency at 1M and 10M pages (and 50M with
//    KVCELLAR_BENCH_50M=1), against a flat_hash_map of the same keys and the 1M-page latency (#29
//    item 3).
//
// Run: kvcellar_bench_core --benchmark_filter='Match|Lookup|InsertEvict|Memory'
//      --benchmark_min_time=0.2
//      kvcellar_bench_core --benchmark_filter='IndexScale/'     # 1M and 10M, about a minute
#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <random>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "core/radix_index.h"

namespace kvcellar::core {
namespace {

constexpr int kPromptPages = 2048;
constexpr int kPrompts = 512;  // 512 x 2048 = 1M pages.

PageKey BenchKey(uint64_t id) {
  PageKey k;
  const uint64_t a = id * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  const uint64_t b = (a ^ (a >> 29)) * 0xbf58476d1ce4e5b9ull;
  std::memcpy(k.bytes.data(), &a, 8);
  std::memcpy(k.bytes.data() + 8, &b, 8);
  std::memcpy(k.bytes.data() + 16, &id, 8);
  return k;
}

std::unique_ptr<RadixIndex> MakeIndex(EvictionPolicyKind policy, int shards) {
  RadixIndexOptions o;
  o.shards_per_page = shards;
  o.l3_tiers = 1;
  o.object_bytes = 1;
  o.policy = policy;
  return std::move(*RadixIndex::Create(o));
}

// Inserts `keys` as one chain, all `shards` committed; batched as the server does.
void InsertChain(RadixIndex& index, const std::vector<PageKey>& keys, int shards,
                 uint32_t* next_slot, std::vector<WriteRequest>* reqs, std::vector<ObjectId>* objs,
                 std::vector<absl::Status>* st) {
  reqs->clear();
  objs->clear();
  std::optional<PageKey> parent;
  for (const PageKey& k : keys) {
    for (int s = 0; s < shards; ++s) {
      reqs->push_back({k, parent, static_cast<uint16_t>(s), SlotRef{0, 0, (*next_slot)++}});
      objs->push_back({k, static_cast<uint16_t>(s)});
    }
    parent = k;
  }
  st->resize(reqs->size());
  index.BeginWrite(*reqs, absl::MakeSpan(*st));
  index.Commit(*objs, absl::MakeSpan(*st));
}

// How the nodes of one prompt lie in memory (the order its pages were inserted in):
enum Layout {
  // Each prompt in one batch: its nodes are adjacent (a Backup batch of a whole prompt).
  kSequential = 0,
  // Runs of 64 pages of random prompts, interleaved (chunked prefill backing up 64 pages of
  // each running request per scheduler step).
  kRuns64 = 1,
  // Page by page from random prompts: consecutive pages ~512 nodes apart at random distances
  // (the worst case: every child link is a cache miss).
  kRandom = 2,
};
constexpr const char* kLayoutNames[] = {"sequential", "runs64", "random"};

// Prompt p grows by `run` pages at a time, prompts chosen at random; calls add(p, i) in order.
template <typename Add>
void InterleavedOrder(int run, Add add) {
  std::mt19937_64 rng(42);
  std::vector<int> next(kPrompts, 0);
  std::vector<int> open(kPrompts);
  for (int p = 0; p < kPrompts; ++p) open[p] = p;
  while (!open.empty()) {
    const size_t o = rng() % open.size();
    const int p = open[o];
    for (int k = 0; k < run && next[p] < kPromptPages; ++k) add(p, next[p]++);
    if (next[p] == kPromptPages) {
      open[o] = open.back();
      open.pop_back();
    }
  }
}

int LayoutRun(Layout layout) {
  return layout == kSequential ? kPromptPages : layout == kRuns64 ? 64 : 1;
}

// A 1M-page index, built on first use and shared by the Match benchmarks.
struct MatchFixture {
  std::vector<std::vector<PageKey>> prompts;
  std::unique_ptr<RadixIndex> index;

  MatchFixture(EvictionPolicyKind policy, Layout layout) {
    index = MakeIndex(policy, 1);
    for (int p = 0; p < kPrompts; ++p) {
      std::vector<PageKey> keys;
      for (int i = 0; i < kPromptPages; ++i) keys.push_back(BenchKey(uint64_t(p) << 32 | i));
      prompts.push_back(std::move(keys));
    }
    uint32_t slot = 0;
    std::vector<WriteRequest> reqs;
    std::vector<ObjectId> objs;
    std::vector<absl::Status> st;
    InterleavedOrder(LayoutRun(layout), [&](int p, int i) {
      std::optional<PageKey> parent;
      if (i > 0) parent = prompts[p][i - 1];
      reqs.push_back({prompts[p][i], parent, 0, SlotRef{0, 0, slot++}});
      objs.push_back({prompts[p][i], 0});
      if (reqs.size() == 256) {
        st.resize(reqs.size());
        index->BeginWrite(reqs, absl::MakeSpan(st));
        index->Commit(objs, absl::MakeSpan(st));
        reqs.clear();
        objs.clear();
      }
    });
    st.resize(reqs.size());
    index->BeginWrite(reqs, absl::MakeSpan(st));
    index->Commit(objs, absl::MakeSpan(st));
  }
  static MatchFixture& Get(EvictionPolicyKind policy, Layout layout = kSequential) {
    static MatchFixture* fixtures[3][3] = {};
    MatchFixture*& f = fixtures[static_cast<int>(policy)][layout];
    if (f == nullptr) f = new MatchFixture(policy, layout);
    return *f;
  }
};

void BM_Match2048(benchmark::State& state) {
  const auto policy = static_cast<EvictionPolicyKind>(state.range(0));
  const bool pin = state.range(1) != 0;
  const auto layout = static_cast<Layout>(state.range(2));
  MatchFixture& f = MatchFixture::Get(policy, layout);
  const absl::Time deadline = absl::Now() + absl::Hours(1);
  size_t p = 0;
  uint64_t hits = 0;
  for (auto _ : state) {
    const std::vector<PageKey>& keys = f.prompts[p];
    MatchOptions opts;
    if (pin) opts.pin = PinLease{7, deadline};
    absl::StatusOr<MatchResult> r = f.index->Match(keys, opts);
    hits += r->l2_pages;
    if (pin) f.index->Unpin(7, keys);
    p = (p + 37) % f.prompts.size();  // Stride: consecutive iterations touch distant prompts.
  }
  if (hits != uint64_t(state.iterations()) * kPromptPages) state.SkipWithError("Match missed");
  state.SetItemsProcessed(state.iterations() * kPromptPages);
  state.SetLabel(std::string(EvictionPolicyKindName(policy)) + (pin ? " +pin+unpin " : " ") +
                 kLayoutNames[layout]);
  state.counters["index_pages"] = static_cast<double>(f.index->Stats().pages);
}
BENCHMARK(BM_Match2048)
    ->ArgNames({"policy", "pin", "layout"})
    ->Args({int(EvictionPolicyKind::kAdaptive), 0, kSequential})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 0, kSequential})
    ->Args({int(EvictionPolicyKind::kLru), 0, kSequential})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 1, kSequential})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 0, kRuns64})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 0, kRandom})
    ->Args({int(EvictionPolicyKind::kLru), 0, kRandom})
    ->Unit(benchmark::kMicrosecond);

// The same shared index matched by several threads: the cost of the single index mutex.
void BM_Match2048Contended(benchmark::State& state) {
  MatchFixture& f = MatchFixture::Get(EvictionPolicyKind::kS3Fifo);
  size_t p = static_cast<size_t>(state.thread_index()) * 101;
  for (auto _ : state) {
    benchmark::DoNotOptimize(f.index->Match(f.prompts[p % kPrompts], MatchOptions{}));
    p += 37;
  }
  state.SetItemsProcessed(state.iterations() * kPromptPages);
}
BENCHMARK(BM_Match2048Contended)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

struct LookupValue {
  SlotRef slot;
  uint32_t flags;
};

template <typename Map>
void LookupBaseline(benchmark::State& state, Map& map) {
  MatchFixture& f = MatchFixture::Get(EvictionPolicyKind::kS3Fifo);  // The same keys.
  const auto layout = static_cast<Layout>(state.range(0));
  if (map.empty()) {
    // Inserted in the index's order, so node-based maps get the same layout.
    map.reserve(size_t{kPrompts} * kPromptPages);
    InterleavedOrder(LayoutRun(layout), [&](int p, int i) {
      map[f.prompts[p][i]] = LookupValue{SlotRef{0, 0, 1}, 1};
    });
  }
  state.SetLabel(kLayoutNames[layout]);
  size_t p = 0;
  uint64_t hits = 0;
  for (auto _ : state) {
    // Longest prefix present: stop at the first miss, as Match does.
    for (const PageKey& k : f.prompts[p]) {
      auto it = map.find(k);
      if (it == map.end() || !it->second.slot.valid()) break;
      ++hits;
    }
    p = (p + 37) % f.prompts.size();
  }
  benchmark::DoNotOptimize(hits);
  state.SetItemsProcessed(state.iterations() * kPromptPages);
}

void BM_UnorderedMapLookup2048(benchmark::State& state) {
  static std::unordered_map<PageKey, LookupValue, PageKeyHash> maps[3];
  LookupBaseline(state, maps[state.range(0)]);
}
BENCHMARK(BM_UnorderedMapLookup2048)
    ->ArgName("layout")
    ->Arg(kSequential)
    ->Arg(kRuns64)
    ->Arg(kRandom)
    ->Unit(benchmark::kMicrosecond);

void BM_FlatHashMapLookup2048(benchmark::State& state) {
  static absl::flat_hash_map<PageKey, LookupValue> map;  // Flat: the layout does not apply.
  LookupBaseline(state, map);
}
BENCHMARK(BM_FlatHashMapLookup2048)->ArgName("layout")->Arg(0)->Unit(benchmark::kMicrosecond);

// --- Insert + evict ----------------------------------------------------------------------------

constexpr int kSteadyPages = 100'000;
constexpr int kBatchPages = 64;

void BM_InsertEvict(benchmark::State& state) {
  const auto policy = static_cast<EvictionPolicyKind>(state.range(0));
  const int shards = static_cast<int>(state.range(1));
  auto index = MakeIndex(policy, shards);
  uint32_t slot = 0;
  uint64_t next_key = 0;
  std::vector<WriteRequest> reqs;
  std::vector<ObjectId> objs;
  std::vector<absl::Status> st;
  std::vector<PageKey> keys(kBatchPages);
  std::vector<ReleasedObject> evicted;
  auto fresh_keys = [&] {
    for (PageKey& k : keys) k = BenchKey(next_key++);
  };
  for (int i = 0; i < kSteadyPages / kBatchPages; ++i) {
    fresh_keys();
    InsertChain(*index, keys, shards, &slot, &reqs, &objs, &st);
  }
  for (auto _ : state) {
    fresh_keys();
    InsertChain(*index, keys, shards, &slot, &reqs, &objs, &st);
    evicted.clear();
    if (index->EvictPages(kBatchPages, &evicted) != kBatchPages) {
      state.SkipWithError("eviction fell short");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatchPages);
  state.SetLabel(std::string(EvictionPolicyKindName(policy)));
  state.counters["objects_per_page"] = shards;
}
BENCHMARK(BM_InsertEvict)
    ->ArgNames({"policy", "shards"})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 1})
    ->Args({int(EvictionPolicyKind::kLru), 1})
    ->Args({int(EvictionPolicyKind::kAdaptive), 1})
    ->Args({int(EvictionPolicyKind::kS3Fifo), 8});

// The textbook LRU cache: a hash map from key to a list node, the list in recency order.
void BM_UnorderedMapLruInsertEvict(benchmark::State& state) {
  struct Entry {
    PageKey key;
    SlotRef slot;
  };
  std::list<Entry> lru;
  std::unordered_map<PageKey, std::list<Entry>::iterator, PageKeyHash> map;
  map.reserve(kSteadyPages * 2);
  uint64_t next_key = 0;
  uint32_t slot = 0;
  auto insert = [&] {
    const PageKey k = BenchKey(next_key++);
    lru.push_front({k, SlotRef{0, 0, slot++}});
    map.emplace(k, lru.begin());
  };
  for (int i = 0; i < kSteadyPages; ++i) insert();
  for (auto _ : state) {
    for (int i = 0; i < kBatchPages; ++i) insert();
    for (int i = 0; i < kBatchPages; ++i) {
      map.erase(lru.back().key);
      lru.pop_back();
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatchPages);
}
BENCHMARK(BM_UnorderedMapLruInsertEvict);

// --- Memory ------------------------------------------------------------------------------------

size_t HeapBytes() {
  const struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;  // Small allocations plus mmapped chunks.
}

void BM_IndexMemoryPerObject(benchmark::State& state) {
  const int shards = static_cast<int>(state.range(0));
  const int pages = static_cast<int>(state.range(1));
  double measured = 0, estimated = 0;
  for (auto _ : state) {
    // The key and request vectors are built before the first measurement and reused.
    std::vector<std::vector<PageKey>> prompts(pages / kPromptPages);
    for (size_t p = 0; p < prompts.size(); ++p) {
      for (int i = 0; i < kPromptPages; ++i) {
        prompts[p].push_back(BenchKey(uint64_t(p + 1000) << 32 | i));
      }
    }
    std::vector<WriteRequest> reqs;
    std::vector<ObjectId> objs;
    std::vector<absl::Status> st;
    reqs.reserve(size_t{kPromptPages} * shards);
    objs.reserve(size_t{kPromptPages} * shards);
    st.reserve(size_t{kPromptPages} * shards);
    uint32_t slot = 0;
    const size_t before = HeapBytes();
    auto index = MakeIndex(EvictionPolicyKind::kS3Fifo, shards);
    for (const auto& keys : prompts) InsertChain(*index, keys, shards, &slot, &reqs, &objs, &st);
    const size_t after = HeapBytes();
    const double objects = double(index->Stats().l2_objects);
    measured = double(after - before) / objects;
    estimated = double(index->Stats().memory_bytes) / objects;
  }
  state.counters["bytes_per_object"] = measured;
  state.counters["bytes_per_object_estimate"] = estimated;
  state.counters["bytes_per_page"] = measured * shards;
  state.counters["shards"] = shards;
}
BENCHMARK(BM_IndexMemoryPerObject)
    ->ArgNames({"shards", "pages"})
    ->Args({1, 1 << 20})
    ->Args({8, 1 << 17})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// --- Scale ---------------------------------------------------------------------------------------

// The index at `pages` pages (chains of kPromptPages, one shard, as BM_IndexMemoryPerObject builds
// them), against the same run's baselines: an absl::flat_hash_map of the same keys (the memory
// any key-to-state map needs), and the index's own Match latency at 1M pages (the first size,
// measured first; the ratio says how latency grows).
//   heap_bytes_per_page   the index's heap (mallinfo2 around the build) per page
//   map_bytes_per_key     a flat_hash_map<PageKey, LookupValue> of the same keys, per key
//   beyond_key_bytes      heap_bytes_per_page - 32: what a page costs beyond its key
//   match_p50_us / p99    a 2048-page Match of a random indexed prompt (L2 hits all along)
//   match_vs_1m           match_p50_us / the 1M-page figure of this run
//   backup_p50_us / p99   BeginWrite + Commit of a 2048-page turn under an indexed prompt
//   backup_vs_1m          backup_p50_us / the 1M-page figure of this run
//   estimate_bytes_per_page  the index's own account (Stats().memory_bytes), per page
//   build_ns_per_page     inserting (BeginWrite + Commit, 2048-page chains)
// 10M pages take about 2 GB and a minute; 50M (10 GB) only with KVCELLAR_BENCH_50M=1:
//   KVCELLAR_BENCH_50M=1 kvcellar_bench_core --benchmark_filter=IndexScale
double& MatchP50At1M() {
  static double v = 0;
  return v;
}

double& BackupP50At1M() {
  static double v = 0;
  return v;
}

void BM_IndexScale(benchmark::State& state) {
  const size_t pages = static_cast<size_t>(state.range(0));
  const size_t prompts = pages / kPromptPages;
  double heap_per_page = 0, estimate_per_page = 0, map_per_key = 0, build_ns = 0, p50 = 0, p99 = 0,
         backup_p50 = 0, backup_p99 = 0;
  for (auto _ : state) {
    auto prompt_key = [](size_t p, int i) { return BenchKey(uint64_t(p + 7) << 32 | i); };
    std::vector<PageKey> keys(kPromptPages);
    std::vector<WriteRequest> reqs;
    std::vector<ObjectId> objs;
    std::vector<absl::Status> st;
    uint32_t slot = 0;
    const size_t before = HeapBytes();
    auto index = MakeIndex(EvictionPolicyKind::kS3Fifo, 1);
    const absl::Time t0 = absl::Now();
    for (size_t p = 0; p < prompts; ++p) {
      for (int i = 0; i < kPromptPages; ++i) keys[i] = prompt_key(p, i);
      InsertChain(*index, keys, 1, &slot, &reqs, &objs, &st);
    }
    build_ns = absl::ToDoubleNanoseconds(absl::Now() - t0) / double(pages);
    reqs = {};
    objs = {};
    st = {};
    heap_per_page = double(HeapBytes() - before) / double(index->Stats().pages);
    estimate_per_page = double(index->Stats().memory_bytes) / double(index->Stats().pages);
    {
      const size_t map_before = HeapBytes();
      absl::flat_hash_map<PageKey, LookupValue> map;
      map.reserve(pages);
      for (size_t p = 0; p < prompts; ++p) {
        for (int i = 0; i < kPromptPages; ++i) map[prompt_key(p, i)] = {SlotRef{0, 0, 1}, 1};
      }
      map_per_key = double(HeapBytes() - map_before) / double(map.size());
    }
    std::mt19937_64 rng(5);
    std::vector<double> us;
    for (int m = 0; m < 2000; ++m) {
      const size_t p = rng() % prompts;
      for (int i = 0; i < kPromptPages; ++i) keys[i] = prompt_key(p, i);
      const absl::Time m0 = absl::Now();
      absl::StatusOr<MatchResult> r = index->Match(keys, MatchOptions{});
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - m0));
      if (!r.ok() || r->l2_pages != size_t{kPromptPages}) {
        state.SkipWithError("Match missed");
        return;
      }
    }
    std::sort(us.begin(), us.end());
    p50 = us[us.size() / 2];
    p99 = us[us.size() * 99 / 100];
    // Backup: a conversation's next turn, 2048 new pages under a random indexed prompt's last
    // page (BeginWrite and Commit, as the daemon's Backup does; measured last, after the memory).
    us.clear();
    for (int b = 0; b < 100; ++b) {
      const size_t p = rng() % prompts;
      reqs.clear();
      objs.clear();
      std::optional<PageKey> parent = prompt_key(p, kPromptPages - 1);
      for (int i = 0; i < kPromptPages; ++i) {
        const PageKey k = prompt_key(prompts + size_t(b), i);
        reqs.push_back({k, parent, 0, SlotRef{0, 0, slot++}});
        objs.push_back({k, 0});
        parent = k;
      }
      st.resize(reqs.size());
      const absl::Time b0 = absl::Now();
      const size_t begun = index->BeginWrite(reqs, absl::MakeSpan(st));
      const size_t committed = index->Commit(objs, absl::MakeSpan(st));
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - b0));
      if (begun != reqs.size() || committed != objs.size()) {
        state.SkipWithError("Backup refused");
        return;
      }
    }
    std::sort(us.begin(), us.end());
    backup_p50 = us[us.size() / 2];
    backup_p99 = us[us.size() * 99 / 100];
  }
  if (pages == (size_t{1} << 20)) {
    MatchP50At1M() = p50;
    BackupP50At1M() = backup_p50;
  }
  state.counters["pages"] = double(pages);
  state.counters["heap_bytes_per_page"] = heap_per_page;
  state.counters["estimate_bytes_per_page"] = estimate_per_page;
  state.counters["map_bytes_per_key"] = map_per_key;
  state.counters["beyond_key_bytes"] = heap_per_page - double(sizeof(PageKey));
  state.counters["build_ns_per_page"] = build_ns;
  state.counters["match_p50_us"] = p50;
  state.counters["match_p99_us"] = p99;
  if (MatchP50At1M() > 0) state.counters["match_vs_1m"] = p50 / MatchP50At1M();
  state.counters["backup_p50_us"] = backup_p50;
  state.counters["backup_p99_us"] = backup_p99;
  if (BackupP50At1M() > 0) state.counters["backup_vs_1m"] = backup_p50 / BackupP50At1M();
}
BENCHMARK(BM_IndexScale)
    ->ArgName("pages")
    ->Arg(1 << 20)
    ->Arg(10 << 20)
    ->Iterations(1)
    ->Unit(benchmark::kSecond);
// 50M pages, about 10 GB of heap between the index and the map: registered only when
// KVCELLAR_BENCH_50M is set, so that an unfiltered run never takes that much.
[[maybe_unused]] const auto* const kScale50M =
    std::getenv("KVCELLAR_BENCH_50M") == nullptr
        ? nullptr
        : benchmark::RegisterBenchmark("BM_IndexScale", BM_IndexScale) -> ArgName("pages")
              -> Arg(50 << 20) -> Iterations(1) -> Unit(benchmark::kSecond);

}  // namespace
}  // namespace kvcellar::core
