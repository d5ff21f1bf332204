// BM_Match: latency of one 2048-page Match over the Unix socket, at page sizes 16 and 64, beside
// its baseline and the parts it is made of, all interleaved in one loop so that every figure sees
// the same machine.
//
// Cases (every page an L2 hit: the prompt is backed up first, so the daemon walks all 2048):
//   match       Session::Match with token ids, the library path: the client hashes the key chain
//               (docs/keys.md) and sends 2048 keys (64 KiB). Key hashing is inside the time.
//   daemon_hash A raw MatchRequest carrying the token ids: the daemon hashes the chain.
// Baselines, same request bytes, same process boundary (noop_server.h):
//   base        SHA-256 of the same token bytes (OpenSSL, one contiguous buffer) + a no-op call
//               carrying the serialized request `match` sends.
//   base_tokens The same with the token-id request `daemon_hash` sends.
// Parts, each timed alone: noop (the call without the hash), sha256, chain (the client's key
// chain over the same tokens), match_keys (Session::Match with precomputed keys: RPC + daemon
// lookup, no hashing), composite (the chain, then Match with those keys: what the library does,
// assembled from the parts).
//
// BM_MatchTurns: a conversation growing by kTurnPages pages a turn up to 2048 pages, one
// Session::Match per turn, through a client with the key cache (ClientOptions::key_cache_bytes,
// client/key_chain_cache.h: each turn hashes only its new pages) and, alternated in the same
// loop, one without (every turn hashes the whole history). A new conversation every iteration,
// not cached in L2: the time is the client's hashing plus the RPC.
//
// BM_MatchOpaque: an engine that has its own page hashes (vLLM's block hashes, SGLang's page
// hashes) sends them as opaque keys (docs/keys.md): no hashing in the client. Session::Match of
// 2048 such keys (every page an L2 hit; the daemon scopes each key by its namespace) beside a
// no-op call carrying the same request bytes, which is all the baseline has left to do.
#include <openssl/sha.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "client/channel.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"
#include "tests/bench/datapath/benchmarks.h"

namespace kvcellar::bench {
namespace {

namespace v1 = ::kvcellar::v1;

constexpr uint32_t kPages = 2048;
// Deadline of the raw calls; far above their latency, only there so a hang fails.
constexpr absl::Duration kRawDeadline = absl::Seconds(5);

// The request Session::Match builds for one sequence (client/session.cc), with keys or tokens.
v1::MatchRequest MatchRequestOf(uint64_t session_id, absl::Span<const core::PageKey> keys,
                                absl::Span<const uint32_t> tokens) {
  v1::MatchRequest req;
  req.set_session_id(session_id);
  v1::MatchSequence* seq = req.add_sequences();
  seq->set_num_computed_pages(0);
  seq->set_request_id("");
  std::string* raw = seq->mutable_page_keys();
  for (const core::PageKey& k : keys) raw->append(k.AsBytes().data(), k.AsBytes().size());
  seq->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  req.set_prefetch_policy(static_cast<v1::PrefetchPolicy>(client::PrefetchPolicy::kNone));
  return req;
}

// A unary Match on `stub`; the number of L2 hits of sequence 0 (0 when the call failed).
uint32_t RawMatch(v1::CacheService::Stub& stub, const v1::MatchRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRawDeadline));
  v1::MatchResponse resp;
  const grpc::Status st = stub.Match(&ctx, req, &resp);
  if (!st.ok()) return 0;
  return resp.results_size() > 0 ? resp.results(0).l2_hit_pages() : 0;
}

// A rank with room for a 2048-page prompt in small page objects: the index, not the copies, is
// measured.
absl::StatusOr<SimEngineRank> RegisterMatchEngine(DatapathEnv* env, const std::string& model,
                                                  uint32_t page_size, bool opaque) {
  EngineSpec spec;
  spec.model = model;
  spec.page_size = page_size;
  spec.opaque_keys = opaque;
  spec.layers = 2;
  spec.bytes_per_block = 1024;
  spec.blocks = kPages;
  return env->RegisterEngine(spec);
}

// Every page of `keys` an L2 hit (CacheAndPin), pinned until this goes.
class PinnedPages {
 public:
  static absl::StatusOr<std::unique_ptr<PinnedPages>> Make(client::Session& session,
                                                           const std::vector<core::PageKey>& keys) {
    absl::StatusOr<uint64_t> pin = CacheAndPin(session, keys);
    if (!pin.ok()) return pin.status();
    return std::unique_ptr<PinnedPages>(new PinnedPages(session, *pin));
  }
  ~PinnedPages() { session_.Release({pin_}); }

 private:
  PinnedPages(client::Session& session, uint64_t pin) : session_(session), pin_(pin) {}
  client::Session& session_;
  const uint64_t pin_;
};

// Per-iteration times of one case, in microseconds.
struct Samples {
  std::vector<double> us;
  template <typename F>
  auto Time(F&& f) {
    const absl::Time t0 = absl::Now();
    auto out = f();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    return out;
  }
  double P50() { return Quantile(&us, 0.50); }
  double P99() { return Quantile(&us, 0.99); }
};

void RunMatch(benchmark::State& state, DatapathEnv* env, Summary* summary, uint32_t page_size) {
  const std::vector<uint32_t> tokens = PromptTokens(page_size, size_t{kPages} * page_size);
  absl::StatusOr<SimEngineRank> rank = RegisterMatchEngine(env, "bench-match", page_size, false);
  if (!rank.ok()) {
    state.SkipWithError(rank.status().ToString().c_str());
    return;
  }
  client::Session& session = *rank->session;
  const std::vector<core::PageKey> keys = session.ComputeKeys(tokens);

  // Every page an L2 hit, pinned for the benchmark's duration.
  absl::StatusOr<std::unique_ptr<PinnedPages>> pinned = PinnedPages::Make(session, keys);
  if (!pinned.ok()) {
    state.SkipWithError(absl::StrCat("setup: ", pinned.status().ToString()).c_str());
    return;
  }

  const v1::MatchRequest req_keys = MatchRequestOf(session.info().session_id, keys, {});
  const v1::MatchRequest req_tokens = MatchRequestOf(session.info().session_id, {}, tokens);
  client::ChannelOptions channel_options;
  channel_options.private_subchannel = true;
  auto noop_channel = client::MakeChannel(env->noop_socket(), channel_options);
  auto daemon_channel = client::MakeChannel(env->daemon_socket(), channel_options);
  if (!noop_channel.ok() || !daemon_channel.ok()) {
    state.SkipWithError("cannot make channels");
    return;
  }
  v1::CacheService::Stub noop(*noop_channel);
  v1::CacheService::Stub daemon(*daemon_channel);
  const auto* token_bytes = reinterpret_cast<const unsigned char*>(tokens.data());
  const size_t token_len = tokens.size() * sizeof(uint32_t);
  uint8_t digest[SHA256_DIGEST_LENGTH];
  auto sha = [&] {
    SHA256(token_bytes, token_len, digest);
    benchmark::DoNotOptimize(digest);
    return 0u;
  };
  client::MatchSequence by_tokens;
  by_tokens.tokens = tokens;
  client::MatchSequence by_keys;
  by_keys.keys = keys;

  Samples match, daemon_hash, base, base_tokens, noop_call, sha256, chain, match_keys, composite;
  uint64_t misses = 0, daemon_misses = 0;
  auto all = [&](bool record) {
    const uint32_t hit =
        match.Time([&] { return session.Match({by_tokens}).results[0].l2_hit_pages; });
    base.Time([&] {
      sha();
      return RawMatch(noop, req_keys);
    });
    match_keys.Time([&] { return session.Match({by_keys}).results[0].l2_hit_pages; });
    noop_call.Time([&] { return RawMatch(noop, req_keys); });
    chain.Time([&] { return session.ComputeKeys(tokens).size(); });
    composite.Time([&] {
      const std::vector<core::PageKey> k = session.ComputeKeys(tokens);
      client::MatchSequence ms;
      ms.keys = k;
      return session.Match({ms}).results[0].l2_hit_pages;
    });
    sha256.Time(sha);
    const uint32_t dhit = daemon_hash.Time([&] { return RawMatch(daemon, req_tokens); });
    base_tokens.Time([&] {
      sha();
      return RawMatch(noop, req_tokens);
    });
    if (hit != kPages) ++misses;
    if (dhit != kPages) ++daemon_misses;
    if (!record) {
      for (Samples* s : {&match, &daemon_hash, &base, &base_tokens, &noop_call, &sha256, &chain,
                         &match_keys, &composite}) {
        s->us.clear();
      }
    }
    return match.us.empty() ? 0.0 : match.us.back();
  };
  for (int i = 0; i < 50; ++i) all(false);  // Warm up connections, allocators, caches.
  misses = daemon_misses = 0;
  for (auto _ : state) state.SetIterationTime(all(true) / 1e6);
  if (misses + daemon_misses > 0) {
    state.SkipWithError(absl::StrCat("not every page hit: ", misses, " Session::Match calls, ",
                                     daemon_misses, " token-id calls")
                            .c_str());
    return;
  }

  const double p50 = match.P50(), p99 = match.P99();
  const double b50 = base.P50(), b99 = base.P99();
  state.counters["p50_us"] = p50;
  state.counters["p99_us"] = p99;
  state.counters["base_p50_us"] = b50;
  state.counters["base_p99_us"] = b99;
  state.counters["ratio_p50"] = p50 / b50;
  state.counters["daemon_hash_p50_us"] = daemon_hash.P50();
  state.counters["daemon_hash_ratio_p50"] = daemon_hash.P50() / base_tokens.P50();
  state.counters["request_KiB"] = double(req_keys.ByteSizeLong()) / 1024;

  const std::string name = absl::StrCat("Match 2048 pages, P=", page_size);
  summary->AddLatency(absl::StrCat(name, ", client hashes (library)"),
                      absl::StrFormat("no-op call %.1f KiB + SHA-256 %d KiB",
                                      req_keys.ByteSizeLong() / 1024.0, token_len >> 10),
                      p50, p99, b50, b99);
  summary->AddLatency(absl::StrCat(name, ", daemon hashes (token ids sent)"),
                      absl::StrFormat("no-op call %.1f KiB + SHA-256 %d KiB",
                                      req_tokens.ByteSizeLong() / 1024.0, token_len >> 10),
                      daemon_hash.P50(), daemon_hash.P99(), base_tokens.P50(), base_tokens.P99());
  const std::string p = absl::StrCat("P=", page_size);
  summary->AddBreakdown(p, "Match, client hashes (total)", p50, p99);
  summary->AddBreakdown(p, "  client key chain alone", chain.P50(), chain.P99());
  summary->AddBreakdown(p, "  Match with precomputed keys (RPC + lookup)", match_keys.P50(),
                        match_keys.P99());
  summary->AddBreakdown(p, "  key chain, then Match with those keys, back to back", composite.P50(),
                        composite.P99());
  summary->AddBreakdown(p, "baseline (total)", b50, b99);
  summary->AddBreakdown(p, "  SHA-256 of the tokens alone", sha256.P50(), sha256.P99());
  summary->AddBreakdown(p, "  no-op call with the keys request alone", noop_call.P50(),
                        noop_call.P99());
}

void RunMatchOpaque(benchmark::State& state, DatapathEnv* env, Summary* summary) {
  absl::StatusOr<SimEngineRank> rank =
      RegisterMatchEngine(env, "bench-match-opaque", /*page_size=*/16, /*opaque=*/true);
  if (!rank.ok()) {
    state.SkipWithError(rank.status().ToString().c_str());
    return;
  }
  client::Session& session = *rank->session;
  // The engine's own hashes: 32 bytes per page, from its scheme, not ours.
  std::vector<core::PageKey> keys(kPages);
  const std::vector<uint32_t> words = PromptTokens(77, size_t{kPages} * 8);
  std::memcpy(static_cast<void*>(keys.data()), words.data(), keys.size() * sizeof(core::PageKey));
  absl::StatusOr<std::unique_ptr<PinnedPages>> pinned = PinnedPages::Make(session, keys);
  if (!pinned.ok()) {
    state.SkipWithError(absl::StrCat("setup: ", pinned.status().ToString()).c_str());
    return;
  }
  client::ChannelOptions channel_options;
  channel_options.private_subchannel = true;
  auto noop_channel = client::MakeChannel(env->noop_socket(), channel_options);
  if (!noop_channel.ok()) {
    state.SkipWithError("cannot make the no-op channel");
    return;
  }
  v1::CacheService::Stub noop(*noop_channel);
  const v1::MatchRequest req = MatchRequestOf(session.info().session_id, keys, {});
  client::MatchSequence by_keys;
  by_keys.keys = keys;
  Samples match, base;
  uint64_t misses = 0;
  auto both = [&](bool record) {
    if (match.Time([&] { return session.Match({by_keys}).results[0].l2_hit_pages; }) != kPages) {
      ++misses;
    }
    base.Time([&] { return RawMatch(noop, req); });
    if (!record) {
      match.us.clear();
      base.us.clear();
    }
    return match.us.empty() ? 0.0 : match.us.back();
  };
  for (int i = 0; i < 50; ++i) both(false);
  misses = 0;
  for (auto _ : state) state.SetIterationTime(both(true) / 1e6);
  if (misses > 0) {
    state.SkipWithError(absl::StrCat("not every page hit in ", misses, " calls").c_str());
    return;
  }
  state.counters["p50_us"] = match.P50();
  state.counters["base_p50_us"] = base.P50();
  state.counters["ratio_p50"] = match.P50() / base.P50();
  summary->AddLatency("Match 2048 pages, the engine's own hashes as opaque keys",
                      absl::StrFormat("no-op call %.1f KiB", req.ByteSizeLong() / 1024.0),
                      match.P50(), match.P99(), base.P50(), base.P99());
}

constexpr uint32_t kTurnPages = 64;

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / v.size();
}

void RunMatchTurns(benchmark::State& state, DatapathEnv* env, Summary* summary,
                   uint32_t page_size) {
  EngineSpec spec;
  spec.model = "bench-match-turns";
  spec.page_size = page_size;
  spec.layers = 2;
  spec.bytes_per_block = 1024;
  spec.blocks = 64;
  spec.key_cache_bytes = client::ClientOptions().key_cache_bytes;  // The library's default.
  absl::StatusOr<SimEngineRank> cached = env->RegisterEngine(spec);
  spec.key_cache_bytes = 0;
  absl::StatusOr<SimEngineRank> uncached = env->RegisterEngine(spec);
  if (!cached.ok() || !uncached.ok()) {
    state.SkipWithError("cannot register the engines");
    return;
  }
  Samples with_cache, without_cache;
  uint64_t conversation = 0;
  // One conversation, turn by turn, on both sessions; returns the cached session's total.
  auto converse = [&](bool record) {
    const std::vector<uint32_t> tokens =
        PromptTokens(1000 + conversation++, size_t{kPages} * page_size);
    double total = 0;
    for (uint32_t pages = kTurnPages; pages <= kPages; pages += kTurnPages) {
      client::MatchSequence turn;
      turn.tokens = absl::MakeConstSpan(tokens).first(size_t{pages} * page_size);
      with_cache.Time([&] { return cached->session->Match({turn}).results.size(); });
      without_cache.Time([&] { return uncached->session->Match({turn}).results.size(); });
      total += with_cache.us.back();
    }
    if (!record) {
      with_cache.us.clear();
      without_cache.us.clear();
    }
    return total;
  };
  for (int i = 0; i < 3; ++i) converse(false);
  for (auto _ : state) state.SetIterationTime(converse(true) / 1e6);

  const double mean_with = Mean(with_cache.us), mean_without = Mean(without_cache.us);
  state.counters["turn_mean_us"] = mean_with;
  state.counters["turn_mean_no_cache_us"] = mean_without;
  state.counters["ratio"] = mean_with / mean_without;
  const client::ClientStats stats = cached->client->stats();
  state.counters["reused_fraction"] =
      stats.keyed_pages == 0 ? 0 : double(stats.keyed_pages_reused) / stats.keyed_pages;
  summary->AddLatency(absl::StrCat("Match per turn, conversation to 2048 pages by ", kTurnPages,
                                   " a turn, P=", page_size, ", key cache"),
                      "the same without the key cache", with_cache.P50(), with_cache.P99(),
                      without_cache.P50(), without_cache.P99());
}

}  // namespace

void RegisterMatchBenchmarks(DatapathEnv* env, Summary* summary, const BenchConfig& config) {
  for (uint32_t page_size : {16u, 64u}) {
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_Match/pages:2048/page_size:", page_size).c_str(),
        [=](benchmark::State& state) { RunMatch(state, env, summary, page_size); })
        ->Iterations(config.match_iterations)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark(
      "BM_MatchOpaque/pages:2048",
      [=](benchmark::State& state) { RunMatchOpaque(state, env, summary); })
      ->Iterations(config.match_iterations)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  for (uint32_t page_size : {16u, 64u}) {
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_MatchTurns/to_pages:2048/page_size:", page_size).c_str(),
        [=](benchmark::State& state) { RunMatchTurns(state, env, summary, page_size); })
        ->Iterations(std::max(1, config.match_iterations / 100))
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace kvcellar::bench
