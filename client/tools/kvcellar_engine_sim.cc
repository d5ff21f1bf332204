// kvcellar-engine-sim: a real engine process on the sim device, for integration tests.
//
//   kvcellar-engine-sim [ENGINE FLAGS] COMMAND [COMMAND FLAGS]
//
// It creates a sim KV cache (client/sim_engine.h), registers it with libkvcellar-client, and runs
// one command. Tokens come from --tokens-seed (page i of a prompt is a pure function of it), and
// block bytes from the pattern of (seed, page key, shard, layer, byte), so any process can verify
// what another backed up. One JSON object on stdout per command (hold prints it before sleeping);
// log lines on stderr.
//
// Exit codes: 0 success; 1 wrong bytes were loaded (the failure that must never happen); 2 usage;
// 3 setup failed (shared memory, client, registration rejected by the daemon); 4 the cache did
// less than --expect-* asked (not stored, too few hits, never registered).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/kvcellar_client.h"
#include "client/sim_engine.h"
#include "client/tools/json_object.h"
#include "core/splitmix.h"
#include "platform/runtime_paths.h"

namespace {

namespace kc = ::kvcellar::client;
namespace core = ::kvcellar::core;

constexpr int kExitOk = 0;
constexpr int kExitMismatch = 1;
constexpr int kExitUsage = 2;
constexpr int kExitSetup = 3;
constexpr int kExitExpectation = 4;

// A vocabulary size of a typical tokenizer (Llama 3 has 128256); tokens only need to vary.
constexpr uint32_t kVocab = 128000;
// Bytes of a stale-block marker: loaded blocks are set to this first, so a page the daemon claims
// to have loaded but did not shows up as a mismatch.
constexpr uint8_t kStaleByte = 0xEE;

constexpr char kUsage[] = R"(usage: kvcellar-engine-sim [ENGINE FLAGS] COMMAND [FLAGS]

engine flags:
  --addr SOCK            daemon socket (default: the default socket path)
  --instance ID          instance id (default sim-PID)
  --rank R --tp T        TP rank and size (default 0, 1)
  --layout mha|mla       (default mha)
  --layers L             (default 2)
  --block-bytes B        bytes per block per buffer (K, V or latent) per layer (default 4096)
  --blocks N             blocks in the KV pool (default 64)
  --page-size P          tokens per page/block (default 16)
  --model M              model id (default sim-model); --revision REV (rev1); --dtype (bf16);
                         --tenant T ("")
  --arrangement layer|block   KV arrangement (default layer)
  --no-signals           register without a completion channel
  --rpc-timeout-ms N     per-RPC deadline (default 1000)
  --backoff-max-ms N     longest delay between reconnection attempts (default 1000)
  --register-wait-ms N   wait this long for the session before the command (default 5000)
  --wait-ms N            longest wait for an op (default 10000)
  --replace              replace a live session of the same (instance, rank)
  --shm-prefix P         name the sim shm objects /P-PID-kv and /P-PID-sig
  --shm-mode MODE        their permission bits, octal (default 0600; a daemon running as
                         another user needs e.g. 0660 with a shared group, or 0666)

commands:
  backup --seed S --tokens-seed X --pages N [--first-block B] [--ready late|early|none]
         [--write-policy default|write_through|write_through_selective|write_back|l2_only]
      fill blocks B.. with the pattern of the prompt's keys, Backup them, wait.
      JSON: stored, state, statuses. Exit 4 unless every page is stored.
  load --tokens-seed X --pages N [--first-block B] --verify-seed S [--pin] [--expect-hits H]
       [--no-layer-signals] [--prefetch none|default|best_effort|wait_complete|timeout]
       [--prefetch-timeout-ms T] [--l3-lookup-ms L] [--doc D]
      Match (asking L3 backends for L lookup ms), then, when it started a prefetch, WaitOps on
      it and Match again; Load the L2 hit into blocks B.., wait (per layer when signals are on),
      verify every byte. The prompt is document D (default 0) of --tokens-seed X, the same
      documents `random` draws from. JSON: hits (L2 pages loaded), l3_hits, prefetch_pages, prefetch_state,
      prefetch_final, loaded, verified_bytes, mismatched_bytes. Exit 1 on any mismatch.
  random --duration-s D --seed S [--tokens-seed X] [--docs U] [--max-pages N] [--rng-seed R]
         [--think-ms T] [--step-ms T] [--prefetch POLICY] [--l3-lookup-ms L]
      random Match/Load/Backup over a universe of U prompts shared by every process with the
      same --tokens-seed; every loaded byte verified. Exit 1 on any mismatch. With --prefetch
      (not none), an L3 hit is prefetched, waited for, and the landed prefix loaded too. With
      --step-ms, steps start on wall-clock ticks of T ms and each tick's choices (prompt, length,
      pin) come from (--rng-seed, tick), with step_id = tick: the TP ranks of one instance, given
      the same --rng-seed, run the same steps and get one group-consistent Match answer.
  hold [--pin] --tokens-seed X --pages N [--hold-s S]
      Match (pinning the hit), print JSON, then sleep (to be killed).
  drain --tokens-seed X --pages N [--ops K] [--ready-timeout-ms R] [--drain-ms D]
      submit K Backups of N pages (blocks from 0) whose ready signal is never published, so
      they stay pending for R ms (default 60000); print JSON (submitted ops, states), then wait
      for a line on stdin and unregister with a drain of D ms (default 2000). Second JSON line:
      the UnregisterEngine reply (ops_completed, ops_cancelled, pins_released) and unregister_ms.

exit codes: 0 ok; 1 wrong bytes loaded; 2 usage; 3 setup failed (shared memory, client, the
daemon rejected the registration); 4 the cache did less than asked (not stored, too few hits).
)";

// ---- Flags -----------------------------------------------------------------------------------

class Flags {
 public:
  bool Parse(int argc, char** argv, std::string* command, std::string* error) {
    static const std::set<std::string> kBool = {"--pin", "--no-signals", "--replace",
                                                "--no-layer-signals"};
    // Every flag of every command: a typo fails before anything is created or registered.
    // clang-format off
    static const std::set<std::string> kKnown = {
        "--addr", "--instance", "--rank", "--tp", "--layout", "--layers", "--block-bytes",
        "--blocks", "--page-size", "--model", "--revision", "--dtype", "--tenant",
        "--arrangement", "--no-signals", "--rpc-timeout-ms", "--backoff-max-ms",
        "--register-wait-ms", "--wait-ms", "--replace", "--shm-prefix", "--shm-mode", "--seed", "--tokens-seed",
        "--pages", "--first-block", "--ready", "--verify-seed", "--pin", "--expect-hits",
        "--no-layer-signals", "--duration-s", "--docs", "--max-pages", "--rng-seed",
        "--think-ms", "--step-ms", "--hold-s", "--write-policy", "--prefetch", "--prefetch-timeout-ms",
        "--l3-lookup-ms", "--doc", "--ops", "--ready-timeout-ms", "--drain-ms"};
    // clang-format on
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        *error = "help";
        return false;
      }
      if (a.rfind("--", 0) != 0) {
        if (!command->empty()) {
          *error = absl::StrCat("unexpected argument '", a, "'");
          return false;
        }
        *command = a;
        continue;
      }
      const std::string name = a.substr(0, a.find('='));
      if (!kKnown.count(name)) {
        *error = absl::StrCat("unknown flag ", name);
        return false;
      }
      if (size_t eq = a.find('='); eq != std::string::npos) {
        values_[name] = a.substr(eq + 1);
      } else if (kBool.count(a)) {
        values_[a] = "1";
      } else if (i + 1 < argc) {
        values_[a] = argv[++i];
      } else {
        *error = absl::StrCat(a, " needs a value");
        return false;
      }
    }
    return true;
  }
  std::string Str(const std::string& name, const std::string& dflt = "") {
    used_.insert(name);
    auto it = values_.find(name);
    return it == values_.end() ? dflt : it->second;
  }
  bool Bool(const std::string& name) { return !Str(name).empty(); }
  bool Has(const std::string& name) {
    used_.insert(name);
    return values_.count(name) > 0;
  }
  uint64_t U64(const std::string& name, uint64_t dflt) {
    std::string v = Str(name);
    uint64_t out;
    if (v.empty()) return dflt;
    if (!absl::SimpleAtoi(v, &out)) {
      bad_ = absl::StrCat(name, ": '", v, "' is not a number");
      return dflt;
    }
    return out;
  }
  double Double(const std::string& name, double dflt) {
    std::string v = Str(name);
    double out;
    if (v.empty()) return dflt;
    if (!absl::SimpleAtod(v, &out)) {
      bad_ = absl::StrCat(name, ": '", v, "' is not a number");
      return dflt;
    }
    return out;
  }
  // The first problem: a bad number or a flag no command read.
  std::string Problem() const {
    if (!bad_.empty()) return bad_;
    for (const auto& [k, v] : values_) {
      if (!used_.count(k)) return absl::StrCat("unknown flag ", k);
    }
    return "";
  }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> used_;
  std::string bad_;
};

// ---- JSON ------------------------------------------------------------------------------------

// One flat-or-nested JSON object built in insertion order.
using Json = ::kvcellar::tools::JsonObject;

Json StatusCounts(const kc::OpResult& r) {
  std::map<std::string, uint64_t> counts;
  for (const kc::SequenceResult& s : r.sequences) {
    for (kc::PageStatus p : s.page_status) ++counts[kc::PageStatusName(p)];
  }
  Json j;
  for (const auto& [k, v] : counts) j.Num(k, v);
  return j;
}

Json StatsJson(const kc::ClientStats& s) {
  Json j;
  j.Num("rpcs_ok", s.rpcs_ok)
      .Num("rpcs_failed", s.rpcs_failed)
      .Num("rpcs_unavailable", s.rpcs_unavailable)
      .Num("rpcs_deadline_exceeded", s.rpcs_deadline_exceeded)
      .Num("rpcs_unimplemented", s.rpcs_unimplemented)
      .Num("degraded_calls", s.degraded_calls)
      .Num("registrations", s.registrations)
      .Num("reregistrations", s.reregistrations)
      .Num("registration_failures", s.registration_failures)
      .Num("sessions_lost", s.sessions_lost)
      .Num("heartbeats_ok", s.heartbeats_ok)
      .Num("heartbeats_failed", s.heartbeats_failed)
      .Num("ns_digest_mismatches", s.ns_digest_mismatches)
      .Num("ops_failed_session_lost", s.ops_failed_session_lost)
      .Num("uncertain_submissions", s.uncertain_submissions);
  return j;
}

// ---- The engine ------------------------------------------------------------------------------

// Token i of prompt `doc` in the universe of `seed`.
const char* WritePolicyName(uint32_t p) {
  static const char* kNames[] = {"UNSPECIFIED", "WRITE_THROUGH", "WRITE_THROUGH_SELECTIVE",
                                 "WRITE_BACK", "L2_ONLY"};
  return p < 5 ? kNames[p] : "UNKNOWN";
}
const char* PrefetchPolicyName(uint32_t p) {
  static const char* kNames[] = {"UNSPECIFIED", "NONE", "BEST_EFFORT", "WAIT_COMPLETE", "TIMEOUT"};
  return p < 5 ? kNames[p] : "UNKNOWN";
}

std::vector<uint32_t> Tokens(uint64_t seed, uint64_t doc, size_t n) {
  std::vector<uint32_t> t(n);
  const uint64_t base = core::SplitMix64(core::SplitMix64(seed) ^ doc);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(core::SplitMix64(base + i) % kVocab);
  return t;
}

struct Engine {
  std::unique_ptr<kc::Client> client;
  std::unique_ptr<kc::SimEngine> sim;
  std::unique_ptr<kc::Session> session;
  uint32_t page_size = 16;
  absl::Duration op_wait = absl::Seconds(10);
  bool layer_signals = true;
  kc::WritePolicy write_policy = kc::WritePolicy::kUnspecified;

  uint32_t shard() const { return session->info().shard_index; }

  Json SessionJson() const {
    const kc::SessionInfo i = session->info();
    return Json()
        .Str("state", kc::SessionStateName(session->state()))
        .Num("generation", i.generation)
        .Num("shard_index", i.shard_index)
        .Num("num_shards", i.num_shards)
        .Bool("is_shard_writer", i.is_shard_writer)
        .Num("page_object_bytes", i.page_object_bytes)
        .Str("ns_digest", i.ns_digest.Hex())
        .Str("l3_tier_names", absl::StrJoin(i.l3_tier_names, ","))
        .Str("default_write_policy", WritePolicyName(i.default_write_policy))
        .Str("default_prefetch_policy", PrefetchPolicyName(i.default_prefetch_policy));
  }

  // Waits for the op to be terminal (or op_wait to pass).
  kc::OpResult Wait(kc::OpResult r) {
    const absl::Time deadline = absl::Now() + op_wait;
    while (!r.terminal() && absl::Now() < deadline) {
      kc::WaitOptions w;
      w.timeout = std::min(absl::Seconds(1), deadline - absl::Now());
      r = session->WaitOps({r.ref}, w)[0];
      if (!r.terminal() && !r.status.ok()) absl::SleepFor(absl::Milliseconds(20));
    }
    return r;
  }

  // Backs up pages [from, keys.size()) held in `blocks` (one per page from `from`), with the
  // pattern of `seed`. ready: "late" fills after the Backup call and then publishes the ready
  // token (the daemon must wait for it), "early" fills and publishes first, "none" fills and
  // sends no ready signal.
  // `tokens`: the sequence's tokens from page 0 (sent for the daemon's events when it wants
  // them), or empty.
  kc::OpResult Backup(const std::vector<core::PageKey>& keys, size_t from,
                      const std::vector<uint32_t>& blocks, uint64_t seed, const std::string& ready,
                      kc::OpResult* submitted, absl::Span<const uint32_t> tokens = {}) {
    const uint32_t sh = shard();
    auto fill = [&] {
      for (size_t i = from; i < keys.size(); ++i)
        sim->FillBlock(blocks[i - from], seed, keys[i], sh);
    };
    kc::BackupSequence seq;
    if (from > 0) {
      seq.has_parent = true;
      seq.parent = keys[from - 1];
    }
    seq.keys = absl::MakeConstSpan(keys).subspan(from);
    seq.blocks = blocks;
    if (!tokens.empty()) seq.tokens = tokens.subspan(from * page_size, seq.keys.size() * page_size);
    kc::BackupOptions opts;
    opts.write_policy = write_policy;
    const bool signals = sim->has_signals() && sim->signals().num_ready_slots() > 0;
    if (ready != "none" && signals) {
      opts.has_ready = true;
      opts.ready_slot = 0;
      opts.ready_token = sim->NextReadyToken();
      opts.ready_timeout_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(op_wait));
    }
    if (ready != "late" || !opts.has_ready) {
      fill();
      if (opts.has_ready) sim->PublishReady(opts.ready_slot, opts.ready_token);
    }
    kc::OpResult r = session->Backup({seq}, opts);
    if (submitted != nullptr) *submitted = r;
    if (ready == "late" && opts.has_ready) {
      fill();
      sim->PublishReady(opts.ready_slot, opts.ready_token);
    }
    return Wait(std::move(r));
  }

  struct LoadOutcome {
    kc::OpResult result;
    uint32_t loaded = 0;
    uint64_t verified_bytes = 0;
    uint64_t mismatched_bytes = 0;
    uint32_t layers_signalled = 0;
    std::string first_mismatch;
  };

  // Loads keys[from, from + n) into `blocks` and verifies every byte of the usable prefix against
  // the pattern of `seed`; with layer signals, also each layer as soon as it is signalled.
  LoadOutcome Load(const std::vector<core::PageKey>& keys, size_t from, size_t n,
                   const std::vector<uint32_t>& blocks, uint64_t pin_id, uint64_t seed) {
    LoadOutcome out;
    const uint32_t sh = shard();
    for (size_t i = 0; i < n; ++i) sim->ClearBlock(blocks[i], kStaleByte);
    kc::LoadSequence seq;
    seq.keys = absl::MakeConstSpan(keys).subspan(from, n);
    seq.blocks = absl::MakeConstSpan(blocks).subspan(0, n);
    seq.pin_id = pin_id;
    seq.release_pin = pin_id != 0;
    kc::LoadOptions opts;
    const bool signals = layer_signals && sim->has_signals() && sim->signals().num_load_slots() > 0;
    opts.signal_layers = signals;
    opts.completion_slot = 0;
    kc::OpResult r = session->Load({seq}, opts);
    const uint32_t promised = r.sequences.empty() ? 0 : r.sequences[0].leading_ok_pages;
    if (signals && r.ref.op_id != 0 && r.status.ok()) {
      // Layer l may be used as soon as it is signalled: check its bytes right then (before later
      // layers land). The signal means "done with the layer", not "it succeeded", so what was
      // seen counts only once the op word says the op succeeded.
      const absl::Time deadline = absl::Now() + op_wait;
      uint64_t early_bad = 0;
      std::string early_first;
      for (uint32_t l = 0; l < sim->num_layers(); ++l) {
        if (!session->WaitLayerSignal(r.ref, 0, l, deadline).ok()) break;
        ++out.layers_signalled;
        for (size_t i = 0; i < promised; ++i) {
          std::string first;
          const uint64_t bad =
              sim->CountLayerMismatches(blocks[i], l, seed, keys[from + i], sh, &first);
          if (bad > 0 && early_first.empty()) early_first = first;
          early_bad += bad;
        }
      }
      const absl::Status op = session->WaitLoadSignal(r.ref, 0, deadline);
      if (op.ok() && early_bad > 0) {
        out.mismatched_bytes += early_bad;
        out.first_mismatch =
            absl::StrCat("(layer signalled before its bytes landed) ", early_first);
      }
    }
    r = Wait(std::move(r));
    out.result = r;
    out.loaded = r.usable_pages(0);
    for (size_t i = 0; i < out.loaded; ++i) {
      std::string first;
      const uint64_t bad = sim->CountMismatches(blocks[i], seed, keys[from + i], sh, &first);
      if (bad > 0 && out.first_mismatch.empty()) out.first_mismatch = first;
      out.mismatched_bytes += bad;
      out.verified_bytes += sim->page_bytes();
    }
    return out;
  }
};

std::vector<uint32_t> Range(uint32_t first, size_t n) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + static_cast<uint32_t>(i);
  return v;
}

int CmdBackup(Engine& e, Flags& f) {
  const uint64_t seed = f.U64("--seed", 1);
  const uint64_t tseed = f.U64("--tokens-seed", 1);
  const uint64_t pages = f.U64("--pages", 1);
  const uint32_t first = static_cast<uint32_t>(f.U64("--first-block", 0));
  const std::string ready = f.Str("--ready", "late");
  if (std::string p = f.Problem(); !p.empty()) {
    std::fprintf(stderr, "%s\n", p.c_str());
    return kExitUsage;
  }
  if (ready != "late" && ready != "early" && ready != "none") {
    std::fprintf(stderr, "--ready must be late, early or none\n");
    return kExitUsage;
  }
  if (first + pages > e.sim->num_blocks()) {
    std::fprintf(stderr, "blocks [%u, %lu) exceed --blocks\n", first, first + pages);
    return kExitUsage;
  }
  const std::vector<uint32_t> tokens = Tokens(tseed, 0, pages * e.page_size);
  const std::vector<core::PageKey> keys = e.session->ComputeKeys(tokens);
  kc::OpResult submitted;
  kc::OpResult r = e.Backup(keys, 0, Range(first, pages), seed, ready, &submitted, tokens);
  const uint32_t stored = r.usable_pages(0);
  Json j;
  j.Str("cmd", "backup")
      .Num("pages", pages)
      .Num("stored", stored)
      .Str("state", kc::OpStateName(r.state))
      .Str("error", r.status.ok() ? r.error_message : r.status.ToString())
      .Obj("submitted", StatusCounts(submitted))
      .Obj("final", StatusCounts(r))
      .Str("first_key", keys.empty() ? "" : keys[0].Hex())
      .Obj("session", e.SessionJson())
      .Obj("stats", StatsJson(e.client->stats()));
  std::printf("%s\n", j.Dump().c_str());
  return stored == pages ? kExitOk : kExitExpectation;
}

// The policy --prefetch names; false, after saying why on stderr, when it names none.
bool ParsePrefetch(const std::string& name, kc::PrefetchPolicy* policy) {
  static const std::map<std::string, kc::PrefetchPolicy> kPolicies = {
      {"none", kc::PrefetchPolicy::kNone},
      {"default", kc::PrefetchPolicy::kUnspecified},
      {"best_effort", kc::PrefetchPolicy::kBestEffort},
      {"wait_complete", kc::PrefetchPolicy::kWaitComplete},
      {"timeout", kc::PrefetchPolicy::kTimeout}};
  if (auto it = kPolicies.find(name); it != kPolicies.end()) {
    *policy = it->second;
    return true;
  }
  std::fprintf(stderr,
               "--prefetch: '%s' is not none, default, best_effort, wait_complete or "
               "timeout\n",
               name.c_str());
  return false;
}

int CmdLoad(Engine& e, Flags& f) {
  const uint64_t seed = f.U64("--verify-seed", 1);
  const uint64_t tseed = f.U64("--tokens-seed", 1);
  const uint64_t pages = f.U64("--pages", 1);
  const uint32_t first = static_cast<uint32_t>(f.U64("--first-block", 0));
  const bool pin = f.Bool("--pin");
  const bool expect = f.Has("--expect-hits");
  const uint64_t expect_hits = f.U64("--expect-hits", 0);
  const std::string prefetch = f.Str("--prefetch", "none");
  kc::MatchOptions mo;
  mo.pin = pin;
  mo.prefetch_timeout_ms = static_cast<uint32_t>(f.U64("--prefetch-timeout-ms", 0));
  mo.l3_lookup_timeout_ms = static_cast<uint32_t>(f.U64("--l3-lookup-ms", 0));
  const uint64_t doc = f.U64("--doc", 0);
  if (!ParsePrefetch(prefetch, &mo.prefetch_policy)) return kExitUsage;
  if (std::string p = f.Problem(); !p.empty()) {
    std::fprintf(stderr, "%s\n", p.c_str());
    return kExitUsage;
  }
  if (first + pages > e.sim->num_blocks()) {
    std::fprintf(stderr, "blocks [%u, %lu) exceed --blocks\n", first, first + pages);
    return kExitUsage;
  }
  const std::vector<uint32_t> tokens = Tokens(tseed, doc, pages * e.page_size);
  kc::MatchSequence ms;
  ms.tokens = tokens;
  const kc::MatchReply first_match = e.session->Match({ms}, mo);
  kc::MatchReply m = first_match;
  // A prefetch: wait for it as the policy says (the daemon bounds it), then ask again what is in
  // L2 now, pinning it for the Load.
  kc::OpResult prefetched;
  const bool prefetching = first_match.prefetch_op.op_id != 0;
  if (prefetching) {
    kc::WaitOptions wo;
    wo.timeout = e.op_wait;
    prefetched = e.session->WaitOps({first_match.prefetch_op}, wo)[0];
    kc::MatchOptions again;
    again.pin = pin;
    m = e.session->Match({ms}, again);
    // The first pin (which grew over the prefetched pages) ends only now that the second one
    // holds them: no eviction can slip in between.
    if (first_match.results[0].pin_id != 0) e.session->Release({first_match.results[0].pin_id});
  }
  const kc::MatchResult& mr = m.results[0];
  Engine::LoadOutcome lo;
  if (mr.l2_hit_pages > 0) {
    lo = e.Load(mr.keys, 0, mr.l2_hit_pages, Range(first, mr.l2_hit_pages), mr.pin_id, seed);
  }
  Json j;
  j.Str("cmd", "load")
      .Num("pages", pages)
      .Num("hits", mr.l2_hit_pages)
      .Num("first_hits", first_match.results[0].l2_hit_pages)
      .Num("l3_hits", first_match.results[0].l3_hit_pages)
      .Num("prefetch_pages", first_match.results[0].prefetch_pages)
      .Str("prefetch_state", prefetching ? kc::OpStateName(prefetched.state) : "NONE")
      .Obj("prefetch_final", StatusCounts(prefetched))
      .Num("pin_id", mr.pin_id)
      .Str("match_error", m.status.ok() ? "" : m.status.ToString())
      .Num("loaded", lo.loaded)
      .Str("state", mr.l2_hit_pages > 0 ? kc::OpStateName(lo.result.state) : "NONE")
      .Str("error", lo.result.status.ok() ? lo.result.error_message : lo.result.status.ToString())
      .Num("layers_signalled", lo.layers_signalled)
      .Num("verified_bytes", lo.verified_bytes)
      .Num("mismatched_bytes", lo.mismatched_bytes)
      .Str("first_mismatch", lo.first_mismatch)
      .Obj("final", StatusCounts(lo.result))
      .Obj("session", e.SessionJson())
      .Obj("stats", StatsJson(e.client->stats()));
  std::printf("%s\n", j.Dump().c_str());
  if (lo.mismatched_bytes > 0) return kExitMismatch;
  if (expect && lo.loaded < expect_hits) return kExitExpectation;
  return kExitOk;
}

int CmdHold(Engine& e, Flags& f) {
  const uint64_t tseed = f.U64("--tokens-seed", 1);
  const uint64_t pages = f.U64("--pages", 1);
  const bool pin = f.Bool("--pin");
  const double hold_s = f.Double("--hold-s", 3600);
  if (std::string p = f.Problem(); !p.empty()) {
    std::fprintf(stderr, "%s\n", p.c_str());
    return kExitUsage;
  }
  const std::vector<uint32_t> tokens = Tokens(tseed, 0, pages * e.page_size);
  kc::MatchSequence ms;
  ms.tokens = tokens;
  kc::MatchOptions mo;
  mo.pin = pin;
  const kc::MatchReply m = e.session->Match({ms}, mo);
  Json j;
  j.Str("cmd", "hold")
      .Num("pages", pages)
      .Num("hits", m.results[0].l2_hit_pages)
      .Num("pin_id", m.results[0].pin_id)
      .Str("match_error", m.status.ok() ? "" : m.status.ToString())
      .Obj("session", e.SessionJson());
  std::printf("%s\n", j.Dump().c_str());
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(hold_s));
  return kExitOk;
}

int CmdDrain(Engine& e, Flags& f) {
  const uint64_t tseed = f.U64("--tokens-seed", 1);
  const uint64_t pages = f.U64("--pages", 1);
  const uint64_t num_ops = f.U64("--ops", 1);
  const uint32_t ready_timeout_ms = static_cast<uint32_t>(f.U64("--ready-timeout-ms", 60000));
  const absl::Duration drain = absl::Milliseconds(f.U64("--drain-ms", 2000));
  if (std::string p = f.Problem(); !p.empty()) {
    std::fprintf(stderr, "%s\n", p.c_str());
    return kExitUsage;
  }
  if (num_ops * pages > e.sim->num_blocks()) {
    std::fprintf(stderr, "--ops * --pages exceeds --blocks\n");
    return kExitUsage;
  }
  // One ready slot per op: a slot's word gates every op waiting on it.
  if (!e.sim->has_signals() || e.sim->signals().num_ready_slots() < num_ops) {
    std::fprintf(stderr, "drain needs a ready slot per op (not --no-signals)\n");
    return kExitUsage;
  }
  uint64_t pending = 0;
  std::vector<std::string> states;
  std::string error;
  for (uint64_t i = 0; i < num_ops; ++i) {
    const std::vector<core::PageKey> keys =
        e.session->ComputeKeys(Tokens(tseed, i, pages * e.page_size));
    const std::vector<uint32_t> blocks = Range(static_cast<uint32_t>(i * pages), pages);
    kc::BackupSequence seq;
    seq.keys = keys;
    seq.blocks = blocks;
    kc::BackupOptions opts;
    opts.write_policy = e.write_policy;
    opts.has_ready = true;
    opts.ready_slot = static_cast<uint32_t>(i);
    opts.ready_token = e.sim->NextReadyToken();  // Never published.
    opts.ready_timeout_ms = ready_timeout_ms;
    const kc::OpResult r = e.session->Backup({seq}, opts);
    if (!r.terminal() && r.status.ok()) ++pending;
    states.push_back(kc::OpStateName(r.state));
    if (error.empty() && !r.status.ok()) error = r.status.ToString();
    if (error.empty() && !r.error_message.empty()) error = r.error_message;
  }
  Json first;
  first.Str("cmd", "drain")
      .Num("ops", num_ops)
      .Num("pending", pending)
      .Str("states", absl::StrJoin(states, ","))
      .Str("error", error)
      .Obj("session", e.SessionJson());
  std::printf("%s\n", first.Dump().c_str());
  std::fflush(stdout);
  char line[64];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) std::fprintf(stderr, "stdin closed\n");
  const absl::Time start = absl::Now();
  const kc::CloseReply c = e.session->Close(drain);
  const absl::Duration took = absl::Now() - start;
  Json j;
  j.Str("cmd", "drain")
      .Bool("unregistered", c.unregistered)
      .Num("ops_completed", c.ops_completed)
      .Num("ops_cancelled", c.ops_cancelled)
      .Num("pins_released", c.pins_released)
      .Str("error", c.status.ok() ? "" : c.status.ToString())
      .Num("unregister_ms", static_cast<uint64_t>(absl::ToInt64Milliseconds(took)))
      .Obj("stats", StatsJson(e.client->stats()));
  std::printf("%s\n", j.Dump().c_str());
  return c.unregistered && pending == num_ops ? kExitOk : kExitExpectation;
}

// Sleeps until the next wall-clock tick of `period` and returns its number: processes on one
// machine agree on tick numbers, which is what keeps the ranks of a group on the same step.
uint64_t NextTick(absl::Duration period) {
  const int64_t period_ns = absl::ToInt64Nanoseconds(period);
  const int64_t now = absl::ToUnixNanos(absl::Now());
  const int64_t tick = now / period_ns + 1;
  absl::SleepFor(absl::Nanoseconds(tick * period_ns - now));
  return static_cast<uint64_t>(tick);
}

int CmdRandom(Engine& e, Flags& f) {
  const double duration_s = f.Double("--duration-s", 10);
  const uint64_t seed = f.U64("--seed", 1);
  const uint64_t tseed = f.U64("--tokens-seed", seed);
  const uint64_t docs = std::max<uint64_t>(1, f.U64("--docs", 32));
  const uint64_t max_pages = std::max<uint64_t>(1, f.U64("--max-pages", 8));
  const uint64_t rng_seed =
      f.U64("--rng-seed", core::SplitMix64(getpid() ^ absl::ToUnixNanos(absl::Now())));
  const absl::Duration think = absl::Milliseconds(f.U64("--think-ms", 0));
  const absl::Duration step = absl::Milliseconds(f.U64("--step-ms", 0));
  kc::PrefetchPolicy prefetch = kc::PrefetchPolicy::kNone;
  if (!ParsePrefetch(f.Str("--prefetch", "none"), &prefetch)) return kExitUsage;
  const uint32_t l3_lookup_ms = static_cast<uint32_t>(f.U64("--l3-lookup-ms", 0));
  if (std::string p = f.Problem(); !p.empty()) {
    std::fprintf(stderr, "%s\n", p.c_str());
    return kExitUsage;
  }
  if (2 * max_pages > e.sim->num_blocks()) {
    std::fprintf(stderr, "--blocks must be >= 2 * --max-pages\n");
    return kExitUsage;
  }
  std::mt19937_64 rng(rng_seed);
  // What a step does (prompt, length, pin, ready): `rng`, or in lockstep the tick's own rng, the
  // same in every rank of the group. Which blocks it uses is each process's own (`rng`).
  std::mt19937_64 tick_rng;
  std::vector<uint32_t> all = Range(0, e.sim->num_blocks());
  uint64_t steps = 0, hit_pages = 0, loaded_pages = 0, verified_bytes = 0, mismatched = 0;
  uint64_t backup_pages = 0, stored_pages = 0, loads_not_done = 0, backups_not_done = 0;
  uint64_t loaded_after_reconnect = 0, stored_after_reconnect = 0;
  uint64_t l3_hit_pages = 0, prefetch_ops = 0, prefetched_pages = 0, memoized = 0;
  uint64_t match_errors = 0;
  std::string first_mismatch, first_match_error;
  uint64_t quarantined = 0;
  // Blocks of ops whose outcome never became known leave the pool for good.
  auto quarantine = [&](const std::vector<uint32_t>& bad) {
    for (uint32_t b : bad) std::erase(all, b);
    quarantined += bad.size();
  };
  const absl::Time end = absl::Now() + absl::Seconds(duration_s);
  while (absl::Now() < end && all.size() >= max_pages) {
    if (think > absl::ZeroDuration()) absl::SleepFor(think);  // The forward pass, as it were.
    std::mt19937_64* choose = &rng;
    uint64_t step_id = 0;
    if (step > absl::ZeroDuration()) {
      step_id = NextTick(step);
      tick_rng.seed(core::SplitMix64(rng_seed ^ core::SplitMix64(step_id)));
      choose = &tick_rng;
    }
    ++steps;
    const uint64_t doc = (*choose)() % docs;
    const size_t n = 1 + (*choose)() % max_pages;
    const std::vector<uint32_t> tokens = Tokens(tseed, doc, n * e.page_size);
    std::shuffle(all.begin(), all.end(), rng);
    // Distinct blocks for the loaded prefix and the computed rest, as an engine allocates them.
    const std::vector<uint32_t> blocks(all.begin(), all.begin() + n);
    kc::MatchSequence ms;
    ms.tokens = tokens;
    kc::MatchOptions mo;
    mo.pin = (*choose)() % 2 == 0;
    mo.step_id = step_id;
    mo.prefetch_policy = prefetch;
    mo.l3_lookup_timeout_ms = l3_lookup_ms;
    const kc::MatchReply m = e.session->Match({ms}, mo);
    const kc::MatchResult& mr = m.results[0];
    if (!m.status.ok() && ++match_errors == 1) first_match_error = m.status.ToString();
    if (m.memoized) ++memoized;
    std::vector<core::PageKey> keys = mr.keys.empty() ? e.session->ComputeKeys(tokens) : mr.keys;
    const uint64_t gen = e.session->info().generation;
    uint32_t hit = mr.l2_hit_pages;
    l3_hit_pages += mr.l3_hit_pages;
    if (mr.l3_hit_pages > 0 && m.prefetch_op.op_id != 0) {
      // The L3 hit is being read into L2 (and joins the pin as it lands): wait, then load the
      // landed prefix with the L2 hit, as an engine schedules the request once the op ends.
      ++prefetch_ops;
      kc::OpResult pf;
      pf.ref = m.prefetch_op;
      pf.kind = kc::OpKind::kPrefetch;
      pf.state = kc::OpState::kPending;
      const uint32_t landed = std::min(mr.l3_hit_pages, e.Wait(std::move(pf)).usable_pages(0));
      prefetched_pages += landed;
      hit += landed;
    }
    uint32_t have = 0;
    if (hit > 0) {
      hit_pages += hit;
      Engine::LoadOutcome lo = e.Load(keys, 0, hit, blocks, mr.pin_id, seed);
      if (!lo.result.done()) ++loads_not_done;
      loaded_pages += lo.loaded;
      verified_bytes += lo.verified_bytes;
      if (gen > 1) loaded_after_reconnect += lo.loaded;
      if (lo.mismatched_bytes > 0) {
        mismatched += lo.mismatched_bytes;
        if (first_mismatch.empty()) first_mismatch = lo.first_mismatch;
      }
      if (!lo.result.terminal()) {
        // The daemon may still write these blocks: an engine would not reuse them, nor do we.
        quarantine(blocks);
        continue;
      }
      have = lo.loaded;
    } else if (mr.pin_id != 0) {
      e.session->Release({mr.pin_id});
    }
    if (have < n) {
      // "Compute" the rest and back it up, as the engine does after the forward pass.
      const std::vector<uint32_t> bblocks(blocks.begin() + have, blocks.end());
      static const char* kReady[] = {"late", "early", "none"};
      kc::OpResult r =
          e.Backup(keys, have, bblocks, seed, kReady[(*choose)() % 3], nullptr, tokens);
      backup_pages += n - have;
      stored_pages += r.usable_pages(0);
      if (gen > 1) stored_after_reconnect += r.usable_pages(0);
      if (!r.done()) ++backups_not_done;
      if (!r.terminal()) quarantine(bblocks);
    }
  }
  Json j;
  j.Str("cmd", "random")
      .Num("steps", steps)
      .Num("hit_pages", hit_pages)
      .Num("loaded_pages", loaded_pages)
      .Num("verified_bytes", verified_bytes)
      .Num("mismatched_bytes", mismatched)
      .Str("first_mismatch", first_mismatch)
      .Num("backup_pages", backup_pages)
      .Num("stored_pages", stored_pages)
      .Num("loads_not_done", loads_not_done)
      .Num("backups_not_done", backups_not_done)
      .Num("loaded_pages_after_reconnect", loaded_after_reconnect)
      .Num("stored_pages_after_reconnect", stored_after_reconnect)
      .Num("quarantined_blocks", quarantined)
      .Num("l3_hit_pages", l3_hit_pages)
      .Num("prefetch_ops", prefetch_ops)
      .Num("prefetched_pages", prefetched_pages)
      .Num("memoized_matches", memoized)
      .Num("match_errors", match_errors)
      .Str("first_match_error", first_match_error)
      .Obj("session", e.SessionJson())
      .Obj("stats", StatsJson(e.client->stats()));
  std::printf("%s\n", j.Dump().c_str());
  return mismatched > 0 ? kExitMismatch : kExitOk;
}

// The engine, its simulated KV memory, its registration and its client, from the flags. Returns
// an exit code on a bad flag, nullopt when the engine can start.
std::optional<int> Configure(Flags& f, Engine& e, kc::SimEngineOptions& so,
                             kc::EngineRegistration& reg, kc::ClientOptions& co,
                             absl::Duration& register_wait) {
  e.page_size = static_cast<uint32_t>(f.U64("--page-size", 16));
  e.op_wait = absl::Milliseconds(f.U64("--wait-ms", 10000));
  e.layer_signals = !f.Bool("--no-layer-signals");
  {
    static const std::map<std::string, kc::WritePolicy> kWrite = {
        {"default", kc::WritePolicy::kUnspecified},
        {"write_through", kc::WritePolicy::kWriteThrough},
        {"write_through_selective", kc::WritePolicy::kWriteThroughSelective},
        {"write_back", kc::WritePolicy::kWriteBack},
        {"l2_only", kc::WritePolicy::kL2Only}};
    const std::string wp = f.Str("--write-policy", "default");
    auto it = kWrite.find(wp);
    if (it == kWrite.end()) {
      std::fprintf(stderr,
                   "--write-policy: '%s' is not default, write_through, "
                   "write_through_selective, write_back or l2_only\n",
                   wp.c_str());
      return kExitUsage;
    }
    e.write_policy = it->second;
  }
  const std::string layout = f.Str("--layout", "mha");
  const std::string arrangement = f.Str("--arrangement", "layer");
  so.num_layers = static_cast<uint32_t>(f.U64("--layers", 2));
  so.bytes_per_block = f.U64("--block-bytes", 4096);
  so.num_blocks = static_cast<uint32_t>(f.U64("--blocks", 64));
  so.mla = layout == "mla";
  so.arrangement = arrangement == "block"
                       ? kvcellar::platform::SimKvShape::Arrangement::kBlockFirst
                       : kvcellar::platform::SimKvShape::Arrangement::kLayerFirst;
  if (f.Bool("--no-signals")) so.load_slots = so.ready_slots = 0;
  // A killed engine cannot unlink its shm objects; a known prefix lets the test remove them.
  if (std::string prefix = f.Str("--shm-prefix"); !prefix.empty()) {
    so.name_prefix = absl::StrCat("/", prefix, "-", getpid());
  }
  if (std::string mode = f.Str("--shm-mode"); !mode.empty()) {
    char* end = nullptr;
    const unsigned long bits = strtoul(mode.c_str(), &end, 8);
    if (end == mode.c_str() || *end != '\0' || bits > 07777) {
      fprintf(stderr, "--shm-mode %s: not octal permission bits (e.g. 0660)\n", mode.c_str());
      return kExitUsage;
    }
    so.shm_mode = static_cast<uint32_t>(bits);
  }

  reg.instance_id = f.Str("--instance", absl::StrCat("sim-", getpid()));
  reg.rank = static_cast<uint32_t>(f.U64("--rank", 0));
  reg.ns.tenant = f.Str("--tenant", "");
  reg.ns.model_id = f.Str("--model", "sim-model");
  reg.ns.model_revision = f.Str("--revision", "rev1");
  reg.ns.kv_dtype = f.Str("--dtype", "bf16");
  reg.ns.page_size = e.page_size;
  reg.ns.layout = so.mla ? core::LayoutKind::kMla : core::LayoutKind::kMha;
  reg.ns.tp_size = static_cast<uint32_t>(f.U64("--tp", 1));
  reg.replace_existing = f.Bool("--replace");
  reg.engine_name = "kvcellar-engine-sim";
  reg.device_uuid = std::string(16, '\0');
  for (int i = 0; i < 8; ++i) reg.device_uuid[i] = static_cast<char>(getpid() >> (8 * (i % 4)));

  co.addr = f.Str("--addr", kvcellar::platform::DefaultSocketPath());
  co.rpc_timeout = absl::Milliseconds(f.U64("--rpc-timeout-ms", 1000));
  co.register_timeout = std::max(co.rpc_timeout, absl::Seconds(2));
  co.reconnect_backoff_max = absl::Milliseconds(f.U64("--backoff-max-ms", 1000));
  register_wait = absl::Milliseconds(f.U64("--register-wait-ms", 5000));
  if (layout != "mha" && layout != "mla") {
    std::fprintf(stderr, "--layout must be mha or mla\n");
    return kExitUsage;
  }
  if (arrangement != "layer" && arrangement != "block") {
    std::fprintf(stderr, "--arrangement must be layer or block\n");
    return kExitUsage;
  }

  return std::nullopt;
}

// Creates the simulated engine memory, connects and registers, and waits for the session to be
// active (a "random" run goes on regardless). Returns an exit code when the engine cannot start.
std::optional<int> Start(Engine& e, const std::string& command, const kc::SimEngineOptions& so,
                         kc::EngineRegistration& reg, const kc::ClientOptions& co,
                         absl::Duration register_wait) {
  absl::StatusOr<std::unique_ptr<kc::SimEngine>> sim = kc::SimEngine::Create(so);
  if (!sim.ok()) {
    std::fprintf(stderr, "sim engine: %s\n", sim.status().ToString().c_str());
    return kExitSetup;
  }
  e.sim = *std::move(sim);
  e.sim->Describe(&reg);
  absl::StatusOr<std::unique_ptr<kc::Client>> client = kc::Client::Connect(co);
  if (!client.ok()) {
    std::fprintf(stderr, "client: %s\n", client.status().ToString().c_str());
    return kExitSetup;
  }
  e.client = *std::move(client);
  absl::StatusOr<std::unique_ptr<kc::Session>> session = e.client->Register(reg);
  if (!session.ok()) {
    std::fprintf(stderr, "register: %s\n", session.status().ToString().c_str());
    Json j;
    j.Str("cmd", command).Str("error", session.status().ToString());
    std::printf("%s\n", j.Dump().c_str());
    return kExitSetup;
  }
  e.session = *std::move(session);
  const bool active = e.session->WaitUntilActive(register_wait);
  if (!active && command != "random") {
    std::fprintf(stderr, "session not active after %s (state %s)\n",
                 absl::FormatDuration(register_wait).c_str(),
                 kc::SessionStateName(e.session->state()));
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  std::string command, error;
  if (!f.Parse(argc, argv, &command, &error)) {
    if (error == "help") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
    std::fprintf(stderr, "kvcellar-engine-sim: %s\n%s", error.c_str(), kUsage);
    return kExitUsage;
  }
  if (command != "backup" && command != "load" && command != "random" && command != "hold" &&
      command != "drain") {
    std::fprintf(stderr, "kvcellar-engine-sim: unknown command '%s'\n%s", command.c_str(), kUsage);
    return kExitUsage;
  }
  // An engine whose daemon dies must not die of SIGPIPE.
  signal(SIGPIPE, SIG_IGN);

  Engine e;
  kc::SimEngineOptions so;
  kc::EngineRegistration reg;
  kc::ClientOptions co;
  absl::Duration register_wait;
  if (std::optional<int> exit = Configure(f, e, so, reg, co, register_wait)) return *exit;
  if (std::optional<int> exit = Start(e, command, so, reg, co, register_wait)) return *exit;

  int rc = kExitUsage;
  if (command == "backup") rc = CmdBackup(e, f);
  if (command == "load") rc = CmdLoad(e, f);
  if (command == "random") rc = CmdRandom(e, f);
  if (command == "hold") rc = CmdHold(e, f);
  if (command == "drain") rc = CmdDrain(e, f);
  std::fflush(stdout);
  e.session->Close(absl::Seconds(2));
  return rc;
}
