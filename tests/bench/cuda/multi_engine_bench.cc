// BM_CudaEngines: 1, 4 and 8 engine processes copying at once, each its own pool, mapping (or
// kvcellard session) and host pages, one thread each submitting back to back, as the daemon's RPC
// threads would for engines stepping together. The aggregate bandwidth is set against the link:
// one bulk cudaMemcpy of one engine's batch, timed just before in the same case.
#include <functional>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "tests/bench/cuda/benchmarks.h"

namespace kvcellar::bench {
namespace {

using gpu::testing::PoolShape;

// Untimed Backups that may be retried while the daemon's pool makes room for a new object size.
constexpr int kMaxWarmupBackups = 50;

// One engine's stream of ops: a function that submits one op and waits for it.
using OpFn = std::function<absl::Status()>;

// Waits until `r` is terminal; OK when every one of its `pages` pages is usable.
absl::Status WaitUsable(client::Session& s, client::OpResult r, size_t pages) {
  const absl::Time deadline = absl::Now() + kOpWait;
  while (!r.terminal() && absl::Now() < deadline) {
    client::WaitOptions w;
    w.timeout = absl::Seconds(1);
    w.omit_page_status = true;
    r = s.WaitOps({r.ref}, w)[0];
    // A daemon that cannot answer makes WaitOps return at once: no busy loop until the deadline.
    if (!r.terminal() && !r.status.ok()) absl::SleepFor(absl::Milliseconds(20));
  }
  if (r.usable_pages(0) != pages) {
    return absl::InternalError(absl::StrCat("op ", client::OpStateName(r.state), ", ",
                                            r.usable_pages(0), "/", pages, " pages usable ",
                                            r.status.ok() ? r.error_message : r.status.ToString()));
  }
  return absl::OkStatus();
}

absl::Status BackupKeys(client::Session& s, const std::vector<core::PageKey>& keys,
                        const std::vector<uint32_t>& blocks) {
  client::BackupSequence seq;
  seq.keys = keys;
  seq.blocks = blocks;
  return WaitUsable(s, s.Backup({seq}), keys.size());
}

// A Load of `load_keys` into `blocks`, or a Backup of `blocks` under fresh keys (pages already
// present would not be copied again; the daemon's pool evicts).
absl::Status RunDaemonOp(CudaBenchEnv* env, client::Session& s, bool load,
                         const std::vector<core::PageKey>& load_keys,
                         const std::vector<uint32_t>& blocks) {
  if (!load) return BackupKeys(s, env->Keys(blocks.size()), blocks);
  client::LoadSequence seq;
  seq.keys = load_keys;
  seq.blocks = blocks;
  return WaitUsable(s, s.Load({seq}), blocks.size());
}

void RunEngines(benchmark::State& state, CudaBenchEnv* env, CudaSummary* summary,
                const CudaBenchConfig& config, int n, bool load,
                const std::optional<BackendKey>& key) {
  const uint32_t pages =
      PagesPerOp(config.multi_batch_bytes, config.multi_block_bytes, config.multi_layers);
  const PoolShape shape{config.multi_layers, config.multi_block_bytes, 2 * pages};
  const uint64_t batch = pages * shape.object_bytes();
  std::vector<OpFn> ops(n);
  std::vector<std::vector<gpu::CopyItem>> items(n);
  std::vector<std::vector<core::PageKey>> load_keys(n);
  std::vector<uint32_t> src(pages), dst(pages);
  for (uint32_t i = 0; i < pages; ++i) {
    src[i] = i;
    dst[i] = pages + i;
  }
  // Host pages for the link baseline: the copy-engine backend's, large enough for every engine.
  absl::StatusOr<Backend*> link_host =
      env->GetBackend({gpu::CudaDeviceOptions::CopyPath::kMemcpy}, n * batch);
  absl::Status st = link_host.status();
  Backend* backend = nullptr;
  if (st.ok() && key) {
    absl::StatusOr<Backend*> b = env->GetBackend(*key, n * batch);
    st = b.status();
    if (st.ok()) backend = *b;
  }
  for (int e = 0; e < n && st.ok(); ++e) {
    absl::StatusOr<gpu::testing::CudaEngineProcess*> engine = env->Engine(e, shape);
    if (!engine.ok()) {
      st = engine.status();
      break;
    }
    if (key) {
      absl::StatusOr<gpu::EngineMapping*> m = env->Mapping(backend, e);
      if (!m.ok()) {
        st = m.status();
        break;
      }
      uint8_t* host = backend->host + e * batch;
      for (uint32_t i = 0; i < pages; ++i) {
        items[e].push_back({load ? pages + i : i, host + i * shape.object_bytes()});
      }
      ops[e] = [backend, m = *m, &items, e, load] {
        return BackendOp(*backend, *m, items[e], load);
      };
    } else {
      absl::StatusOr<client::Session*> s = env->Session(e);
      if (!s.ok()) {
        st = s.status();
        break;
      }
      load_keys[e] = env->Keys(pages);
      if (load) {
        // The pages a Load reads: backed up once, untimed.
        st = BackupKeys(**s, load_keys[e], src);
        for (int i = 1; i < kMaxWarmupBackups && !st.ok(); ++i) {
          st = BackupKeys(**s, load_keys[e], src);
        }
        if (!st.ok()) break;
      }
      ops[e] = [env, s = *s, &load_keys, &src, &dst, e, load] {
        return RunDaemonOp(env, *s, load, load_keys[e], load ? dst : src);
      };
    }
  }
  absl::StatusOr<std::unique_ptr<CopyBaselines>> base =
      st.ok() ? CopyBaselines::Create({config.multi_layers, config.multi_block_bytes, pages}) : st;
  if (!base.ok()) {
    state.SkipWithError(base.status().ToString().c_str());
    return;
  }
  // Untimed: one op per engine warms its streams and mappings (a daemon Backup may be retried
  // while the pool makes room for this object size).
  for (int e = 0; e < n && st.ok(); ++e) {
    st = ops[e]();
    for (int i = 1; i < kMaxWarmupBackups && !st.ok() && !key && !load; ++i) st = ops[e]();
  }
  absl::Duration link_time;
  for (int i = 0; i < config.iterations && st.ok(); ++i) {
    absl::StatusOr<absl::Duration> d = (*base)->Bulk((*link_host)->host, load);
    st = d.status();
    if (st.ok()) link_time += *d;
  }
  if (!st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    std::vector<absl::Status> results(n);
    std::vector<std::thread> threads;
    absl::Notification go;
    for (int e = 0; e < n; ++e) {
      threads.emplace_back([&, e] {
        go.WaitForNotification();
        for (int i = 0; i < config.iterations && results[e].ok(); ++i) results[e] = ops[e]();
      });
    }
    const absl::Time t0 = absl::Now();
    go.Notify();
    for (std::thread& t : threads) t.join();
    const absl::Duration d = absl::Now() - t0;
    for (const absl::Status& r : results) {
      if (!r.ok()) {
        state.SkipWithError(r.ToString().c_str());
        return;
      }
    }
    state.SetIterationTime(absl::ToDoubleSeconds(d));
    const double gbps = double(n) * config.iterations * batch / absl::ToDoubleSeconds(d) / 1e9;
    const double link = double(config.iterations) * batch / absl::ToDoubleSeconds(link_time) / 1e9;
    state.counters["aggregate_GBps"] = gbps;
    state.counters["link_GBps"] = link;
    state.counters["ratio"] = gbps / link;
    summary->AddEngines(n, load ? "Load" : "Backup", key ? key->Name() : "kvcellard", gbps, link);
  }
}

}  // namespace

void RegisterMultiEngineBenchmarks(CudaBenchEnv* env, CudaSummary* summary,
                                   const CudaBenchConfig& config) {
  using Path = gpu::CudaDeviceOptions::CopyPath;
  const std::vector<std::optional<BackendKey>> paths = {
      BackendKey{Path::kMemcpy, config.default_kernel_blocks},
      BackendKey{Path::kKernel, config.default_kernel_blocks}, std::nullopt};
  for (int n : config.engines) {
    for (bool load : {false, true}) {
      for (const std::optional<BackendKey>& path : paths) {
        const std::string name =
            absl::StrCat("BM_CudaEngines/engines:", n, "/", load ? "Load" : "Backup",
                         "/path:", path ? path->Name() : "kvcellard");
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& state) {
                                       RunEngines(state, env, summary, config, n, load, path);
                                     })
            ->Iterations(1)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace kvcellar::bench
