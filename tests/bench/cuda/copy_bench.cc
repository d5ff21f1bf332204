// BM_Cuda{Backup,Load}: one engine's Backup and Load, through the daemon's CUDA backend in this
// process (copy engine and copy kernel paths) and end to end through kvcellard (its automatic
// path), each beside both baselines timed in the same iteration just before the op.
//
// One op moves a batch of pages (CudaBenchConfig::batch_bytes) between blocks of the engine's
// layer-first pool (Backup reads blocks 0..pages-1, Load writes pages..2*pages-1) and page-first
// host objects in pinned, registered memory. Its time runs from the submission to the op's
// completion (DeviceOp::Wait; through kvcellard: the RPC until WaitOps reports it DONE). Wall-clock
// times after synchronization throughout, so the baselines pay their launch costs as the op does.
//
// "signals": Backup waits on the engine's ready event (recorded once by the engine: the wait is
// satisfied, so this measures the fence's cost, not the engine's compute); Load records the
// engine's per-layer load events. Before the timed Loads of a case, a Backup then a Load round
// trip is checked byte for byte by the engine.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "tests/bench/cuda/benchmarks.h"

namespace kvcellar::bench {
namespace {

using gpu::testing::PoolShape;

// Untimed Backups that may be retried while the daemon's pool makes room for a new object size.
constexpr int kMaxWarmupBackups = 50;

absl::Status Cuda(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(err)));
}

std::string ShapeName(uint64_t block_bytes, uint32_t layers, uint32_t pages) {
  return absl::StrCat(block_bytes >> 10, " KiB x ", layers, " layers, ", pages, " pages/op");
}

client::OpResult WaitTerminal(client::Session& s, client::OpResult op) {
  const absl::Time deadline = absl::Now() + kOpWait;
  while (!op.terminal() && absl::Now() < deadline) {
    client::WaitOptions w;
    w.timeout = std::min(absl::Seconds(1), deadline - absl::Now());
    w.omit_page_status = true;
    op = s.WaitOps({op.ref}, w)[0];
    if (!op.terminal() && !op.status.ok()) absl::SleepFor(absl::Milliseconds(20));
  }
  return op;
}

}  // namespace

// ---- Shared pieces (benchmarks.h) -----------------------------------------------------------

absl::Status BackendOp(Backend& b, gpu::EngineMapping& m, absl::Span<const gpu::CopyItem> items,
                       bool load, bool signals, const std::string& ready_event, uint64_t ticket) {
  absl::StatusOr<gpu::OpHandle> op =
      load ? b.device->SubmitScatter(m, items, signals ? gpu::OpSignal{0, ticket} : gpu::OpSignal{})
           : b.device->SubmitGather(
                 m, items,
                 signals ? gpu::ReadyFence::CudaIpcEvent(ready_event) : gpu::ReadyFence::Ready(),
                 {});
  if (!op.ok()) return op.status();
  if (!(*op)->Wait(kOpWait)) return absl::DeadlineExceededError("op did not finish");
  return (*op)->status();
}

uint32_t PagesPerOp(uint64_t batch_bytes, uint64_t block_bytes, uint32_t layers) {
  const uint64_t object = 2ull * layers * block_bytes;
  return static_cast<uint32_t>(std::max<uint64_t>(1, batch_bytes / object));
}

absl::StatusOr<std::unique_ptr<CopyBaselines>> CopyBaselines::Create(const PoolShape& shape) {
  auto b = std::unique_ptr<CopyBaselines>(new CopyBaselines(shape));
  if (absl::Status s = Cuda(cudaSetDevice(0), "cudaSetDevice"); !s.ok()) return s;
  if (absl::Status s = Cuda(cudaMalloc(reinterpret_cast<void**>(&b->dev_), shape.pool_bytes()),
                            "cudaMalloc(baseline)");
      !s.ok()) {
    b->dev_ = nullptr;
    return s;
  }
  // Not zeros: nothing here depends on the values, but nothing should get to skip work either.
  if (absl::Status s = Cuda(cudaMemset(b->dev_, 0x5a, shape.pool_bytes()), "cudaMemset"); !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Cuda(cudaStreamCreateWithFlags(&b->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      !s.ok()) {
    b->stream_ = nullptr;
    return s;
  }
  if (absl::Status s = Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !s.ok()) return s;
  return b;
}

CopyBaselines::~CopyBaselines() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (dev_ != nullptr) cudaFree(dev_);
}

absl::StatusOr<absl::Duration> CopyBaselines::Bulk(uint8_t* host, bool to_device) {
  const absl::Time t0 = absl::Now();
  absl::Status s =
      to_device ? Cuda(cudaMemcpy(dev_, host, bytes(), cudaMemcpyHostToDevice), "bulk cudaMemcpy")
                : Cuda(cudaMemcpy(host, dev_, bytes(), cudaMemcpyDeviceToHost), "bulk cudaMemcpy");
  const absl::Time t1 = absl::Now();
  if (!s.ok()) return s;
  return t1 - t0;
}

absl::StatusOr<absl::Duration> CopyBaselines::PerBlock(uint8_t* host, bool to_device) {
  const uint64_t bpb = shape_.bytes_per_block;
  const absl::Time t0 = absl::Now();
  for (uint32_t p = 0; p < shape_.blocks; ++p) {
    uint8_t* object = host + p * shape_.object_bytes();
    for (uint32_t l = 0; l < shape_.layers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        uint8_t* h = object + (uint64_t{l} * 2 + kv) * bpb;
        uint8_t* d = dev_ + gpu::testing::LayerFirstOffset(shape_, l, kv, p);
        const cudaError_t err = to_device
                                    ? cudaMemcpyAsync(d, h, bpb, cudaMemcpyHostToDevice, stream_)
                                    : cudaMemcpyAsync(h, d, bpb, cudaMemcpyDeviceToHost, stream_);
        if (err != cudaSuccess) {
          cudaStreamSynchronize(stream_);
          return Cuda(err, "per-block cudaMemcpyAsync");
        }
      }
    }
  }
  if (absl::Status s = Cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); !s.ok()) {
    return s;
  }
  return absl::Now() - t0;
}

namespace {

struct CaseSpec {
  uint64_t block_bytes = 0;
  uint32_t layers = 0;
  bool load = false;
  bool signals = false;
  // The backend path, or nullopt for end to end through kvcellard.
  std::optional<BackendKey> backend;
};

// What every iteration adds up.
struct Times {
  absl::Duration op, bulk, per_block;
};

void Report(benchmark::State& state, CudaSummary* summary, const CaseSpec& c, uint32_t pages,
            uint64_t object, const Times& t) {
  const double bytes = double(state.iterations()) * pages * object;
  const double gbps = bytes / absl::ToDoubleSeconds(t.op) / 1e9;
  const double bulk = bytes / absl::ToDoubleSeconds(t.bulk) / 1e9;
  const double per_block = bytes / absl::ToDoubleSeconds(t.per_block) / 1e9;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["pages"] = pages;
  state.counters["GBps"] = gbps;
  state.counters["bulk_GBps"] = bulk;
  state.counters["per_block_GBps"] = per_block;
  state.counters["vs_bulk"] = gbps / bulk;
  state.counters["vs_per_block"] = gbps / per_block;
  summary->AddCopy(ShapeName(c.block_bytes, c.layers, pages), c.load ? "Load" : "Backup",
                   c.backend ? c.backend->Name() : "kvcellard", c.signals, gbps, bulk, per_block);
}

// The baselines of one iteration, in the op's direction, on `host`.
absl::Status TimeBaselines(CopyBaselines& base, uint8_t* host, bool load, Times* t) {
  absl::StatusOr<absl::Duration> bulk = base.Bulk(host, load);
  if (!bulk.ok()) return bulk.status();
  absl::StatusOr<absl::Duration> per_block = base.PerBlock(host, load);
  if (!per_block.ok()) return per_block.status();
  t->bulk += *bulk;
  t->per_block += *per_block;
  return absl::OkStatus();
}

void RunBackendCase(benchmark::State& state, CudaBenchEnv* env, CudaSummary* summary,
                    const CudaBenchConfig& config, const CaseSpec& c) {
  const uint32_t pages = PagesPerOp(config.batch_bytes, c.block_bytes, c.layers);
  const PoolShape shape{c.layers, c.block_bytes, 2 * pages};
  const uint64_t object = shape.object_bytes();
  absl::StatusOr<gpu::testing::CudaEngineProcess*> engine = env->Engine(0, shape);
  absl::StatusOr<Backend*> backend =
      engine.ok() ? env->GetBackend(*c.backend, pages * object) : engine.status();
  absl::StatusOr<gpu::EngineMapping*> mapping =
      backend.ok() ? env->Mapping(*backend, 0) : backend.status();
  absl::StatusOr<std::unique_ptr<CopyBaselines>> base =
      mapping.ok() ? CopyBaselines::Create({c.layers, c.block_bytes, pages}) : mapping.status();
  if (!base.ok()) {
    state.SkipWithError(base.status().ToString().c_str());
    return;
  }
  Backend& b = **backend;
  std::vector<gpu::CopyItem> gather, scatter;
  for (uint32_t i = 0; i < pages; ++i) {
    gather.push_back({i, b.host + i * object});
    scatter.push_back({pages + i, b.host + i * object});
  }
  const std::string ready = (*engine)->ready_event(0);
  uint64_t ticket = 1;
  // Untimed: the first ops open the fence event and warm the streams. A Load case first checks
  // a whole round trip byte for byte.
  absl::Status st = BackendOp(b, **mapping, gather, false, c.signals, ready, ticket++);
  if (st.ok() && c.load) st = BackendOp(b, **mapping, scatter, true, c.signals, ready, ticket++);
  if (st.ok() && c.load) st = (*engine)->Check(pages, 0, pages, kPoolSeed);
  if (!st.ok()) {
    state.SkipWithError(absl::StrCat("warm-up: ", st.ToString()).c_str());
    return;
  }
  Times t;
  for (auto _ : state) {
    st = TimeBaselines(**base, b.host, c.load, &t);
    const absl::Time t0 = absl::Now();
    if (st.ok()) {
      st = BackendOp(b, **mapping, c.load ? scatter : gather, c.load, c.signals, ready, ticket++);
    }
    const absl::Duration d = absl::Now() - t0;
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    t.op += d;
    state.SetIterationTime(absl::ToDoubleSeconds(d));
  }
  Report(state, summary, c, pages, object, t);
}

void RunDaemonCase(benchmark::State& state, CudaBenchEnv* env, CudaSummary* summary,
                   const CudaBenchConfig& config, const CaseSpec& c) {
  const uint32_t pages = PagesPerOp(config.batch_bytes, c.block_bytes, c.layers);
  const PoolShape shape{c.layers, c.block_bytes, 2 * pages};
  const uint64_t object = shape.object_bytes();
  absl::StatusOr<gpu::testing::CudaEngineProcess*> engine = env->Engine(0, shape);
  absl::StatusOr<client::Session*> session = engine.ok() ? env->Session(0) : engine.status();
  // The baselines' pinned pages: those of the copy-engine backend.
  absl::StatusOr<Backend*> host =
      session.ok() ? env->GetBackend({gpu::CudaDeviceOptions::CopyPath::kMemcpy}, pages * object)
                   : session.status();
  absl::StatusOr<std::unique_ptr<CopyBaselines>> base =
      host.ok() ? CopyBaselines::Create({c.layers, c.block_bytes, pages}) : host.status();
  if (!base.ok()) {
    state.SkipWithError(base.status().ToString().c_str());
    return;
  }
  client::Session& s = **session;
  const std::vector<uint32_t> src = [&] {
    std::vector<uint32_t> v(pages);
    for (uint32_t i = 0; i < pages; ++i) v[i] = i;
    return v;
  }();
  const std::vector<uint32_t> dst = [&] {
    std::vector<uint32_t> v(pages);
    for (uint32_t i = 0; i < pages; ++i) v[i] = pages + i;
    return v;
  }();
  client::BackupOptions backup_options;
  backup_options.has_ready = c.signals;
  backup_options.ready_slot = 0;
  client::LoadOptions load_options;
  load_options.signal_layers = c.signals;
  load_options.completion_slot = 0;
  auto backup = [&](const std::vector<core::PageKey>& keys) {
    client::BackupSequence seq;
    seq.keys = keys;
    seq.blocks = src;
    return WaitTerminal(s, s.Backup({seq}, backup_options));
  };
  auto load = [&](const std::vector<core::PageKey>& keys) {
    client::LoadSequence seq;
    seq.keys = keys;
    seq.blocks = dst;
    return WaitTerminal(s, s.Load({seq}, load_options));
  };
  auto failed = [&](const char* what, const client::OpResult& r) {
    state.SkipWithError(absl::StrCat(what, ": op ", client::OpStateName(r.state), ", ",
                                     r.usable_pages(0), "/", pages, " pages usable; ",
                                     r.status.ok() ? r.error_message : r.status.ToString())
                            .c_str());
  };
  // The first Backups of a new object size may find no slot (NO_SPACE) while the pool is full of
  // earlier cases' sizes; each retry evicts more (as kvcellar_bench_datapath's warm-up does).
  auto warm_backup = [&](const std::vector<core::PageKey>& keys) {
    client::OpResult r = backup(keys);
    for (int i = 1; i < kMaxWarmupBackups && r.usable_pages(0) != pages; ++i) r = backup(keys);
    return r;
  };
  const std::vector<core::PageKey> load_keys = env->Keys(pages);
  if (c.load) {
    client::OpResult r = warm_backup(load_keys);
    if (r.usable_pages(0) != pages) return failed("setup backup", r);
    r = load(load_keys);
    if (r.usable_pages(0) != pages) return failed("warm-up load", r);
    if (absl::Status st = (*engine)->Check(pages, 0, pages, kPoolSeed); !st.ok()) {
      state.SkipWithError(absl::StrCat("round trip: ", st.ToString()).c_str());
      return;
    }
  } else {
    client::OpResult r = warm_backup(env->Keys(pages));
    if (r.usable_pages(0) != pages) return failed("warm-up backup", r);
  }
  Times t;
  for (auto _ : state) {
    // Backups write fresh keys (present pages would not be copied again); the pool evicts.
    const std::vector<core::PageKey> keys = c.load ? load_keys : env->Keys(pages);
    if (absl::Status st = TimeBaselines(**base, (*host)->host, c.load, &t); !st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    const absl::Time t0 = absl::Now();
    client::OpResult r = c.load ? load(keys) : backup(keys);
    const absl::Duration d = absl::Now() - t0;
    if (r.usable_pages(0) != pages) return failed(c.load ? "load" : "backup", r);
    t.op += d;
    state.SetIterationTime(absl::ToDoubleSeconds(d));
  }
  Report(state, summary, c, pages, object, t);
}

}  // namespace

void RegisterCopyBenchmarks(CudaBenchEnv* env, CudaSummary* summary,
                            const CudaBenchConfig& config) {
  using Path = gpu::CudaDeviceOptions::CopyPath;
  const std::vector<std::optional<BackendKey>> paths = {
      BackendKey{Path::kMemcpy, config.default_kernel_blocks},
      BackendKey{Path::kKernel, config.default_kernel_blocks}, std::nullopt};
  // Shape-major, so that each engine pool is allocated once per shape.
  for (uint32_t layers : config.layers) {
    for (uint64_t block : config.block_bytes) {
      for (bool load : {false, true}) {
        for (const std::optional<BackendKey>& path : paths) {
          for (bool signals : {false, true}) {
            CaseSpec c{block, layers, load, signals, path};
            const std::string name =
                absl::StrCat(load ? "BM_CudaLoad" : "BM_CudaBackup", "/block_KiB:", block >> 10,
                             "/layers:", layers, "/path:", path ? path->Name() : "kvcellard",
                             "/signals:", signals ? 1 : 0);
            benchmark::RegisterBenchmark(name.c_str(),
                                         [=](benchmark::State& state) {
                                           if (c.backend) {
                                             RunBackendCase(state, env, summary, config, c);
                                           } else {
                                             RunDaemonCase(state, env, summary, config, c);
                                           }
                                         })
                ->Iterations(config.iterations)
                ->UseManualTime()
                ->Unit(benchmark::kMillisecond);
          }
        }
      }
    }
  }
}

}  // namespace kvcellar::bench
