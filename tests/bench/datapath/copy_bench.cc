// BM_Load and BM_Backup: end-to-end bandwidth of the engine data path on the sim device, beside
// memcpy of the same bytes in the same iteration.
//
// One op moves a batch of pages (BenchConfig::batch_bytes). Its time runs from the RPC through
// the daemon's copies to the WaitOps that reports it DONE. Each page object is split over layers
// and K/V as the registered layout says (per-buffer bytes = object / (2 * layers), rounded down
// to 64 as real KV blocks are aligned). The baseline, timed in the same iteration just before the
// op, memcpy's the same bytes in the same chunks (one per page, layer and K/V buffer) between the
// engine's blocks and a page-first host buffer in this process, on one thread.
//
// Backup writes fresh keys every iteration: the pool is first filled past its capacity
// (untimed), so timed Backups run in the steady state where each one evicts as much as it adds.
// Load reads back one batch backed up before the loop, after a few untimed Loads (the first one
// verified byte for byte against the pattern the blocks were filled with).
//
// BM_BackupJournal: what recording pages for a warm restart costs Backup (core/slot_journal.h:
// a record per slot, and the CRC-32C of every page at commit). A second kvcellard with
// pool.shm_name (so with a journal) runs beside the benchmark's daemon (no journal); each
// iteration times one Backup on each, in alternating order, after both pools were filled past
// capacity. ratio = journal GB/s / plain GB/s.
//
// BM_BackupEvents: what publishing KV events costs Backup (server/events, docs/events.md). The
// second kvcellard has events.endpoint set and a ZMQ subscriber in this process receives every
// batch; the benchmark's own daemon publishes nothing. Same alternation; ratio = events / plain.
//
// BM_BackupTokens: what carrying each page's tokens into the events costs Backup (#27: the
// tokens cross the wire, the daemon keeps them per page and every BlockStored carries them). Two
// daemons beside the benchmark's, both publishing to a subscriber, one with events.page_tokens
// false; every Backup passes its pages' tokens (16 per page), which the client sends only to the
// daemon that wants them. Same alternation; ratio = tokens / no tokens.
//
// BM_BackupLabelLog: what keeping the pages' tokens for a restart costs Backup (events.label_log,
// server/events/label_log.h: each label appended to a file by a thread of its own). Two daemons
// publishing with tokens, one with a label log; ratio = label log / none.
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "platform/host_memory.h"
#include "tests/bench/datapath/benchmarks.h"

namespace kvcellar::bench {
namespace {

constexpr uint64_t kSeed = 7;  // Pattern seed of the backed-up blocks.
// Longest wait for one op: 64 MiB at even 0.1 GB/s.
constexpr absl::Duration kOpWait = absl::Seconds(60);
// Untimed Loads before the timed ones (see RunCopy).
constexpr int kLoadWarmup = 3;
// Retries of warm-up Backups that found no slot (see RunCopy); each evicts up to a region's worth.
constexpr int kMaxNoSpaceRetries = 200;

struct CopyCase {
  SimEngineRank rank;
  uint32_t items = 0;         // Pages per op.
  uint64_t object = 0;        // Bytes per page object.
  std::vector<uint32_t> src;  // Backup reads these blocks...
  std::vector<uint32_t> dst;  // ... Load writes these.
  std::vector<uint8_t> host;  // The memcpy baseline's page-first host pages.
};

// The baseline: the same bytes in the same per-(page, layer, buffer) chunks as the daemon copies.
void MemcpyChunks(CopyCase& c, bool to_engine) {
  client::SimEngine& sim = *c.rank.sim;
  const uint64_t bpb = sim.options().bytes_per_block;
  const std::vector<uint32_t>& blocks = to_engine ? c.dst : c.src;
  for (uint32_t i = 0; i < c.items; ++i) {
    uint8_t* page = c.host.data() + i * c.object;
    for (uint32_t l = 0; l < sim.num_layers(); ++l) {
      for (uint32_t b = 0; b < sim.buffers(); ++b) {
        uint8_t* host = page + (uint64_t{l} * sim.buffers() + b) * bpb;
        uint8_t* dev = sim.Block(l, b, blocks[i]);
        if (to_engine) {
          std::memcpy(dev, host, bpb);
        } else {
          std::memcpy(host, dev, bpb);
        }
      }
    }
  }
  benchmark::ClobberMemory();
}

client::OpResult Backup(CopyCase& c, const std::vector<core::PageKey>& keys,
                        absl::Span<const uint32_t> tokens = {}) {
  client::BackupSequence seq;
  seq.keys = keys;
  seq.blocks = c.src;
  seq.tokens = tokens;
  client::Session& s = *c.rank.session;
  return WaitTerminal(s, s.Backup({seq}), kOpWait);
}

client::OpResult Load(CopyCase& c, const std::vector<core::PageKey>& keys) {
  client::LoadSequence seq;
  seq.keys = keys;
  seq.blocks = c.dst;
  client::Session& s = *c.rank.session;
  return WaitTerminal(s, s.Load({seq}), kOpWait);
}

bool HasNoSpace(const client::OpResult& r) {
  for (const client::SequenceResult& s : r.sequences) {
    for (client::PageStatus p : s.page_status) {
      if (p == client::PageStatus::kNoSpace) return true;
    }
  }
  return false;
}

// Why an op did not move every page: its state, usable pages, and the count of each page status.
std::string OpError(const client::OpResult& r, uint32_t want) {
  std::map<std::string, int> statuses;
  for (const client::SequenceResult& s : r.sequences) {
    for (client::PageStatus p : s.page_status) ++statuses[client::PageStatusName(p)];
  }
  std::string out = absl::StrCat("op ", client::OpStateName(r.state), " with ", r.usable_pages(0),
                                 "/", want, " pages usable (");
  for (const auto& [name, n] : statuses) absl::StrAppend(&out, name, " ", n, " ");
  absl::StrAppend(&out, ") ", r.status.ok() ? r.error_message : r.status.ToString());
  return out;
}

// A registered engine whose page objects are `kib` KiB over `layers` layers, with blocks for one
// op's pages to read (src) and as many to write (dst).
absl::Status SetUpCase(DatapathEnv* env, const BenchConfig& config, uint64_t kib, uint32_t layers,
                       CopyCase* c) {
  c->items = static_cast<uint32_t>(std::max<uint64_t>(1, config.batch_bytes / (kib << 10)));
  EngineSpec spec;
  // One namespace per geometry: a namespace's page object size is fixed.
  spec.model = absl::StrCat("bench-copy-", kib, "k-", layers, "l");
  spec.opaque_keys = true;
  spec.layers = layers;
  spec.bytes_per_block = std::max<uint64_t>(64, (kib << 10) / (2 * layers) / 64 * 64);
  spec.blocks = 2 * c->items;
  absl::StatusOr<SimEngineRank> rank = env->RegisterEngine(spec);
  if (!rank.ok()) return rank.status();
  c->rank = *std::move(rank);
  client::SimEngine& sim = *c->rank.sim;
  c->object = sim.page_bytes();
  c->src = BlockRange(0, c->items);
  c->dst = BlockRange(c->items, c->items);
  c->host.assign(c->items * c->object, 1);  // Faults the host pages in.
  for (uint32_t b = 0; b < sim.num_blocks(); ++b) sim.ClearBlock(b, 2);
  return absl::OkStatus();
}

struct Warmup {
  // The slowest untimed Backup: the first ones of a new object size take regions from other
  // size classes (evicting their objects), which the steady state does not show.
  absl::Duration max;
  int no_space = 0;  // Warm-up Backups that found no slot (NO_SPACE) and were retried.
};

// Fills the pool past its capacity with fresh keys, so every timed Backup evicts as much as it
// stores. The first Backups of a new object size may find no slot: the pool is full of the
// previous case's size class, and evicting a region's worth of its objects (in policy order)
// frees slots spread over many regions rather than a whole region this class could take. Each
// retry evicts more; the count is reported (warmup_no_space) as a finding, not hidden.
absl::Status FillPastCapacity(DatapathEnv* env, CopyCase& c, Warmup* warmup) {
  const uint64_t warm = env->options().pool_bytes / (c.items * c.object) + 2;
  for (uint64_t i = 0; i < warm; ++i) {
    std::vector<core::PageKey> keys(c.items);
    for (core::PageKey& k : keys) k = env->NextKey();
    const absl::Time t0 = absl::Now();
    client::OpResult r = Backup(c, keys);
    warmup->max = std::max(warmup->max, absl::Now() - t0);
    if (r.usable_pages(0) != c.items && HasNoSpace(r) && warmup->no_space < kMaxNoSpaceRetries) {
      ++warmup->no_space;
      --i;
      continue;
    }
    if (r.usable_pages(0) != c.items) {
      return absl::InternalError(absl::StrCat("warm-up backup: ", OpError(r, c.items)));
    }
  }
  return absl::OkStatus();
}

void RunCopy(benchmark::State& state, DatapathEnv* env, Summary* summary, const BenchConfig& config,
             bool load) {
  const uint64_t kib = state.range(0);
  const uint32_t layers = static_cast<uint32_t>(state.range(1));
  CopyCase c;
  if (absl::Status s = SetUpCase(env, config, kib, layers, &c); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  client::SimEngine& sim = *c.rank.sim;
  auto fresh_keys = [&] {
    std::vector<core::PageKey> keys(c.items);
    for (core::PageKey& k : keys) k = env->NextKey();
    return keys;
  };
  const std::vector<core::PageKey> load_keys = fresh_keys();
  for (uint32_t i = 0; i < c.items; ++i) sim.FillBlock(c.src[i], kSeed, load_keys[i], 0);
  Warmup warmup;
  if (load) {
    client::OpResult r = Backup(c, load_keys);
    if (r.usable_pages(0) != c.items) {
      state.SkipWithError(absl::StrCat("setup backup: ", OpError(r, c.items)).c_str());
      return;
    }
  } else if (absl::Status s = FillPastCapacity(env, c, &warmup); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }

  if (load) {
    // Untimed: the first Loads fault the engine's blocks into the daemon's mapping of them (an
    // engine's KV pool is long-lived, so the steady state is what counts). The first is verified
    // byte for byte.
    for (int i = 0; i < kLoadWarmup; ++i) {
      client::OpResult r = Load(c, load_keys);
      if (r.usable_pages(0) != c.items) {
        state.SkipWithError(absl::StrCat("warm-up load: ", OpError(r, c.items)).c_str());
        return;
      }
      if (i > 0) continue;
      uint64_t bad = 0;
      std::string first;
      for (uint32_t p = 0; p < c.items; ++p) {
        bad += sim.CountMismatches(c.dst[p], kSeed, load_keys[p], 0, bad == 0 ? &first : nullptr);
      }
      if (bad > 0) {
        state.SkipWithError(absl::StrCat("wrong bytes loaded: ", bad, "; ", first).c_str());
        return;
      }
    }
  }

  absl::Duration kv_time, memcpy_time;
  for (auto _ : state) {
    std::vector<core::PageKey> keys = load ? load_keys : fresh_keys();
    const absl::Time t0 = absl::Now();
    MemcpyChunks(c, /*to_engine=*/load);
    const absl::Time t1 = absl::Now();
    client::OpResult r = load ? Load(c, keys) : Backup(c, keys);
    const absl::Time t2 = absl::Now();
    if (r.usable_pages(0) != c.items) {
      state.SkipWithError(OpError(r, c.items).c_str());
      return;
    }
    memcpy_time += t1 - t0;
    kv_time += t2 - t1;
    state.SetIterationTime(absl::ToDoubleSeconds(t2 - t1));
  }
  const double bytes = double(state.iterations()) * c.items * c.object;
  const double kv_gbps = bytes / absl::ToDoubleSeconds(kv_time) / 1e9;
  const double memcpy_gbps = bytes / absl::ToDoubleSeconds(memcpy_time) / 1e9;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["pages"] = c.items;
  state.counters["object_KiB"] = double(c.object) / 1024;
  state.counters["kv_GBps"] = kv_gbps;
  state.counters["memcpy_GBps"] = memcpy_gbps;
  state.counters["ratio"] = kv_gbps / memcpy_gbps;
  if (!load) {
    state.counters["warmup_max_ms"] = absl::ToDoubleMilliseconds(warmup.max);
    state.counters["warmup_no_space"] = warmup.no_space;
  }
  summary->AddCopy(absl::StrCat(load ? "Load" : "Backup", " ", kib, " KiB x ", layers, " layers, ",
                                c.items, " pages/op"),
                   kv_gbps, memcpy_gbps);
}

// Backup on the benchmark's daemon and on a second one started with `beside` options, one of
// each per iteration in alternating order, after both pools were filled past capacity. Returns
// the (beside, plain) GB/s, or an error to skip with.
struct BesideResult {
  double beside_gbps = 0;
  double plain_gbps = 0;
  uint32_t items = 0;
};

// `plain`: the options of a third daemon to compare with instead of the benchmark's; `tokens`:
// every Backup passes its pages' tokens.
absl::StatusOr<BesideResult> BackupBeside(benchmark::State& state, DatapathEnv* env,
                                          const BenchConfig& config, const EnvOptions& beside,
                                          const EnvOptions* plain = nullptr, bool tokens = false) {
  const uint64_t kib = state.range(0);
  const uint32_t layers = static_cast<uint32_t>(state.range(1));
  absl::StatusOr<std::unique_ptr<DatapathEnv>> other = DatapathEnv::Start(beside);
  if (!other.ok()) return other.status();
  std::unique_ptr<DatapathEnv> third;
  if (plain != nullptr) {
    absl::StatusOr<std::unique_ptr<DatapathEnv>> started = DatapathEnv::Start(*plain);
    if (!started.ok()) return started.status();
    third = *std::move(started);
    env = third.get();
  }
  struct Side {
    DatapathEnv* env;
    CopyCase c;
    absl::Duration time;
  };
  Side sides[2] = {{env, {}, {}}, {other->get(), {}, {}}};
  absl::Status failed;
  for (Side& side : sides) {
    Warmup warmup;
    failed = SetUpCase(side.env, config, kib, layers, &side.c);
    if (failed.ok()) failed = FillPastCapacity(side.env, side.c, &warmup);
    if (!failed.ok()) break;
  }
  // Tokens of the pages of one Backup (an opaque-key namespace: any tokens are the engine's).
  std::vector<uint32_t> page_tokens(tokens ? size_t{sides[0].c.items} * EngineSpec().page_size : 0);
  for (size_t i = 0; i < page_tokens.size(); ++i) page_tokens[i] = static_cast<uint32_t>(i * 7919);
  int64_t op = 0;
  for (auto _ : state) {
    if (!failed.ok()) break;
    const absl::Time start = absl::Now();
    for (int k = 0; k < 2; ++k) {
      Side& side = sides[(op + k) % 2];  // Alternating which goes first.
      std::vector<core::PageKey> keys(side.c.items);
      for (core::PageKey& key : keys) key = side.env->NextKey();
      const absl::Time t0 = absl::Now();
      client::OpResult r = Backup(side.c, keys, page_tokens);
      side.time += absl::Now() - t0;
      if (r.usable_pages(0) != side.c.items) {
        failed = absl::InternalError(OpError(r, side.c.items));
        break;
      }
    }
    ++op;
    state.SetIterationTime(absl::ToDoubleSeconds(absl::Now() - start));
  }
  int daemon_status = (*other)->StopDaemon();
  other->reset();
  if (third != nullptr) {
    daemon_status = daemon_status != 0 ? daemon_status : third->StopDaemon();
    third.reset();
  }
  if (!failed.ok()) return failed;
  if (daemon_status != 0) {
    return absl::InternalError(absl::StrCat("second kvcellard exited with ", daemon_status));
  }
  const double bytes = double(state.iterations()) * sides[0].c.items * sides[0].c.object;
  return BesideResult{bytes / absl::ToDoubleSeconds(sides[1].time) / 1e9,
                      bytes / absl::ToDoubleSeconds(sides[0].time) / 1e9, sides[0].c.items};
}

std::string CaseName(benchmark::State& state, uint32_t items) {
  return absl::StrCat("Backup ", state.range(0), " KiB x ", state.range(1), " layers, ", items,
                      " pages/op");
}

void RunBackupJournal(benchmark::State& state, DatapathEnv* env, Summary* summary,
                      const BenchConfig& config) {
  // The second daemon: the same options, its pool a named shm object with a slot journal.
  const std::string shm = absl::StrCat("kvc-bench-journal-", getpid());
  EnvOptions options = env->options();
  options.extra_sets.push_back(absl::StrCat("pool.shm_name=", shm));
  absl::StatusOr<BesideResult> r = BackupBeside(state, env, config, options);
  (void)platform::HostMemory::UnlinkShm(shm);
  (void)platform::HostMemory::UnlinkShm(shm + ".journal");
  if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
  state.counters["plain_GBps"] = r->plain_gbps;
  state.counters["journal_GBps"] = r->beside_gbps;
  state.counters["ratio"] = r->beside_gbps / r->plain_gbps;
  summary->AddJournal(CaseName(state, r->items), r->beside_gbps, r->plain_gbps);
}

// A ZMQ subscriber on its own thread, receiving (and counting) every message until stopped: a
// router that keeps up, so the daemon's publisher does the whole work of publishing.
class Subscriber {
 public:
  explicit Subscriber(const std::string& endpoint) {
    ctx_ = zmq_ctx_new();
    sock_ = zmq_socket(ctx_, ZMQ_SUB);
    const int timeout_ms = 50;
    zmq_setsockopt(sock_, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    zmq_setsockopt(sock_, ZMQ_SUBSCRIBE, "", 0);
    zmq_connect(sock_, endpoint.c_str());
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock_, 0) >= 0 && zmq_msg_more(&msg) == 0) ++messages_;
        zmq_msg_close(&msg);
      }
    });
  }
  ~Subscriber() {
    stop_ = true;
    thread_.join();
    zmq_close(sock_);
    zmq_ctx_term(ctx_);
  }
  uint64_t messages() const { return messages_.load(); }

 private:
  void* ctx_;
  void* sock_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> messages_{0};
  std::thread thread_;
};

void RunBackupEvents(benchmark::State& state, DatapathEnv* env, Summary* summary,
                     const BenchConfig& config) {
  // The second daemon: the same options, publishing KV events to a subscriber that keeps up.
  const std::string endpoint = absl::StrCat("ipc:///tmp/kvc-bench-events-", getpid());
  EnvOptions options = env->options();
  options.extra_sets.push_back(absl::StrCat("events.endpoint=", endpoint));
  Subscriber subscriber(endpoint);
  absl::StatusOr<BesideResult> r = BackupBeside(state, env, config, options);
  ::unlink(endpoint.substr(6).c_str());
  if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
  if (subscriber.messages() == 0) {
    return state.SkipWithError("the subscriber received no event: nothing was measured");
  }
  state.counters["plain_GBps"] = r->plain_gbps;
  state.counters["events_GBps"] = r->beside_gbps;
  state.counters["ratio"] = r->beside_gbps / r->plain_gbps;
  state.counters["batches"] = static_cast<double>(subscriber.messages());
  summary->AddEvents(CaseName(state, r->items), r->beside_gbps, r->plain_gbps);
}

// Backup with tokens on two daemons that both publish KV events to a subscriber of their own
// and differ only in `with_sets` / `without_sets`; `feature` names the ipc endpoints and files.
// Sets the counters plain_GBps, <feature>_GBps and ratio = with / without; the result, or an
// error the caller's state already carries.
absl::StatusOr<BesideResult> BackupTwoPublishers(benchmark::State& state, DatapathEnv* env,
                                                 const BenchConfig& config,
                                                 absl::string_view feature,
                                                 std::vector<std::string> with_sets,
                                                 std::vector<std::string> without_sets) {
  const std::string with = absl::StrCat("ipc:///tmp/kvc-bench-", feature, "-", getpid());
  const std::string without = absl::StrCat("ipc:///tmp/kvc-bench-no", feature, "-", getpid());
  EnvOptions feature_on = env->options();
  feature_on.extra_sets.push_back(absl::StrCat("events.endpoint=", with));
  for (std::string& set : with_sets) feature_on.extra_sets.push_back(std::move(set));
  EnvOptions plain = env->options();
  plain.extra_sets.push_back(absl::StrCat("events.endpoint=", without));
  for (std::string& set : without_sets) plain.extra_sets.push_back(std::move(set));
  Subscriber sub_with(with);
  Subscriber sub_without(without);
  absl::StatusOr<BesideResult> r =
      BackupBeside(state, env, config, feature_on, &plain, /*tokens=*/true);
  ::unlink(with.substr(6).c_str());
  ::unlink(without.substr(6).c_str());
  if (!r.ok()) {
    state.SkipWithError(r.status().ToString().c_str());
    return r.status();
  }
  if (sub_with.messages() == 0 || sub_without.messages() == 0) {
    state.SkipWithError("a subscriber received no event: nothing was measured");
    return absl::UnavailableError("a subscriber received no event");
  }
  state.counters["plain_GBps"] = r->plain_gbps;
  state.counters[absl::StrCat(feature, "_GBps")] = r->beside_gbps;
  state.counters["ratio"] = r->beside_gbps / r->plain_gbps;
  return r;
}

void RunBackupTokens(benchmark::State& state, DatapathEnv* env, Summary* summary,
                     const BenchConfig& config) {
  absl::StatusOr<BesideResult> r =
      BackupTwoPublishers(state, env, config, "tokens", {}, {"events.page_tokens=false"});
  if (r.ok()) summary->AddTokens(CaseName(state, r->items), r->beside_gbps, r->plain_gbps);
}

void RunBackupLabelLog(benchmark::State& state, DatapathEnv* env, Summary* summary,
                       const BenchConfig& config) {
  const std::string log = absl::StrCat("/tmp/kvc-bench-labels-", getpid());
  BackupTwoPublishers(state, env, config, "label_log", {absl::StrCat("events.label_log=", log)},
                      {"events.label_log=off"})
      .IgnoreError();
  ::unlink(log.c_str());
}

}  // namespace

void RegisterCopyBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config) {
  for (bool load : {false, true}) {
    benchmark::internal::Benchmark* b = benchmark::RegisterBenchmark(
        load ? "BM_Load" : "BM_Backup",
        [=](benchmark::State& state) { RunCopy(state, env, summary, config, load); });
    for (int layers : {32, 80}) {
      for (int kib : {64, 512, 2048, 8192}) b->Args({kib, layers});
    }
    b->ArgNames({"object_KiB", "layers"})
        ->Iterations(config.copy_iterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  // Backup beside a second daemon that differs in one feature; 64 KiB pages: the most records
  // and events per byte copied.
  using Beside = void (*)(benchmark::State&, DatapathEnv*, Summary*, const BenchConfig&);
  for (auto [name, run] :
       {std::pair<const char*, Beside>{"BM_BackupJournal", RunBackupJournal},
        std::pair<const char*, Beside>{"BM_BackupEvents", RunBackupEvents},
        std::pair<const char*, Beside>{"BM_BackupTokens", RunBackupTokens},
        std::pair<const char*, Beside>{"BM_BackupLabelLog", RunBackupLabelLog}}) {
    benchmark::RegisterBenchmark(name,
                                 [=](benchmark::State& state) { run(state, env, summary, config); })
        ->Args({64, 32})
        ->Args({2048, 80})
        ->ArgNames({"object_KiB", "layers"})
        ->Iterations(config.copy_iterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace kvcellar::bench
