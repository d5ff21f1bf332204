// BM_Concurrent: RPC throughput of one client against N concurrent clients (BenchConfig::clients,
// 8 by default), both phases in the same benchmark run. Each client is a thread with its own
// Client (own channel and connection), sim engine and session, as N engine ranks or processes
// on one node would be.
//
//   match2048      Session::Match with the token ids of a 2048-page prompt at page size 16 (every
//                  page an L2 hit; the client hashes its keys): Match calls per second.
//   load_backup    per loop, Backup 32 fresh pages and WaitOps, then Load 32 pages backed up
//                  and pinned before (as after a Match with pin) and WaitOps; page objects of
//                  64 KiB over 32 layers (2 MiB per op). Ops (Backup or Load, each to DONE) per
//                  second, and GB/s.
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "tests/bench/datapath/benchmarks.h"

namespace kvcellar::bench {
namespace {

constexpr uint32_t kMatchPages = 2048;
constexpr uint32_t kMatchPageSize = 16;
constexpr uint32_t kMixPages = 32;
constexpr uint32_t kMixLayers = 32;
constexpr uint64_t kMixBytesPerBlock = 1024;  // 32 layers x K,V x 1 KiB = 64 KiB objects.
constexpr absl::Duration kOpWait = absl::Seconds(60);

enum class Workload { kMatch, kLoadBackup };

struct PhaseResult {
  double ops_per_s = 0;
  double gbps = 0;
  double p50_us = 0;
  double p99_us = 0;
  uint64_t failures = 0;  // Misses where hits were expected, ops not DONE.
  std::string error;
};

// One client: its engine rank and the loop it runs. Prepare runs on the main thread, Run on the
// client's own thread; the results are read after that thread is joined.
class Worker {
 public:
  Worker(DatapathEnv* env, SimEngineRank rank, Workload w)
      : env_(env), rank_(std::move(rank)), w_(w) {}

  absl::Status Prepare(const std::vector<uint32_t>& tokens) {
    tokens_ = &tokens;
    if (w_ == Workload::kMatch) return absl::OkStatus();
    load_keys_.resize(kMixPages);
    for (core::PageKey& k : load_keys_) k = env_->NextKey();
    // Pinned, as an engine's Match pins the hit it is about to Load: the others' Backups then
    // evict other pages, never the load set.
    absl::StatusOr<uint64_t> pin = CacheAndPin(*rank_.session, load_keys_);
    if (!pin.ok()) return pin.status();
    pin_ = *pin;
    return absl::OkStatus();
  }

  ~Worker() {
    if (pin_ != 0) rank_.session->Release({pin_});
  }

  void Run(absl::Time end) {
    client::Session& s = *rank_.session;
    while (absl::Now() < end) {
      if (w_ == Workload::kMatch) {
        client::MatchSequence ms;
        ms.tokens = *tokens_;
        const absl::Time t0 = absl::Now();
        const client::MatchReply m = s.Match({ms});
        us_.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
        if (m.results[0].l2_hit_pages != kMatchPages) ++failures_;
        continue;
      }
      std::vector<core::PageKey> fresh(kMixPages);
      for (core::PageKey& k : fresh) k = env_->NextKey();
      client::BackupSequence bs;
      bs.keys = fresh;
      bs.blocks = src_;
      absl::Time t0 = absl::Now();
      client::OpResult b = WaitTerminal(s, s.Backup({bs}), kOpWait);
      us_.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (b.usable_pages(0) != kMixPages) ++failures_;
      bytes_ += uint64_t{b.usable_pages(0)} * rank_.sim->page_bytes();
      client::LoadSequence ls;
      ls.keys = load_keys_;
      ls.blocks = dst_;
      ls.pin_id = pin_;
      t0 = absl::Now();
      client::OpResult l = WaitTerminal(s, s.Load({ls}), kOpWait);
      us_.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      bytes_ += uint64_t{l.usable_pages(0)} * rank_.sim->page_bytes();
      if (l.usable_pages(0) != kMixPages) ++failures_;
    }
  }

  std::vector<double>& us() { return us_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t failures() const { return failures_; }

 private:
  DatapathEnv* env_;
  SimEngineRank rank_;
  Workload w_;
  const std::vector<uint32_t>* tokens_ = nullptr;
  std::vector<core::PageKey> load_keys_;
  uint64_t pin_ = 0;  // Over load_keys_.
  const std::vector<uint32_t> src_ = BlockRange(0, kMixPages);
  const std::vector<uint32_t> dst_ = BlockRange(kMixPages, kMixPages);
  std::vector<double> us_;
  uint64_t bytes_ = 0;
  uint64_t failures_ = 0;
};

EngineSpec SpecOf(Workload w, bool first) {
  EngineSpec spec;
  if (w == Workload::kMatch) {
    spec.model = "bench-match";  // The namespace BM_Match uses: its prompt may be cached already.
    spec.page_size = kMatchPageSize;
    spec.layers = 2;
    spec.bytes_per_block = 1024;
    spec.blocks = first ? kMatchPages : 1;  // The first rank backs the prompt up.
  } else {
    spec.model = "bench-mix";
    spec.opaque_keys = true;
    spec.layers = kMixLayers;
    spec.bytes_per_block = kMixBytesPerBlock;
    spec.blocks = 2 * kMixPages;
  }
  return spec;
}

PhaseResult RunPhase(DatapathEnv* env, Workload w, int clients, absl::Duration duration,
                     const std::vector<uint32_t>& tokens) {
  PhaseResult out;
  std::vector<std::unique_ptr<Worker>> workers;
  // The first rank caches the prompt and pins it (CacheAndPin) until the phase ends.
  uint64_t pin = 0;
  client::Session* pinner = nullptr;
  struct Unpin {
    client::Session** s;
    uint64_t* id;
    ~Unpin() {
      if (*s != nullptr) (*s)->Release({*id});
    }
  } unpin{&pinner, &pin};
  for (int i = 0; i < clients; ++i) {
    absl::StatusOr<SimEngineRank> rank = env->RegisterEngine(SpecOf(w, i == 0));
    if (rank.ok() && i == 0 && w == Workload::kMatch) {
      absl::StatusOr<uint64_t> p = CacheAndPin(*rank->session, rank->session->ComputeKeys(tokens));
      if (!p.ok()) {
        out.error = p.status().ToString();
        return out;
      }
      pin = *p;
      pinner = rank->session.get();
    }
    if (!rank.ok()) {
      out.error = rank.status().ToString();
      return out;
    }
    workers.push_back(std::make_unique<Worker>(env, *std::move(rank), w));
    if (absl::Status s = workers.back()->Prepare(tokens); !s.ok()) {
      out.error = s.ToString();
      return out;
    }
  }
  absl::Notification go;
  std::vector<std::thread> threads;
  absl::Time start, end;
  for (auto& worker : workers) {
    threads.emplace_back([&, wp = worker.get()] {
      go.WaitForNotification();
      wp->Run(end);
    });
  }
  start = absl::Now();
  end = start + duration;
  go.Notify();
  for (std::thread& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::vector<double> all;
  uint64_t bytes = 0;
  for (auto& worker : workers) {
    all.insert(all.end(), worker->us().begin(), worker->us().end());
    bytes += worker->bytes();
    out.failures += worker->failures();
  }
  out.ops_per_s = all.size() / seconds;
  out.gbps = bytes / seconds / 1e9;
  out.p50_us = Quantile(&all, 0.5);
  out.p99_us = Quantile(&all, 0.99);
  return out;
}

void RunConcurrent(benchmark::State& state, DatapathEnv* env, Summary* summary,
                   const BenchConfig& config, Workload w) {
  const std::vector<uint32_t> tokens =
      PromptTokens(kMatchPageSize, size_t{kMatchPages} * kMatchPageSize);
  const absl::Duration duration = absl::Seconds(config.concurrent_seconds);
  PhaseResult one, many;
  for (auto _ : state) {
    one = RunPhase(env, w, 1, duration, tokens);
    many = RunPhase(env, w, config.clients, duration, tokens);
    state.SetIterationTime(2 * config.concurrent_seconds);
  }
  for (const PhaseResult* r : {&one, &many}) {
    if (!r->error.empty()) {
      state.SkipWithError(r->error.c_str());
      return;
    }
  }
  state.counters["ops_per_s_1"] = one.ops_per_s;
  state.counters["ops_per_s_N"] = many.ops_per_s;
  state.counters["scaling"] = many.ops_per_s / one.ops_per_s;
  state.counters["p50_us_1"] = one.p50_us;
  state.counters["p50_us_N"] = many.p50_us;
  state.counters["p99_us_N"] = many.p99_us;
  state.counters["failures"] = one.failures + many.failures;
  // Misses (a Match that did not hit every page, a Backup or Load that did not move every page)
  // should not happen; they are said next to the figure.
  const uint64_t failures = one.failures + many.failures;
  const std::string n = absl::StrCat(" (N=", config.clients, ")",
                                     failures > 0 ? absl::StrCat(", ", failures, " misses") : "");
  if (w == Workload::kMatch) {
    summary->AddThroughput(absl::StrCat("Match 2048 pages, P=16, client hashes", n), "calls/s",
                           config.clients, one.ops_per_s, many.ops_per_s, many.p50_us, many.p99_us);
  } else {
    state.counters["GBps_1"] = one.gbps;
    state.counters["GBps_N"] = many.gbps;
    summary->AddThroughput(absl::StrCat("Backup+Load 32 x 64 KiB pages per op", n), "ops/s",
                           config.clients, one.ops_per_s, many.ops_per_s, many.p50_us, many.p99_us);
    summary->AddThroughput(absl::StrCat("  same, bytes moved", n), "MB/s", config.clients,
                           one.gbps * 1e3, many.gbps * 1e3, many.p50_us, many.p99_us);
  }
}

}  // namespace

void RegisterConcurrencyBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config) {
  for (Workload w : {Workload::kMatch, Workload::kLoadBackup}) {
    benchmark::RegisterBenchmark(
        w == Workload::kMatch ? "BM_Concurrent/match2048" : "BM_Concurrent/load_backup",
        [=](benchmark::State& state) { RunConcurrent(state, env, summary, config, w); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace kvcellar::bench
