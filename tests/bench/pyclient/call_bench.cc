#include "tests/bench/pyclient/call_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "core/splitmix.h"

namespace kvcellar::bench {
namespace {

// A tokenizer vocabulary of the usual size (Llama 3 has 128256); tokens only need to vary.
constexpr uint32_t kVocab = 128000;
// Longest wait for one op. A 2048-page batch of small objects takes well under a millisecond;
// the margin covers a loaded 2-core machine. Same as the package's default wait().
constexpr absl::Duration kOpWait = absl::Seconds(5);
// Completion slots registered, as many as the package registers by default (load_slots,
// ready_slots of Client.register).
constexpr uint32_t kSlots = 4;
// Fresh Backup keys of different seeds never meet: the seed takes the high bits of the counter.
constexpr int kSeedShift = 40;
// The prompt's pin lasts the whole run: the daemon's longest lease (server/config/cache_limits.h).
constexpr uint32_t kPinLeaseMs = 3600 * 1000;
// Backup-and-pin attempts for the prompt (see CacheAndPinPrompt).
constexpr int kCacheAttempts = 5;

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::string OpError(const client::OpResult& r, uint32_t want) {
  return absl::StrCat("op ", client::OpStateName(r.state), " with ", r.usable_pages(0), "/", want,
                      " pages usable: ", r.status.ok() ? r.error_message : r.status.ToString());
}

}  // namespace

double CallSamples::Quantile(double q) const {
  if (us.empty()) return 0;
  std::vector<double> s = us;
  std::sort(s.begin(), s.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * s.size()));
  return s[std::min(s.size() - 1, rank == 0 ? 0 : rank - 1)];
}

double CallSamples::Mean() const {
  return us.empty() ? 0 : std::accumulate(us.begin(), us.end(), 0.0) / us.size();
}

absl::StatusOr<std::unique_ptr<CallBench>> CallBench::Start(const CallBenchConfig& config) {
  auto b = std::unique_ptr<CallBench>(new CallBench(config));
  const uint32_t pages = config.pages;
  const uint32_t blocks = config.blocks != 0 ? config.blocks : 2 * pages;
  if (pages == 0 || blocks < 2 * pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("need pages > 0 and blocks >= 2 * pages; got ", pages, ", ", blocks));
  }
  client::ClientOptions co;
  co.addr = config.socket;
  // Above the library's 250 ms: a submission past its deadline makes the library replace the
  // session, which would end the run; a slow call shows in the figures instead.
  co.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(co);
  if (!c.ok()) return c.status();
  b->client_ = *std::move(c);

  client::SimEngineOptions so;
  so.num_layers = config.layers;
  so.bytes_per_block = config.bytes_per_block;
  so.num_blocks = blocks;
  so.load_slots = kSlots;
  so.ready_slots = kSlots;
  absl::StatusOr<std::unique_ptr<client::SimEngine>> sim = client::SimEngine::Create(so);
  if (!sim.ok()) return sim.status();
  b->sim_ = *std::move(sim);

  client::EngineRegistration reg;
  reg.instance_id =
      config.instance_id.empty() ? absl::StrCat("pyclient-cxx-", ::getpid()) : config.instance_id;
  reg.ns.model_id = config.model;
  reg.ns.model_revision = "rev1";
  reg.ns.kv_dtype = "bf16";
  reg.ns.page_size = config.page_size;
  reg.ns.layout = core::LayoutKind::kMha;
  reg.ns.tp_size = 1;
  reg.engine_name = "kvcellar_bench_pyclient";
  b->sim_->Describe(&reg);
  absl::StatusOr<std::unique_ptr<client::Session>> s = b->client_->Register(reg);
  if (!s.ok()) return s.status();
  b->session_ = *std::move(s);
  if (!b->session_->WaitUntilActive(absl::Seconds(10))) {
    return absl::UnavailableError(
        absl::StrCat("session not active: ", client::SessionStateName(b->session_->state())));
  }

  // The prompt: distinct per seed, so runs with other seeds (the Python side) share no page.
  b->tokens_.resize(size_t{pages} * config.page_size);
  const uint64_t base = core::SplitMix64(config.seed);
  for (size_t i = 0; i < b->tokens_.size(); ++i) {
    b->tokens_[i] = static_cast<uint32_t>(core::SplitMix64(base + i) % kVocab);
  }
  b->keys_ = b->session_->ComputeKeys(b->tokens_);
  b->src_blocks_ = Range(0, pages);
  b->dst_blocks_ = Range(pages, pages);
  if (absl::Status s = b->CacheAndPinPrompt(); !s.ok()) return s;
  return b;
}

absl::Status CallBench::CacheAndPinPrompt() {
  // Pinned for the run: in a full pool the daemon evicts pages seen once first (s3fifo), and a
  // freshly backed-up prompt is such pages, so it could be gone before the Matches and Loads.
  // Retried because that can also happen between the Backup and the pinning Match.
  std::string error;
  for (int attempt = 0; attempt < kCacheAttempts; ++attempt) {
    if (!Backup(keys_, /*wait=*/true, &error)) {
      return absl::InternalError(absl::StrCat("caching the prompt: ", error));
    }
    client::MatchSequence seq;
    seq.tokens = tokens_;
    client::MatchOptions pin;
    pin.pin = true;
    pin.pin_lease_ms = kPinLeaseMs;
    const client::MatchResult r = session_->Match({seq}, pin).results[0];
    if (r.l2_hit_pages == config_.pages && r.pin_id != 0) {
      pin_id_ = r.pin_id;
      return absl::OkStatus();
    }
    if (r.pin_id != 0) session_->Release({r.pin_id});
    error = absl::StrCat("after Backup, Match hit ", r.l2_hit_pages, "/", config_.pages);
  }
  return absl::InternalError(absl::StrCat("caching the prompt: ", error));
}

CallBench::~CallBench() {
  if (!session_) return;
  if (pin_id_ != 0) session_->Release({pin_id_});
  session_->Close();
}

bool CallBench::MatchKeys(std::string* error) {
  client::MatchSequence seq;
  seq.keys = keys_;
  const client::MatchReply m = session_->Match({seq});
  if (m.results[0].l2_hit_pages == config_.pages) return true;
  *error = absl::StrCat("Match by keys hit ", m.results[0].l2_hit_pages, "/", config_.pages, " ",
                        m.status.ToString());
  return false;
}

bool CallBench::MatchTokens(std::string* error) {
  client::MatchSequence seq;
  seq.tokens = tokens_;
  const client::MatchReply m = session_->Match({seq});
  if (m.results[0].l2_hit_pages == config_.pages && m.results[0].keys.size() == config_.pages) {
    return true;
  }
  *error = absl::StrCat("Match by tokens hit ", m.results[0].l2_hit_pages, "/", config_.pages, " ",
                        m.status.ToString());
  return false;
}

bool CallBench::Load(bool wait, std::string* error) {
  client::LoadSequence seq;
  seq.keys = keys_;
  seq.blocks = dst_blocks_;
  client::LoadOptions lo;
  lo.signal_layers = true;
  lo.completion_slot = next_load_slot_;
  next_load_slot_ = (next_load_slot_ + 1) % kSlots;
  pending_ = session_->Load({seq}, lo);
  return wait ? FinishLoad(error) : true;
}

bool CallBench::FinishLoad(std::string* error) { return Finish(config_.pages, error); }

bool CallBench::Backup(const std::vector<core::PageKey>& keys, bool wait, std::string* error) {
  client::BackupSequence seq;
  seq.keys = keys;
  seq.blocks = src_blocks_;
  client::BackupOptions bo;
  bo.has_ready = true;
  bo.ready_slot = next_ready_slot_;
  bo.ready_token = sim_->NextReadyToken();
  next_ready_slot_ = (next_ready_slot_ + 1) % kSlots;
  // The engine's writes to the blocks are done: published before the submission, as the package
  // does (Session.backup with ready=True).
  sim_->PublishReady(bo.ready_slot, bo.ready_token);
  pending_ = session_->Backup({seq}, bo);
  return wait ? FinishBackup(error) : true;
}

bool CallBench::FinishBackup(std::string* error) { return Finish(config_.pages, error); }

bool CallBench::Finish(uint32_t want, std::string* error) {
  if (!pending_.terminal() && pending_.ref.op_id != 0) {
    client::WaitOptions w;
    w.timeout = kOpWait;
    w.omit_page_status = true;  // What the package's wait() asks for.
    pending_ = session_->WaitOps({pending_.ref}, w)[0];
  }
  if (pending_.usable_pages(0) == want) return true;
  *error = OpError(pending_, want);
  return false;
}

void CallBench::FreshKeys(std::vector<core::PageKey>* keys) {
  keys->resize(config_.pages);
  for (core::PageKey& k : *keys) {
    const uint64_t n = (config_.seed << kSeedShift) | next_key_++;
    for (int w = 0; w < 4; ++w) {
      const uint64_t v = core::SplitMix64(n * 4 + w);
      std::memcpy(k.bytes.data() + 8 * w, &v, sizeof(v));
    }
  }
}

namespace {

// One case: `prepare` (untimed) then `call` (timed) per iteration, `finish` (untimed) after it.
struct Case {
  const char* name;
  std::function<void()> prepare;
  std::function<bool(std::string*)> call;
  std::function<bool(std::string*)> finish;
};

void RunCase(benchmark::State& state, CallBench* bench, const Case& c) {
  using Clock = std::chrono::steady_clock;
  std::string error;
  Lockstep& lockstep = bench->lockstep();
  auto once = [&](CallSamples* samples) {
    if (!lockstep.Await(&error)) return false;
    if (c.prepare) c.prepare();
    const Clock::time_point t0 = Clock::now();
    bool ok = c.call(&error);
    const Clock::time_point t1 = Clock::now();
    if (ok && c.finish) ok = c.finish(&error);
    if (samples != nullptr) {
      const double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
      samples->us.push_back(us);
      state.SetIterationTime(us / 1e6);
    }
    if (!ok) {
      lockstep.Close();  // The peer stops too, rather than waiting for a turn never passed.
      return false;
    }
    return lockstep.Pass(&error);
  };
  for (int i = 0; i < bench->config().warmup; ++i) {
    if (!once(nullptr)) {
      state.SkipWithError(absl::StrCat("warm-up: ", error).c_str());
      return;
    }
  }
  CallSamples samples;
  for (auto _ : state) {
    if (!once(&samples)) {
      state.SkipWithError(error.c_str());
      return;
    }
  }
  if (const std::string& path = bench->config().samples_path; !path.empty()) {
    std::ofstream out(path, std::ios::app);
    out << c.name;
    for (double us : samples.us) out << ' ' << us;
    out << '\n';
    if (!out) {
      state.SkipWithError(absl::StrCat("cannot write ", path).c_str());
      return;
    }
  }
  state.counters["p50_us"] = samples.Quantile(0.50);
  state.counters["p90_us"] = samples.Quantile(0.90);
  state.counters["p99_us"] = samples.Quantile(0.99);
  state.counters["mean_us"] = samples.Mean();
  state.counters["min_us"] = samples.Quantile(0);
  state.counters["pages"] = bench->config().pages;
}

}  // namespace

void RegisterCallBenchmarks(CallBench* bench) {
  // Fresh keys for the Backup cases, made untimed before each call.
  auto keys = std::make_shared<std::vector<core::PageKey>>();
  auto fresh = [bench, keys] { bench->FreshKeys(keys.get()); };
  const std::vector<Case> cases = {
      {"BM_MatchKeys", nullptr, [bench](std::string* e) { return bench->MatchKeys(e); }, nullptr},
      {"BM_MatchTokens", nullptr, [bench](std::string* e) { return bench->MatchTokens(e); },
       nullptr},
      {"BM_Load", nullptr, [bench](std::string* e) { return bench->Load(true, e); }, nullptr},
      {"BM_LoadSubmit", nullptr, [bench](std::string* e) { return bench->Load(false, e); },
       [bench](std::string* e) { return bench->FinishLoad(e); }},
      {"BM_Backup", fresh, [bench, keys](std::string* e) { return bench->Backup(*keys, true, e); },
       nullptr},
      {"BM_BackupSubmit", fresh,
       [bench, keys](std::string* e) { return bench->Backup(*keys, false, e); },
       [bench](std::string* e) { return bench->FinishBackup(e); }},
  };
  for (const Case& c : cases) {
    benchmark::RegisterBenchmark(c.name,
                                 [bench, c](benchmark::State& state) { RunCase(state, bench, c); })
        ->Iterations(bench->config().iterations)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace kvcellar::bench
