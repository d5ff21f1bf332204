// kvcellar-bench: load generator and consistency checker for a running kvcellard (in the spirit
// of CacheLib's cachebench). It drives the daemon with simulated engine ranks on the sim device
// using a multi-turn conversation workload (workload.h), verifies every byte it loads
// (engine_group.h), and prints a summary: hit rate per tier next to the workload's best case,
// tokens/s, GB/s per direction, and p50/p99 per RPC (report.h).
//
// Exit codes: 0 ok; 1 wrong bytes were loaded; 2 usage; 3 setup failed (daemon unreachable,
// registration rejected, shared memory); 4 the run could not finish.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "client/tools/bench/engine_group.h"
#include "client/tools/bench/flags.h"
#include "client/tools/bench/model_shape.h"
#include "client/tools/bench/report.h"
#include "client/tools/bench/stats.h"
#include "client/tools/bench/workload.h"
#include "core/eviction_sim.h"
#include "grpcpp/client_context.h"
#include "kvcellar/v1/admin_service.grpc.pb.h"
#include "platform/runtime_paths.h"

namespace kvcellar::bench {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitMismatch = 1;
constexpr int kExitUsage = 2;
constexpr int kExitSetup = 3;
constexpr int kExitRun = 4;

constexpr char kIntro[] =
    R"(usage: kvcellar-bench [FLAGS]

Drives a running kvcellard with simulated engine ranks on the sim device, using the multi-turn
conversation workload SGLang HiCache is benchmarked with (80 clients x 10 rounds, 2048 new
tokens and 1 output token per round, 4 requests in parallel). Client c's round r sends its whole
history plus new tokens; the engine Matches the prompt, Loads the cached prefix (every byte
verified against a deterministic pattern), computes the rest and Backs up its new full pages.
Clients are served first come, first served, so a round's previous round is always complete.

Scaling: the workload is fixed in tokens; the bytes per token are sized to the daemon. Unless
--layers is given, the model has head dim 128 (or --mla-latent), --dtype, 1 KV head per TP rank
and the largest power-of-two number of layers (up to 64, then KV heads double; unless
--page-size is given, the smallest page size from 64 tokens) at which every page the workload
computes takes at most --fill of the daemon's L2 capacity (read with AdminService.GetStatus). At the default fill (0.8) the whole
history fits, so the measured hit rate should equal the best case; --fill 2 makes the eviction
policy choose. The summary states the shape and the footprint.

Best case: the share of prompt tokens an unbounded cache serves, page-rounded: for every round
after the first, the full pages of the previous round's KV (prompt + output tokens but the last),
plus the shared system prompt's full pages for every client after the first.

Output: a progress line on stderr once a second, the summary on stdout (--json: as JSON).
Exit codes: 0 ok; 1 wrong bytes were loaded; 2 usage; 3 setup failed (daemon unreachable,
registration rejected, shared memory); 4 the run could not finish.
)";

struct Config {
  std::string socket;
  WorkloadSpec workload;
  uint32_t parallel = 4;
  ModelShape shape;
  bool auto_layers = true;
  bool auto_page_size = true;
  double fill = 0.8;
  bool fill_given = false;
  uint32_t gpu_blocks = 0;  // 0: parallel x the largest request.
  std::string revision;
  std::string model_id;
  std::string tenant;
  bool json = false;
  std::string json_file;
  bool progress = true;
  absl::Duration rpc_timeout;
  absl::Duration op_timeout;
};

void DefineFlags(Flags& f) {
  f.Section("daemon");
  f.Define("--socket", "",
           "daemon socket path or HOST:PORT\n(default: kvcellarctl's, " +
               platform::DefaultSocketPath() + ")",
           "PATH");
  f.Define("--rpc-timeout-ms", "2000", "deadline of each RPC");
  f.Define("--op-timeout-ms", "30000", "longest wait for a Load, Backup or prefetch op");
  f.Section("workload");
  f.Define("--clients", "80", "conversations");
  f.Define("--rounds", "10", "rounds per conversation");
  f.Define("--new-tokens", "2048", "new prompt tokens per round");
  f.Define("--output-tokens", "1", "output tokens per round (>= 1)");
  f.Define("--parallel", "4", "requests in flight at most");
  f.Define("--system-prompt-tokens", "0", "a system prompt shared by every client");
  f.Define("--seed", "1", "seed of the token ids and of the KV byte pattern");
  f.Define("--shape", "",
           "instead of the conversations above, replay a traffic shape of the\n"
           "eviction benchmark (core/eviction_shapes.h): multi_turn, multi_turn_2,\n"
           "zipf_prompts, chat_and_scans or two_tenants; its page size is fixed,\n"
           "--fill defaults to its history / L2, and the summary gives Belady's\n"
           "bound at the run's L2",
           "NAME");
  f.Define("--shape-scale", "1", "shrink the shape's clients, requests and documents (< 1)", "F");
  f.Section("model (see Scaling)");
  f.Define("--page-size", "", "tokens per page (default: scaled; 64 with --layers)");
  f.Define("--layers", "", "layers (default: scaled to L2)");
  f.Define("--kv-heads", "", "KV heads, a multiple of --tp (default: --tp)");
  f.Define("--head-dim", "128", "elements per head");
  f.Define("--dtype", "bf16", "fp32, fp16, bf16, fp8_e4m3, fp8_e5m2 or int8", "DTYPE");
  f.Define("--mla-latent", "0", "MLA latent size per token (e.g. 576); 0 = MHA/GQA");
  f.Define("--tp", "1", "TP ranks of the engine instance (one session each)");
  f.Define("--fill", "0.8", "scaling target: workload KV / L2 capacity", "F");
  f.Section("engine");
  f.Define("--gpu-blocks", "", "KV blocks per rank (default: --parallel x the largest request)");
  f.Define("--model", "kvcellar-bench", "namespace model id", "ID");
  f.Define("--tenant", "", "namespace tenant (tenants.allow must grant it; tenants.quotas)",
           "TENANT");
  f.Define("--revision", "",
           "namespace revision (default: fresh per run, so runs start cold;\n"
           "give one to reuse and re-verify an earlier run's pages)",
           "REV");
  f.Section("output");
  f.Define("--json", "", "print the summary as JSON on stdout, or write it to FILE", "[FILE]");
  f.DefineBool("--no-progress", "no progress line on stderr");
}

absl::Status ReadConfig(const Flags& f, Config* c) {
  uint64_t v = 0;
  c->socket = f.Given("--socket") ? f.Str("--socket") : platform::DefaultSocketPath();
  if (c->socket.empty()) return absl::InvalidArgumentError("--socket: empty");
  auto u32 = [&](const char* name, uint64_t min, uint64_t max, uint32_t* out) -> absl::Status {
    absl::Status s = f.U64(name, min, max, &v);
    if (s.ok()) *out = static_cast<uint32_t>(v);
    return s;
  };
  absl::Status s;
  uint32_t ms = 0;
  if (!(s = u32("--rpc-timeout-ms", 1, 600000, &ms)).ok()) return s;
  c->rpc_timeout = absl::Milliseconds(ms);
  if (!(s = u32("--op-timeout-ms", 1, 3600000, &ms)).ok()) return s;
  c->op_timeout = absl::Milliseconds(ms);
  WorkloadSpec& w = c->workload;
  if (!(s = u32("--clients", 1, 1 << 20, &w.clients)).ok()) return s;
  if (!(s = u32("--rounds", 1, 10000, &w.rounds)).ok()) return s;
  if (!(s = u32("--new-tokens", 1, 1 << 24, &w.new_tokens)).ok()) return s;
  if (!(s = u32("--output-tokens", 1, 1 << 24, &w.output_tokens)).ok()) return s;
  if (!(s = u32("--parallel", 1, 1024, &c->parallel)).ok()) return s;
  if (!(s = u32("--system-prompt-tokens", 0, 1 << 24, &w.system_prompt_tokens)).ok()) return s;
  if (!(s = f.U64("--seed", 0, UINT64_MAX, &w.seed)).ok()) return s;
  w.shape = f.Str("--shape");
  if (f.Given("--shape") && w.shape.empty()) return absl::InvalidArgumentError("--shape: empty");
  if (!(s = f.Double("--shape-scale", 0.001, 1, &w.shape_scale)).ok()) return s;
  ModelShape& m = c->shape;
  if (!(s = u32("--tp", 1, 64, &m.tp)).ok()) return s;
  c->auto_page_size = !f.Given("--page-size");
  c->auto_layers = !f.Given("--layers");
  m.page_size = 64;
  if (!c->auto_page_size && !(s = u32("--page-size", 1, 4096, &m.page_size)).ok()) return s;
  if (!c->auto_layers && !(s = u32("--layers", 1, 1024, &m.layers)).ok()) return s;
  m.kv_heads = m.tp;
  if (f.Given("--kv-heads") && !(s = u32("--kv-heads", 1, 1024, &m.kv_heads)).ok()) return s;
  if (!(s = u32("--head-dim", 1, 65536, &m.head_dim)).ok()) return s;
  if (!(s = u32("--mla-latent", 0, 65536, &m.mla_latent)).ok()) return s;
  m.dtype = f.Str("--dtype");
  if (!(s = m.Validate()).ok()) return s;
  if (!(s = f.Double("--fill", 0.001, 1000, &c->fill)).ok()) return s;
  c->fill_given = f.Given("--fill");
  if (f.Given("--gpu-blocks") && !(s = u32("--gpu-blocks", 1, 1 << 24, &c->gpu_blocks)).ok()) {
    return s;
  }
  c->model_id = f.Str("--model");
  if (c->model_id.empty()) return absl::InvalidArgumentError("--model: empty");
  c->tenant = f.Str("--tenant");
  c->revision = f.Str("--revision");
  if (f.Given("--revision") && c->revision.empty()) {
    return absl::InvalidArgumentError("--revision: empty");
  }
  c->json = f.Given("--json");
  c->json_file = f.Str("--json");
  c->progress = !f.Bool("--no-progress");
  return absl::OkStatus();
}

// The daemon's status over the engine socket (the read-only AdminService RPCs are served there).
absl::StatusOr<v1::GetStatusResponse> DaemonStatus(const std::string& addr) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      client::MakeChannel(addr, client::ChannelOptions{});
  if (!channel.ok()) return channel.status();
  std::unique_ptr<v1::AdminService::Stub> stub = v1::AdminService::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  v1::GetStatusResponse reply;
  const grpc::Status st = stub->GetStatus(&ctx, v1::GetStatusRequest(), &reply);
  if (!st.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach kvcellard at ", addr, ": ", st.error_message()));
  }
  if (!reply.ready()) {
    return absl::UnavailableError(
        absl::StrCat("kvcellard at ", addr, " is not ready: ", reply.not_ready_reason()));
  }
  return reply;
}

// One thread's memcpy speed on buffers larger than the caches: the baseline of the GB/s figures.
double MemcpyGbPerS() {
  constexpr size_t kBytes = 64 << 20;  // Far past the last-level cache of these CPUs.
  constexpr int kCopies = 6;
  std::vector<char> a(kBytes, 1), b(kBytes, 2);
  std::memcpy(b.data(), a.data(), kBytes);  // Fault both in.
  const absl::Time start = absl::Now();
  for (int i = 0; i < kCopies; ++i)
    std::memcpy((i % 2 ? a : b).data(), (i % 2 ? b : a).data(), kBytes);
  const double s = absl::ToDoubleSeconds(absl::Now() - start);
  return s > 0 ? kCopies * static_cast<double>(kBytes) / s / 1e9 : 0;
}

// Hands the workload's requests to worker threads: chains first come, first served, a chain's
// next request once its previous one is done.
class Scheduler {
 public:
  explicit Scheduler(std::vector<std::vector<uint64_t>> chains)
      : chains_(std::move(chains)), next_(chains_.size(), 0) {
    for (uint32_t c = 0; c < chains_.size(); ++c) {
      if (chains_[c].empty()) continue;
      queue_.push_back(c);
      remaining_ += chains_[c].size();
    }
  }
  // The next request and its chain, or false when everything is done or the run was stopped.
  bool Next(uint32_t* chain, uint64_t* request, uint64_t* step) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !queue_.empty() || remaining_ == 0 || stopped_;
    };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty() || stopped_) return false;
    *chain = queue_.front();
    queue_.pop_front();
    *request = chains_[*chain][next_[*chain]];
    *step = ++steps_;
    return true;
  }
  void Done(uint32_t chain) {
    absl::MutexLock lock(&mu_);
    --remaining_;
    if (++next_[chain] < chains_[chain].size()) queue_.push_back(chain);
  }
  void Stop(const std::string& why) {
    absl::MutexLock lock(&mu_);
    if (!stopped_) error_ = why;
    stopped_ = true;
  }
  std::string error() const {
    absl::MutexLock lock(&mu_);
    return error_;
  }

 private:
  const std::vector<std::vector<uint64_t>> chains_;
  mutable absl::Mutex mu_;
  std::deque<uint32_t> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> next_ ABSL_GUARDED_BY(mu_);
  uint64_t remaining_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::string error_ ABSL_GUARDED_BY(mu_);
};

// The run's description from the daemon's status and the workload: shape (auto-scaled to L2
// when asked), device blocks, namespace revision, the memcpy baseline. Returns an exit code on a
// usage error, nullopt when the run can go ahead.
std::optional<int> PlanRun(const v1::GetStatusResponse& status, Config& c, Workload& workload,
                           RunInfo& info) {
  info.socket = c.socket;
  info.daemon_version = status.version();
  info.l2_capacity = status.pool().capacity_bytes();
  info.l2_used_at_start = status.pool().used_bytes();
  info.parallel = c.parallel;
  if (const uint32_t fixed = workload.FixedPageSize(); fixed != 0) {
    if (!c.auto_page_size && c.shape.page_size != fixed) {
      std::fprintf(stderr, "kvcellar-bench: --page-size: shape %s has pages of %u tokens\n",
                   c.workload.shape.c_str(), fixed);
      return kExitUsage;
    }
    c.auto_page_size = false;
    c.shape.page_size = fixed;
    // The shape's own ratio of history to L2, unless asked otherwise.
    if (!c.fill_given) {
      c.fill = static_cast<double>(workload.DistinctPages()) /
               static_cast<double>(workload.shape()->capacity_pages);
    }
  }
  info.fill = c.fill;
  info.auto_scaled = c.auto_layers;
  auto pages_at = [&workload](uint32_t page_size) {
    return workload.WithPageSize(page_size).DistinctPages();
  };
  if (c.auto_layers) {
    AutoScale(info.l2_capacity, c.fill, c.auto_page_size, pages_at, &c.shape);
  }
  workload = workload.WithPageSize(c.shape.page_size);
  c.workload.page_size = c.shape.page_size;
  info.workload = c.workload;
  if (const core::EvictionShape* shape = workload.shape(); shape != nullptr) {
    info.shape_name = shape->name;
    info.l2_pages = c.shape.L2BytesPerPage() == 0 ? 0 : info.l2_capacity / c.shape.L2BytesPerPage();
    info.bound_hit_rate = core::SimulateBelady(shape->trace, info.l2_pages).HitRate();
  }
  info.shape = c.shape;
  info.requests = workload.requests();
  info.total_prompt_tokens = workload.TotalPromptTokens();
  info.best_case_hit_tokens = workload.TotalBestCaseHitTokens();
  info.distinct_pages = workload.DistinctPages();
  info.footprint_ratio = info.l2_capacity == 0 ? 0
                                               : static_cast<double>(info.distinct_pages) *
                                                     static_cast<double>(c.shape.L2BytesPerPage()) /
                                                     static_cast<double>(info.l2_capacity);
  const uint64_t max_pages = workload.MaxPagesPerRequest();
  if (c.gpu_blocks == 0) {
    c.gpu_blocks = static_cast<uint32_t>(std::max<uint64_t>(1, max_pages * c.parallel));
  } else if (c.gpu_blocks < max_pages) {
    std::fprintf(stderr,
                 "kvcellar-bench: --gpu-blocks: %u blocks cannot hold the largest request (%llu "
                 "pages)\n",
                 c.gpu_blocks, static_cast<unsigned long long>(max_pages));
    return kExitUsage;
  }
  info.gpu_blocks = c.gpu_blocks;
  if (info.l2_used_at_start > 0) {
    std::fprintf(stderr,
                 "kvcellar-bench: note: L2 already holds %s (earlier runs, other engines); those "
                 "pages compete for space, and the hit rate may fall below the best case\n",
                 HumanBytes(static_cast<double>(info.l2_used_at_start)).c_str());
  }
  if (c.auto_layers && info.footprint_ratio > c.fill * 1.0001) {
    std::fprintf(stderr,
                 "kvcellar-bench: note: even the smallest shape needs %.2f of L2 (--fill %.2f); "
                 "the hit rate will show evictions\n",
                 info.footprint_ratio, c.fill);
  }
  // A fresh namespace per run unless --revision says otherwise.
  std::mt19937_64 rng(static_cast<uint64_t>(getpid()) ^
                      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  info.revision = c.revision.empty() ? absl::StrFormat("run-%016x", rng()) : c.revision;
  info.instance_id = absl::StrCat("kvcellar-bench-", getpid());
  info.memcpy_gb_s = MemcpyGbPerS();
  return std::nullopt;
}

// Runs every (client, round) request on c.parallel threads, with a progress line each second
// when asked. Stops at the first request that fails (the scheduler keeps why).
void RunWorkload(const Config& c, const Workload& workload, EngineGroup& group, Stats& stats,
                 Scheduler& scheduler, RunInfo& info) {
  const bool tty = isatty(STDERR_FILENO);
  const absl::Time start = absl::Now();
  std::vector<std::thread> workers;
  for (uint32_t t = 0; t < c.parallel; ++t) {
    workers.emplace_back([&] {
      uint32_t chain = 0;
      uint64_t request = 0, step = 0;
      while (scheduler.Next(&chain, &request, &step)) {
        const std::vector<uint32_t> tokens = workload.Tokens(request);
        absl::StatusOr<RequestResult> r = group.Run(step, tokens, workload.PromptTokens(request));
        if (!r.ok()) {
          scheduler.Stop(std::string(r.status().message()));
          return;
        }
        r->best_case_hit_tokens = workload.BestCaseHitTokens(request);
        stats.Add(*r);
        scheduler.Done(chain);
      }
    });
  }
  absl::Mutex done_mu;
  bool done = false;
  std::thread progress([&] {
    if (!c.progress) return;
    absl::MutexLock lock(&done_mu);
    while (!done_mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(1))) {
      const std::string l =
          ProgressLine(info, stats.snapshot(), absl::ToDoubleSeconds(absl::Now() - start));
      std::fprintf(stderr, tty ? "\r%s\x1b[K" : "%s\n", l.c_str());
    }
  });
  for (std::thread& w : workers) w.join();
  info.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  {
    absl::MutexLock lock(&done_mu);
    done = true;
  }
  progress.join();
  if (c.progress) {
    const std::string l = ProgressLine(info, stats.snapshot(), info.wall_s);
    std::fprintf(stderr, tty ? "\r%s\x1b[K\n" : "%s\n", l.c_str());
  }
}

// The summary (text, JSON or both) and the exit code: WRONG KV BYTES first, then a stopped run.
int Report(const Config& c, const RunInfo& info, const Stats& stats,
           const Scheduler& scheduler) {
  const Stats::Snapshot snap = stats.snapshot();
  const auto latencies = stats.Latencies();
  const std::string json = SummaryJson(info, snap, latencies);
  if (c.json && c.json_file.empty()) {
    std::printf("%s\n", json.c_str());
  } else {
    std::fputs(SummaryText(info, snap, latencies).c_str(), stdout);
    if (!c.json_file.empty()) {
      FILE* out = std::fopen(c.json_file.c_str(), "w");
      if (out == nullptr || std::fprintf(out, "%s\n", json.c_str()) < 0 || std::fclose(out) != 0) {
        std::fprintf(stderr, "kvcellar-bench: --json: cannot write %s: %s\n", c.json_file.c_str(),
                     std::strerror(errno));
        return kExitRun;
      }
    }
  }
  std::fflush(stdout);
  if (snap.sum.mismatched_bytes > 0) {
    std::fprintf(stderr, "kvcellar-bench: %llu WRONG KV BYTES loaded (first: %s)\n",
                 static_cast<unsigned long long>(snap.sum.mismatched_bytes),
                 snap.sum.first_mismatch.c_str());
    return kExitMismatch;
  }
  if (snap.sum.degraded_calls > 0 || info.client.rpcs_failed > 0) {
    std::fprintf(stderr,
                 "kvcellar-bench: note: %llu calls were answered as misses without the daemon "
                 "(%llu RPCs failed): the hit rate measures an unhealthy daemon\n",
                 static_cast<unsigned long long>(snap.sum.degraded_calls),
                 static_cast<unsigned long long>(info.client.rpcs_failed));
  }
  if (const std::string e = scheduler.error(); !e.empty()) {
    std::fprintf(stderr, "kvcellar-bench: stopped after %llu of %llu requests: %s\n",
                 static_cast<unsigned long long>(snap.requests),
                 static_cast<unsigned long long>(info.requests), e.c_str());
    return kExitRun;
  }
  return kExitOk;
}

int Main(int argc, char** argv) {
  Flags flags;
  DefineFlags(flags);
  if (absl::Status s = flags.Parse(argc, argv, {"--json"}); !s.ok()) {
    std::fprintf(stderr, "kvcellar-bench: %s (--help lists the flags)\n",
                 std::string(s.message()).c_str());
    return kExitUsage;
  }
  if (flags.help()) {
    std::printf("%s%s", kIntro, flags.HelpText().c_str());
    return kExitOk;
  }
  Config c;
  if (absl::Status s = ReadConfig(flags, &c); !s.ok()) {
    std::fprintf(stderr, "kvcellar-bench: %s\n", std::string(s.message()).c_str());
    return kExitUsage;
  }
  absl::StatusOr<Workload> workload = Workload::Create(c.workload);
  if (!workload.ok()) {
    std::fprintf(stderr, "kvcellar-bench: %s\n", std::string(workload.status().message()).c_str());
    return kExitUsage;
  }
  // An engine whose daemon dies must not die of SIGPIPE.
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<v1::GetStatusResponse> status = DaemonStatus(c.socket);
  if (!status.ok()) {
    std::fprintf(stderr, "kvcellar-bench: %s\n", std::string(status.status().message()).c_str());
    return kExitSetup;
  }
  RunInfo info;
  if (std::optional<int> exit = PlanRun(*status, c, *workload, info)) return *exit;

  Stats stats;
  EngineGroupOptions go;
  go.addr = c.socket;
  go.shape = c.shape;
  go.num_blocks = c.gpu_blocks;
  go.instance_id = info.instance_id;
  go.model_id = c.model_id;
  go.tenant = c.tenant;
  go.revision = info.revision;
  go.kv_seed = c.workload.seed ^ 0x6b76636c6c6172ull;  // "kvcllar": apart from the token seed.
  go.rpc_timeout = c.rpc_timeout;
  go.op_timeout = c.op_timeout;
  absl::StatusOr<std::unique_ptr<EngineGroup>> group = EngineGroup::Create(go, &stats);
  if (!group.ok()) {
    std::fprintf(stderr, "kvcellar-bench: %s\n", std::string(group.status().message()).c_str());
    return kExitSetup;
  }
  info.l3_tiers = (*group)->l3_tier_names();
  Scheduler scheduler(workload->Chains());
  RunWorkload(c, *workload, **group, stats, scheduler, info);
  info.quarantined_blocks = (*group)->quarantined_blocks();
  info.client = (*group)->client_stats();
  (*group)->Close();
  return Report(c, info, stats, scheduler);
}

}  // namespace
}  // namespace kvcellar::bench

int main(int argc, char** argv) { return kvcellar::bench::Main(argc, argv); }
