#include "server/datapath/matcher.h"

#include <algorithm>
#include <tuple>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "core/page_key.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

absl::string_view TokenBytes(const v1::MatchSequence& seq) {
  return {reinterpret_cast<const char*>(seq.token_ids().data()),
          seq.token_ids().size() * sizeof(uint32_t)};
}

// Identifies a request for the step memo: everything but the session id, which differs per rank.
uint64_t Fingerprint(const v1::MatchRequest& request) {
  std::vector<uint64_t> sequences;
  sequences.reserve(request.sequences_size());
  for (const v1::MatchSequence& seq : request.sequences()) {
    sequences.push_back(
        absl::Hash<std::tuple<absl::string_view, absl::string_view, uint32_t, absl::string_view>>{}(
            std::make_tuple(absl::string_view(seq.page_keys()), TokenBytes(seq),
                            seq.num_computed_pages(), absl::string_view(seq.request_id()))));
  }
  return absl::Hash<
      std::tuple<std::vector<uint64_t>, bool, uint32_t, int, uint32_t, bool, uint32_t>>{}(
      std::make_tuple(std::move(sequences), request.pin(), request.pin_lease_ms(),
                      static_cast<int>(request.prefetch_policy()), request.prefetch_timeout_ms(),
                      request.return_keys(), request.l3_lookup_timeout_ms()));
}

}  // namespace

Matcher::Matcher(PinTable* pins, OpTable* ids, CacheMetrics* metrics, const CacheLimits* limits,
                 MatcherL3 l3)
    : pins_(pins), ids_(ids), metrics_(metrics), limits_(limits), l3_(l3) {
  if (l3_.tiers != nullptr && l3_.tiers->size() > 0) l3_lookup_.emplace(l3_.tiers, l3_.max_lookup);
}

struct Matcher::Call {
  const SessionInfo& session;
  Namespace& ns;
  core::RadixIndex* index;  // nullptr until a worker fixed the geometry: all miss.
  uint32_t page_size;
  absl::Duration lease;
  absl::Time deadline;
  bool pin;
  core::MatchOptions options;
  v1::PrefetchPolicy policy;
  // Every sequence's L3 lookup ends by then: the request's budget is the whole call's, so a
  // Match holds its gRPC thread for at most max_lookup_ms however many sequences it carries.
  absl::Time lookup_deadline;
  size_t num_tiers;

  std::vector<PrefetchChain> chains;  // One per sequence when the daemon has L3 tiers.
  uint64_t prefetch_tokens = 0;
  uint64_t hits = 0;
  uint64_t lookups = 0;
  std::array<uint32_t, core::kMaxL3Tiers> l3_hits_by_tier{};
  uint64_t l3_misses = 0;
};

struct Matcher::SequenceHit {
  core::MatchResult index;  // The index's answer (L2 hit and what it knows of L3).
  uint64_t pin_id = 0;      // The pin id drawn for this sequence; 0 without `pin`.
  bool pinned = false;      // Whether that pin exists already (it holds the L2 hit).
};

absl::Status Matcher::Match(const SessionInfo& session, const v1::MatchRequest& request,
                            v1::MatchResponse* response) {
  if (request.step_id() == 0) {
    Compute(session, request, response);
    return absl::OkStatus();
  }
  const uint64_t fingerprint = Fingerprint(request);
  const absl::Time now = absl::Now();
  std::shared_ptr<MemoEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<MemoEntry>& slot = memo_[{session.instance_id, request.step_id()}];
    if (slot != nullptr && slot->expires > now) {
      if (slot->fingerprint != fingerprint) {
        return CacheError(absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_STEP_MISMATCH,
                          "step_id",
                          absl::StrCat("step_id ", request.step_id(), " was used by instance \"",
                                       session.instance_id,
                                       "\" for a different Match within the group match window"));
      }
      entry = slot;
      mu_.Await(absl::Condition(&entry->ready));
      *response = entry->response;
      response->set_memoized(true);
      metrics_->CountMatch(0, 0, 0);
      return absl::OkStatus();
    }
    slot = std::make_shared<MemoEntry>();
    slot->fingerprint = fingerprint;
    slot->expires = now + absl::Milliseconds(limits_->group_match_window_ms);
    entry = slot;
  }
  Compute(session, request, response);
  absl::MutexLock lock(&mu_);
  entry->response = *response;
  entry->ready = true;
  return absl::OkStatus();
}

void Matcher::Compute(const SessionInfo& session, const v1::MatchRequest& request,
                      v1::MatchResponse* response) {
  Namespace& ns = *session.ns;
  const uint32_t lease_ms = limits_->PinLeaseMs(request.pin_lease_ms());
  Call call{
      .session = session,
      .ns = ns,
      .index = ns.index(),
      .page_size = ns.spec().page_size,
      .lease = absl::Milliseconds(lease_ms),
      .deadline = absl::Now() + absl::Milliseconds(lease_ms),
      .pin = request.pin(),
      .options = {},
      .policy = l3_.prefetcher != nullptr ? l3_.prefetcher->Resolve(request.prefetch_policy())
                                          : v1::PREFETCH_POLICY_NONE,
      .lookup_deadline =
          absl::Now() + (l3_lookup_.has_value() ? l3_lookup_->Budget(request.l3_lookup_timeout_ms())
                                                : absl::ZeroDuration()),
      .num_tiers = l3_lookup_.has_value() ? l3_lookup_->num_tiers() : 0,
      .chains = {},
      .prefetch_tokens = 0,
      .hits = 0,
      .lookups = 0,
      .l3_hits_by_tier = {},
      .l3_misses = 0,
  };
  call.options.shards = ns.group_shards();

  std::vector<core::PageKey> keys;
  response->mutable_results()->Reserve(request.sequences_size());
  for (const v1::MatchSequence& seq : request.sequences()) {
    v1::MatchResult* result = response->add_results();
    result->set_request_id(seq.request_id());
    if (call.num_tiers > 0) call.chains.emplace_back();
    const size_t first = SequenceKeys(ns, seq, &keys);
    absl::Span<const core::PageKey> lookup = absl::MakeConstSpan(keys).subspan(first);
    result->set_total_pages(static_cast<uint32_t>(lookup.size()));
    if (request.return_keys()) {
      if (seq.token_ids_size() > 0) {
        std::string* out = result->mutable_page_keys();
        out->reserve(lookup.size() * core::kPageKeyBytes);
        for (const core::PageKey& k : lookup) out->append(k.AsBytes().data(), core::kPageKeyBytes);
      } else {
        result->set_page_keys(seq.page_keys());  // The engine's own keys, as sent.
      }
    }
    call.lookups += lookup.size();
    if (call.index == nullptr || lookup.empty()) continue;
    absl::StatusOr<SequenceHit> hit = MatchL2(call, lookup, result);
    if (!hit.ok() || call.num_tiers == 0) continue;
    MatchL3(call, seq, keys, first, *hit, result, &call.chains.back());
  }
  Count(call, request);
  StartPrefetch(call, request, response);
}

size_t Matcher::SequenceKeys(Namespace& ns, const v1::MatchSequence& seq,
                             std::vector<core::PageKey>* keys) const {
  keys->clear();
  if (seq.token_ids_size() == 0) {
    ns.AppendIndexKeys(seq.page_keys(), keys);
    return 0;
  }
  const uint32_t page_size = ns.spec().page_size;
  const size_t full = core::FullPages(seq.token_ids_size(), page_size);
  keys->resize(full);
  core::ComputePageKeys(ns.digest(),
                        absl::MakeConstSpan(seq.token_ids().data(), seq.token_ids_size()),
                        page_size, absl::MakeSpan(*keys));
  return std::min<size_t>(seq.num_computed_pages(), full);
}

absl::StatusOr<Matcher::SequenceHit> Matcher::MatchL2(Call& call,
                                                      absl::Span<const core::PageKey> lookup,
                                                      v1::MatchResult* result) {
  SequenceHit hit;
  if (call.pin) {
    hit.pin_id = ids_->NextId();
    call.options.pin = core::PinLease{hit.pin_id, call.deadline};
  } else {
    call.options.pin.reset();
  }
  absl::StatusOr<core::MatchResult> m = call.index->Match(lookup, call.options);
  // Fails only for a bad shard set, which the namespace rules out.
  if (!m.ok()) return m.status();
  hit.index = *m;
  const uint32_t l2 = m->l2_pages;
  result->set_l2_hit_pages(l2);
  call.hits += l2;
  if (l3_.writer != nullptr) l3_.writer->OnL2Hits(call.ns, lookup.first(l2));
  if (hit.pin_id != 0 && m->pinned_pages > 0) {
    pins_->Add(hit.pin_id, call.session.instance_id, call.session.ns,
               std::vector<core::PageKey>(lookup.begin(), lookup.begin() + l2),
               call.session.tp_size, call.lease, call.deadline, call.session.id);
    result->set_pin_id(hit.pin_id);
    hit.pinned = true;
  }
  return hit;
}

void Matcher::MatchL3(Call& call, const v1::MatchSequence& seq,
                      absl::Span<const core::PageKey> keys, size_t first, const SequenceHit& hit,
                      v1::MatchResult* result, PrefetchChain* chain) {
  const absl::Span<const core::PageKey> lookup = keys.subspan(first);
  const uint32_t l2 = hit.index.l2_pages;
  // The page before lookup[0]: computed from tokens, or page 0; unknown for keys sent from
  // page num_computed_pages > 0 on (then only pages the index knows can be fetched).
  L3LookupInput in;
  in.lookup = lookup;
  in.l2_pages = l2;
  in.index_runs = hit.index.l3_pages;
  if (first > 0) in.parent0 = keys[first - 1];
  in.parent0_known = seq.token_ids_size() > 0 || seq.num_computed_pages() == 0;
  // A backend's Exists answers for every object of a page; a hybrid page holds only some (a
  // window's last pages, a state at a boundary): such a namespace's L3 hits are what the index
  // knows (its copies, the startup scan, a Redis tier's index readback).
  in.budget = call.ns.spec().Hybrid()
                  ? absl::ZeroDuration()
                  : std::max(absl::ZeroDuration(), call.lookup_deadline - absl::Now());
  const TierRuns runs = l3_lookup_->Runs(call.ns, in);

  std::array<uint32_t, core::kMaxL3Tiers> by_tier{};
  const uint32_t best = l3_lookup_->Attribute(runs, &chain->tiers, absl::MakeSpan(by_tier));
  if (best == 0) {
    call.l3_misses += lookup.size() - l2;
    return;
  }
  auto* result_by_tier = result->mutable_l3_hit_pages_by_tier();
  result_by_tier->Resize(static_cast<int>(call.num_tiers), 0);
  for (size_t t = 0; t < call.num_tiers; ++t) {
    (*result_by_tier)[static_cast<int>(t)] = by_tier[t];
    call.l3_hits_by_tier[t] += by_tier[t];
  }
  result->set_l3_hit_pages(best);
  call.l3_misses += lookup.size() - l2 - best;
  if (call.policy == v1::PREFETCH_POLICY_NONE) return;
  chain->parent = l2 > 0 ? std::optional(lookup[l2 - 1]) : in.parent0;
  chain->parent_known = l2 > 0 || in.parent0_known;
  chain->keys.assign(lookup.begin() + l2, lookup.begin() + l2 + best);
  call.prefetch_tokens += uint64_t{best} * call.page_size;
  if (call.pin) {
    if (!hit.pinned) {
      // Nothing in L2 yet: a pin for the prefetched pages to join as they land.
      pins_->Add(hit.pin_id, call.session.instance_id, call.session.ns, {},
                 call.session.tp_size, call.lease, call.deadline);
      result->set_pin_id(hit.pin_id);
    }
    chain->pin_id = hit.pin_id;
  }
}

void Matcher::Count(Call& call, const v1::MatchRequest& request) {
  metrics_->CountMatch(call.hits, call.lookups - call.hits, call.page_size);
  NamespaceCounters& c = call.ns.counters();
  NamespaceCounters::Add(c.match_calls, 1);
  NamespaceCounters::Add(c.match_sequences, static_cast<uint64_t>(request.sequences_size()));
  NamespaceCounters::Add(c.lookup_pages, call.lookups);
  NamespaceCounters::Add(c.l2_hit_pages, call.hits);
  uint64_t l3_hits = 0;
  for (uint32_t h : call.l3_hits_by_tier) l3_hits += h;
  NamespaceCounters::Add(c.l3_hit_pages, l3_hits);
  c.Touch();
  if (call.num_tiers == 0) return;
  metrics_->CountL3Match(absl::MakeConstSpan(call.l3_hits_by_tier.data(), call.num_tiers),
                         call.l3_misses, call.page_size);
}

void Matcher::StartPrefetch(Call& call, const v1::MatchRequest& request,
                            v1::MatchResponse* response) {
  if (call.num_tiers == 0 || call.prefetch_tokens == 0) return;
  L3Prefetcher::Started started = l3_.prefetcher->Start(
      call.session, std::move(call.chains), call.policy,
      l3_.prefetcher->Deadline(call.policy, request.prefetch_timeout_ms(), call.prefetch_tokens),
      /*always_op=*/false);
  if (started.op == nullptr) return;
  response->set_prefetch_op_id(started.op->id);
  for (size_t i = 0; i < started.fetching.size(); ++i) {
    response->mutable_results(static_cast<int>(i))->set_prefetch_pages(started.fetching[i]);
  }
}

size_t Matcher::Prune(absl::Time now) {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (auto it = memo_.begin(); it != memo_.end();) {
    // An entry still being computed stays: its first caller is about to fill it.
    if (it->second->ready && it->second->expires <= now) {
      memo_.erase(it++);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

}  // namespace kvcellar::server
