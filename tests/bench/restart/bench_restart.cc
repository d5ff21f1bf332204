// kvcellar_bench_restart: how long a warm restart of L2 takes (issue 15), against the time to map
// and touch the same pool alone, in the same run.
//
// Setup (untimed, once): a pool of --restart_pool_gib GiB (default 16) in a named shm object with
// its slot journal beside it, filled with 64 KiB page objects (64 KiB is the smallest default
// size class, so the most records per byte) in chains of 64 pages, each page's bytes written,
// journaled and indexed as a Backup does. Then the "daemon" goes: everything is destroyed and
// nothing is freed, as after a SIGKILL.
//
// Each iteration, in alternating order:
//   touch    map the pool's shm object again and read one byte of every 4 KiB page: the least
//            any restart that re-attaches the memory pays (the page faults of a fresh mapping).
//   restart  what kvcellard does before it is ready: map the pool and the journal, create the
//            allocator, attach the journal, and RecoverL2 (recreate the namespace, read every
//            record, verify every page's CRC-32C, hand the slots back, index every page) with
//            one thread per core, as the daemon does.
// Counters: touch_s, restart_s (recover_s of it in RecoverL2), ratio = restart / touch (goal
// <= 2x), pages recovered, and the journal's size against the pool's (goal <= 1%). Every
// iteration checks that every page came back.
//
// (MADV_POPULATE_READ, faulting the pool in one call per run of slots, was tried in the restart
// and as a baseline: on tmpfs with 4 KiB pages it was no faster than touching, 0.69 s against
// 0.55-0.62 s for 4 GiB, so neither uses it.)
//
// --restart_object_kib=4 --restart_pool_gib=4 gives 1M pages (#29's scale table; 10M would need
// 40 GiB of /dev/shm).
//
// Needs pool_gib of free /dev/shm and memory; the shm objects are removed at exit.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "core/crc32c.h"
#include "core/host_pool.h"
#include "core/kv_layout.h"
#include "core/namespace_spec.h"
#include "core/slot_journal.h"
#include "platform/host_memory.h"
#include "server/l2/l2_recovery.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::bench {
namespace {

constexpr uint64_t kDefaultObjectBytes = 64 << 10;
constexpr uint32_t kChainPages = 64;
constexpr uint64_t kTouchStride = 4096;

uint64_t g_pool_gib = 16;
// --restart_object_kib: the page object size. The default, 64 KiB, is the smallest of the pool's
// default size classes; any other size gets a pool with that one class (4 KiB at least, the slot
// alignment), so that 1M pages fit in 4 GiB (#29's scale figures).
uint64_t g_object_bytes = kDefaultObjectBytes;

std::vector<uint64_t> SlotSizes() {
  return g_object_bytes == kDefaultObjectBytes
             ? core::HostPool::DefaultSlotSizes(core::kDefaultRegionBytes)
             : std::vector<uint64_t>{g_object_bytes};
}

struct Names {
  std::string pool = absl::StrCat("kvc-bench-restart-", getpid());
  std::string journal = pool + ".journal";
};

core::NamespaceSpec Spec() {
  core::NamespaceSpec s;
  s.model_id = "bench-restart";
  s.model_revision = "rev1";
  s.kv_dtype = "bf16";
  s.page_size = 16;
  return s;
}

// Two layers, K and V of 16 KiB per block: 64 KiB page objects.
core::KvLayout Layout() {
  core::KvLayout l;
  for (int i = 0; i < 2; ++i) {
    core::LayerLayout layer;
    layer.k.bytes_per_block = g_object_bytes / 4;
    layer.v = layer.k;
    l.layers.push_back(layer);
  }
  return l;
}

// One daemon's mappings of the pool and the journal, and the allocator over them.
struct Mapped {
  std::unique_ptr<platform::HostMemory> pool_memory;
  std::unique_ptr<platform::HostMemory> journal_memory;
  std::unique_ptr<core::HostPool> pool;
  core::SlotJournalGeometry geometry;
};

absl::StatusOr<Mapped> MapBoth(const Names& names) {
  Mapped m;
  core::HostPoolOptions options;
  options.capacity_bytes = g_pool_gib << 30;
  options.slot_sizes = SlotSizes();
  platform::HostMemoryOptions memory;
  memory.shm_name = names.pool;
  memory.bytes = options.capacity_bytes;
  absl::StatusOr<std::unique_ptr<platform::HostMemory>> pool_memory =
      platform::HostMemory::Map(memory);
  if (!pool_memory.ok()) return pool_memory.status();
  m.pool_memory = *std::move(pool_memory);
  absl::StatusOr<std::unique_ptr<core::HostPool>> pool =
      core::HostPool::Create(options, m.pool_memory->bytes());
  if (!pool.ok()) return pool.status();
  m.pool = *std::move(pool);
  m.geometry = core::SlotJournalGeometry::Of(*m.pool);
  absl::StatusOr<uint64_t> journal_bytes = core::SlotJournal::Bytes(m.geometry);
  if (!journal_bytes.ok()) return journal_bytes.status();
  memory.shm_name = names.journal;
  memory.bytes = (*journal_bytes + 4095) / 4096 * 4096;
  memory.huge_pages = platform::HugePages::kOff;
  absl::StatusOr<std::unique_ptr<platform::HostMemory>> journal_memory =
      platform::HostMemory::Map(memory);
  if (!journal_memory.ok()) return journal_memory.status();
  m.journal_memory = *std::move(journal_memory);
  return m;
}

// The first daemon life: fills the whole pool. Returns the pages written.
absl::StatusOr<uint64_t> Fill(const Names& names) {
  absl::StatusOr<Mapped> m = MapBoth(names);
  if (!m.ok()) return m.status();
  absl::StatusOr<std::unique_ptr<core::SlotJournal>> journal =
      core::SlotJournal::Format(m->geometry, m->journal_memory->bytes());
  if (!journal.ok()) return journal.status();
  m->pool->set_journal(journal->get());
  server::NamespaceRegistry registry(m->pool.get(), core::EvictionPolicyKind::kS3Fifo);
  std::shared_ptr<server::Namespace> ns = registry.GetOrCreate(Spec());
  if (absl::Status s = ns->AdoptLayout(Layout()); !s.ok()) return s;
  core::RadixIndex& index = *ns->index();
  uint64_t pages = 0;
  core::PageKey parent;
  for (;;) {
    core::PageKey key;
    std::memcpy(key.bytes.data(), &pages, sizeof(pages));
    key.bytes[31] = 0x5a;
    absl::StatusOr<core::SlotRef> slot = m->pool->Allocate(g_object_bytes, {key, ns->id(), 0});
    if (!slot.ok()) break;  // Full.
    const std::optional<core::PageKey> p =
        pages % kChainPages == 0 ? std::nullopt : std::optional(parent);
    const core::WriteRequest w{key, p, 0, *slot, core::WriteKind::kBackup};
    if (absl::Status s = index.BeginWrite(w); !s.ok()) return s;
    (*journal)->MarkWriting(*slot, ns->id(), ns->geometry_epoch(), 0, key, p);
    uint64_t* words = reinterpret_cast<uint64_t*>(m->pool->Address(*slot));
    for (uint64_t i = 0; i < g_object_bytes / 8; ++i) {
      words[i] = pages * 0x9e3779b97f4a7c15ull + i;
    }
    (*journal)->MarkCommitted(*slot, g_object_bytes,
                              core::Crc32c(m->pool->Address(*slot), g_object_bytes));
    if (absl::Status s = index.Commit({key, 0}); !s.ok()) return s;
    parent = key;
    ++pages;
  }
  return pages;  // Destroyed without freeing anything: a SIGKILL.
}

// The baseline: map the pool and read one byte of every page.
double TouchSeconds(const Names& names) {
  const absl::Time start = absl::Now();
  platform::HostMemoryOptions memory;
  memory.shm_name = names.pool;
  memory.bytes = g_pool_gib << 30;
  absl::StatusOr<std::unique_ptr<platform::HostMemory>> mapped = platform::HostMemory::Map(memory);
  if (!mapped.ok()) return -1;
  const uint8_t* p = (*mapped)->data();
  uint64_t sum = 0;
  for (uint64_t off = 0; off < (*mapped)->size(); off += kTouchStride) sum += p[off];
  benchmark::DoNotOptimize(sum);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return seconds;  // Unmapped after the clock stopped, as the restart's mapping stays.
}

double g_recover_seconds = 0;  // Of the restarts: RecoverL2 alone (the rest maps and attaches).

absl::StatusOr<double> RestartSeconds(const Names& names, uint64_t want_pages) {
  const absl::Time start = absl::Now();
  absl::StatusOr<Mapped> m = MapBoth(names);
  if (!m.ok()) return m.status();
  absl::StatusOr<std::unique_ptr<core::SlotJournal>> journal =
      core::SlotJournal::Attach(m->geometry, m->journal_memory->bytes());
  if (!journal.ok()) return journal.status();
  m->pool->set_journal(journal->get());
  server::NamespaceRegistry registry(m->pool.get(), core::EvictionPolicyKind::kS3Fifo);
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const server::L2RecoveryStats stats =
      server::RecoverL2(*m->pool, **journal, registry, threads);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  g_recover_seconds += stats.seconds;
  if (stats.pages != want_pages || stats.dropped() != 0) {
    return absl::InternalError(absl::StrCat("recovered ", stats.pages, " of ", want_pages,
                                            " pages, dropped ", stats.dropped()));
  }
  return seconds;
}

void BM_WarmRestart(benchmark::State& state) {
  const Names names;
  absl::StatusOr<uint64_t> pages = Fill(names);
  if (!pages.ok()) {
    state.SkipWithError(pages.status().ToString().c_str());
  }
  double touch = 0, restart = 0;
  int64_t i = 0;
  for (auto _ : state) {
    if (!pages.ok()) break;
    double t = 0;
    absl::StatusOr<double> r = 0.0;
    if (i++ % 2 == 0) {
      t = TouchSeconds(names);
      r = RestartSeconds(names, *pages);
    } else {
      r = RestartSeconds(names, *pages);
      t = TouchSeconds(names);
    }
    if (!r.ok() || t < 0) {
      state.SkipWithError(r.ok() ? "cannot map the pool" : r.status().ToString().c_str());
      break;
    }
    touch += t;
    restart += *r;
    state.SetIterationTime(*r);
  }
  (void)platform::HostMemory::UnlinkShm(names.pool);
  (void)platform::HostMemory::UnlinkShm(names.journal);
  if (!pages.ok() || state.iterations() == 0) return;
  const double n = static_cast<double>(state.iterations());
  absl::StatusOr<uint64_t> journal_bytes = core::SlotJournal::Bytes(
      {g_pool_gib << 30, core::kDefaultRegionBytes,
       static_cast<uint32_t>((g_pool_gib << 30) / core::kDefaultRegionBytes), SlotSizes()});
  state.counters["pool_GiB"] = static_cast<double>(g_pool_gib);
  state.counters["pages"] = static_cast<double>(*pages);
  state.counters["touch_s"] = touch / n;
  state.counters["restart_s"] = restart / n;
  state.counters["recover_s"] = g_recover_seconds / n;
  state.counters["ratio"] = restart / touch;
  state.counters["object_KiB"] = static_cast<double>(g_object_bytes >> 10);
  // What each page adds to a restart beyond re-attaching its memory.
  state.counters["us_per_page_beyond_touch"] = 1e6 * (restart - touch) / n / double(*pages);
  state.counters["journal_pct_of_pool"] =
      journal_bytes.ok() ? 100.0 * static_cast<double>(*journal_bytes) / (g_pool_gib << 30) : -1;
}
BENCHMARK(BM_WarmRestart)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvcellar::bench

int main(int argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (absl::StartsWith(a, "--restart_pool_gib=")) {
      if (!absl::SimpleAtoi(a.substr(19), &kvcellar::bench::g_pool_gib) ||
          kvcellar::bench::g_pool_gib == 0) {
        std::fprintf(stderr, "kvcellar_bench_restart: bad %s\n", a.c_str());
        return 2;
      }
    } else if (absl::StartsWith(a, "--restart_object_kib=")) {
      uint64_t kib = 0;
      if (!absl::SimpleAtoi(a.substr(21), &kib) || kib == 0 || kib % 4 != 0 || kib > 64 * 1024) {
        std::fprintf(stderr, "kvcellar_bench_restart: bad %s (want a multiple of 4, <= 65536)\n",
                     a.c_str());
        return 2;
      }
      kvcellar::bench::g_object_bytes = kib << 10;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
