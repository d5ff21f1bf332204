#include "tests/bench/datapath/bench_env.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/splitmix.h"
#include "tests/bench/datapath/noop_server.h"

namespace kvcellar::bench {
namespace {

// A tokenizer vocabulary of the usual size (Llama 3 has 128256); tokens only need to vary.
constexpr uint32_t kVocab = 128000;
// Starting a daemon takes well under a second here; generous for a loaded 2-core machine.
constexpr absl::Duration kStartTimeout = absl::Seconds(30);

}  // namespace

std::vector<uint32_t> PromptTokens(uint64_t seed, size_t n) {
  std::vector<uint32_t> t(n);
  const uint64_t base = core::SplitMix64(seed);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(core::SplitMix64(base + i) % kVocab);
  return t;
}

client::OpResult WaitTerminal(client::Session& session, client::OpResult op, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  while (!op.terminal() && absl::Now() < deadline) {
    client::WaitOptions w;
    w.timeout = std::min(absl::Seconds(1), deadline - absl::Now());
    op = session.WaitOps({op.ref}, w)[0];
    if (!op.terminal() && !op.status.ok()) absl::SleepFor(absl::Milliseconds(20));
  }
  return op;
}

absl::StatusOr<uint64_t> CacheAndPin(client::Session& session,
                                     const std::vector<core::PageKey>& keys) {
  client::MatchSequence ms;
  ms.keys = keys;
  client::MatchOptions pin;
  pin.pin = true;
  client::MatchReply m = session.Match({ms}, pin);
  if (m.results[0].l2_hit_pages != keys.size()) {
    if (m.results[0].pin_id != 0) session.Release({m.results[0].pin_id});
    client::BackupSequence bs;
    bs.keys = keys;
    const std::vector<uint32_t> blocks = BlockRange(0, keys.size());
    bs.blocks = blocks;
    WaitTerminal(session, session.Backup({bs}), absl::Seconds(60));
    m = session.Match({ms}, pin);
  }
  const client::MatchResult& r = m.results[0];
  if (r.l2_hit_pages != keys.size() || r.pin_id == 0) {
    if (r.pin_id != 0) session.Release({r.pin_id});
    return absl::InternalError(absl::StrCat("after Backup ", r.l2_hit_pages, "/", keys.size(),
                                            " pages hit, pin ", r.pin_id, " ",
                                            m.status.ToString()));
  }
  session.KeepPinsAlive({r.pin_id});
  return r.pin_id;
}

std::vector<uint32_t> BlockRange(uint32_t first, size_t n) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + static_cast<uint32_t>(i);
  return v;
}

core::PageKey DatapathEnv::KeyOf(uint64_t n) {
  core::PageKey k;
  for (int w = 0; w < 4; ++w) {
    const uint64_t v = core::SplitMix64(n * 4 + w);
    std::memcpy(k.bytes.data() + 8 * w, &v, sizeof(v));
  }
  return k;
}

absl::StatusOr<std::unique_ptr<DatapathEnv>> DatapathEnv::Start(EnvOptions options) {
  auto env = std::unique_ptr<DatapathEnv>(new DatapathEnv(std::move(options)));
  char tmpl[] = "/tmp/kvcellar-bench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  env->dir_ = tmpl;
  env->daemon_socket_ = env->dir_ + "/kvcellard.sock";
  env->noop_socket_ = env->dir_ + "/noop.sock";

  // The no-op server first: it is the benchmark binary itself, spawned before this process has
  // any gRPC thread.
  absl::StatusOr<ChildProcess> noop =
      ChildProcess::Spawn({env->options_.self, absl::StrCat(kNoopServerFlag, env->noop_socket_)},
                          env->dir_ + "/noop.log");
  if (!noop.ok()) return noop.status();
  env->noop_.emplace(*std::move(noop));

  std::vector<std::string> argv = {
      env->options_.kvcellard,
      "--set",
      absl::StrCat("listen.unix_socket=", env->daemon_socket_),
      "--set",
      absl::StrCat("listen.admin_socket=", env->dir_, "/kvcellard-admin.sock"),
      "--set",
      "http.address=127.0.0.1:0",
      "--set",
      absl::StrCat("pool.capacity=", env->options_.pool_bytes >> 20, "MiB"),
      "--set",
      "device.kind=sim",
  };
  for (const std::string& s : env->options_.extra_sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  absl::StatusOr<ChildProcess> daemon = ChildProcess::Spawn(argv, env->dir_ + "/kvcellard.log");
  if (!daemon.ok()) return daemon.status();
  env->daemon_.emplace(*std::move(daemon));

  if (absl::Status s = env->noop_->WaitForLogLine(kNoopServerReady, kStartTimeout); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("no-op server: ", s.message()));
  }
  if (absl::Status s = env->daemon_->WaitForLogLine("msg=ready", kStartTimeout); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("kvcellard: ", s.message()));
  }
  return env;
}

int DatapathEnv::StopDaemon() { return daemon_ ? daemon_->Stop() : -1; }

DatapathEnv::~DatapathEnv() {
  if (daemon_) daemon_->Stop();
  if (noop_) noop_->Stop();
  if (!options_.keep_dir && !dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

absl::StatusOr<std::unique_ptr<client::Client>> DatapathEnv::Connect(size_t key_cache_bytes) const {
  client::ClientOptions co;
  co.key_cache_bytes = key_cache_bytes;
  co.addr = daemon_socket_;
  co.rpc_timeout = options_.rpc_timeout;
  return client::Client::Connect(co);
}

absl::StatusOr<SimEngineRank> DatapathEnv::RegisterEngine(const EngineSpec& spec) {
  SimEngineRank rank;
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect(spec.key_cache_bytes);
  if (!c.ok()) return c.status();
  rank.client = *std::move(c);

  client::SimEngineOptions so;
  so.num_layers = spec.layers;
  so.bytes_per_block = spec.bytes_per_block;
  so.num_blocks = spec.blocks;
  absl::StatusOr<std::unique_ptr<client::SimEngine>> sim = client::SimEngine::Create(so);
  if (!sim.ok()) return sim.status();
  rank.sim = *std::move(sim);

  client::EngineRegistration reg;
  reg.instance_id = absl::StrCat("bench-", ::getpid(), "-", next_instance_.fetch_add(1));
  reg.ns.model_id = spec.model;
  reg.ns.model_revision = "rev1";
  reg.ns.kv_dtype = "bf16";
  reg.ns.page_size = spec.page_size;
  reg.ns.layout = core::LayoutKind::kMha;
  reg.ns.tp_size = 1;
  reg.ns.opaque_keys = spec.opaque_keys;
  reg.engine_name = "kvcellar_bench_datapath";
  rank.sim->Describe(&reg);
  absl::StatusOr<std::unique_ptr<client::Session>> session = rank.client->Register(reg);
  if (!session.ok()) return session.status();
  rank.session = *std::move(session);
  if (!rank.session->WaitUntilActive(absl::Seconds(5))) {
    return absl::UnavailableError(
        absl::StrCat("session not active: ", client::SessionStateName(rank.session->state())));
  }
  if (rank.session->info().page_object_bytes != rank.sim->page_bytes()) {
    return absl::InternalError(absl::StrCat("daemon page_object_bytes ",
                                            rank.session->info().page_object_bytes,
                                            " != ", rank.sim->page_bytes()));
  }
  return rank;
}

}  // namespace kvcellar::bench
