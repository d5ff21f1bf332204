#include "server/datapath/matcher.h"

#include <tuple>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "core/page_key.h"
#include "server/status_util.h"

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
    : pins_(pins), ids_(ids), metrics_(metrics), limits_(limits), l3_(l3) {}

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
  core::RadixIndex* index = ns.index();  // nullptr until a worker fixed the geometry: all miss.
  const uint32_t page_size = ns.spec().page_size;
  const uint32_t lease_ms = limits_->PinLeaseMs(request.pin_lease_ms());
  const absl::Duration lease = absl::Milliseconds(lease_ms);
  const absl::Time deadline = absl::Now() + lease;
  core::MatchOptions options;
  options.shards = ns.group_shards();

  const size_t num_tiers = l3_.tiers != nullptr ? l3_.tiers->size() : 0;
  const v1::PrefetchPolicy policy = l3_.prefetcher != nullptr
                                        ? l3_.prefetcher->Resolve(request.prefetch_policy())
                                        : v1::PREFETCH_POLICY_NONE;
  const absl::Duration lookup_budget =
      std::min(absl::Milliseconds(request.l3_lookup_timeout_ms()), l3_.max_lookup);

  std::vector<core::PageKey> keys;
  std::vector<PrefetchChain> chains;
  uint64_t prefetch_tokens = 0;
  uint64_t hits = 0;
  uint64_t lookups = 0;
  std::array<uint32_t, core::kMaxL3Tiers> l3_hits_by_tier{};
  uint64_t l3_misses = 0;
  response->mutable_results()->Reserve(request.sequences_size());
  for (const v1::MatchSequence& seq : request.sequences()) {
    v1::MatchResult* result = response->add_results();
    result->set_request_id(seq.request_id());
    if (num_tiers > 0) chains.emplace_back();
    keys.clear();
    size_t first = 0;  // Index in `keys` of the first page to look up.
    if (seq.token_ids_size() > 0) {
      const size_t full = core::FullPages(seq.token_ids_size(), page_size);
      keys.resize(full);
      core::ComputePageKeys(ns.digest(),
                            absl::MakeConstSpan(seq.token_ids().data(), seq.token_ids_size()),
                            page_size, absl::MakeSpan(keys));
      first = std::min<size_t>(seq.num_computed_pages(), full);
    } else {
      ns.AppendIndexKeys(seq.page_keys(), &keys);
    }
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
    lookups += lookup.size();
    if (index == nullptr || lookup.empty()) continue;

    uint64_t pin_id = 0;
    if (request.pin()) {
      pin_id = ids_->NextId();
      options.pin = core::PinLease{pin_id, deadline};
    } else {
      options.pin.reset();
    }
    absl::StatusOr<core::MatchResult> m = index->Match(lookup, options);
    if (!m.ok()) continue;  // Only for a bad shard set, which the namespace rules out.
    const uint32_t l2 = m->l2_pages;
    result->set_l2_hit_pages(l2);
    hits += l2;
    if (l3_.writer != nullptr) l3_.writer->OnL2Hits(ns, lookup.first(l2));
    bool pinned = false;
    if (pin_id != 0 && m->pinned_pages > 0) {
      pins_->Add(pin_id, session.instance_id, session.ns,
                 std::vector<core::PageKey>(lookup.begin(), lookup.begin() + l2), session.tp_size,
                 lease, deadline, session.id);
      result->set_pin_id(pin_id);
      pinned = true;
    }
    if (num_tiers == 0) continue;

    // The page before lookup[0]: computed from tokens, or page 0; unknown for keys sent from
    // page num_computed_pages > 0 on (then only pages the index knows can be fetched).
    std::optional<core::PageKey> parent0;
    if (first > 0) parent0 = keys[first - 1];
    const bool parent0_known = seq.token_ids_size() > 0 || seq.num_computed_pages() == 0;
    std::array<uint32_t, core::kMaxL3Tiers> runs = m->l3_pages;
    uint32_t known = 0;
    for (size_t t = 0; t < num_tiers; ++t) known = std::max(known, runs[t]);
    const size_t from = l2 + known;
    // Pages found only in a backend enter the index under their parent: not knowable for the
    // first page sent when the engine sent keys from a page > 0.
    if (lookup_budget > absl::ZeroDuration() && from < lookup.size() &&
        (from > 0 || parent0_known)) {
      std::optional<core::PageKey> parent = from > 0 ? std::optional(lookup[from - 1]) : parent0;
      std::array<uint32_t, core::kMaxL3Tiers> found{};
      LookUpL3(ns, lookup, from, parent, lookup_budget, found);
      for (size_t t = 0; t < num_tiers; ++t) {
        // A tier's run extends only when it reached the pages asked about.
        if (runs[t] == known) runs[t] += found[t];
      }
    }
    uint32_t best = 0;
    for (size_t t = 0; t < num_tiers; ++t) best = std::max(best, runs[t]);
    if (best == 0) {
      l3_misses += lookup.size() - l2;
      continue;
    }
    // Each page from the first tier whose run covers it.
    PrefetchChain& chain = chains.back();
    chain.tiers.resize(best);
    auto* by_tier = result->mutable_l3_hit_pages_by_tier();
    by_tier->Resize(static_cast<int>(num_tiers), 0);
    for (uint32_t p = 0; p < best; ++p) {
      for (size_t t = 0; t < num_tiers; ++t) {
        if (runs[t] > p) {
          chain.tiers[p] = static_cast<int>(t);
          ++(*by_tier)[static_cast<int>(t)];
          ++l3_hits_by_tier[t];
          break;
        }
      }
    }
    result->set_l3_hit_pages(best);
    l3_misses += lookup.size() - l2 - best;
    if (policy == v1::PREFETCH_POLICY_NONE) continue;
    chain.parent = l2 > 0 ? std::optional(lookup[l2 - 1]) : parent0;
    chain.parent_known = l2 > 0 || parent0_known;
    chain.keys.assign(lookup.begin() + l2, lookup.begin() + l2 + best);
    prefetch_tokens += uint64_t{best} * page_size;
    if (request.pin()) {
      if (!pinned) {
        // Nothing in L2 yet: a pin for the prefetched pages to join as they land.
        pins_->Add(pin_id, session.instance_id, session.ns, {}, session.tp_size, lease, deadline);
        result->set_pin_id(pin_id);
      }
      chain.pin_id = pin_id;
    }
  }
  metrics_->CountMatch(hits, lookups - hits, page_size);
  NamespaceCounters& c = ns.counters();
  NamespaceCounters::Add(c.match_calls, 1);
  NamespaceCounters::Add(c.match_sequences, static_cast<uint64_t>(request.sequences_size()));
  NamespaceCounters::Add(c.lookup_pages, lookups);
  NamespaceCounters::Add(c.l2_hit_pages, hits);
  uint64_t l3_hits = 0;
  for (uint32_t h : l3_hits_by_tier) l3_hits += h;
  NamespaceCounters::Add(c.l3_hit_pages, l3_hits);
  c.Touch();
  if (num_tiers == 0) return;
  metrics_->CountL3Match(absl::MakeConstSpan(l3_hits_by_tier.data(), num_tiers), l3_misses,
                         page_size);
  if (prefetch_tokens == 0) return;
  L3Prefetcher::Started started = l3_.prefetcher->Start(
      session, std::move(chains), policy,
      l3_.prefetcher->Deadline(policy, request.prefetch_timeout_ms(), prefetch_tokens),
      /*always_op=*/false);
  if (started.op == nullptr) return;
  response->set_prefetch_op_id(started.op->id);
  for (size_t i = 0; i < started.fetching.size(); ++i) {
    response->mutable_results(static_cast<int>(i))->set_prefetch_pages(started.fetching[i]);
  }
}

void Matcher::LookUpL3(Namespace& ns, absl::Span<const core::PageKey> lookup, size_t from,
                       std::optional<core::PageKey> parent, absl::Duration budget,
                       std::array<uint32_t, core::kMaxL3Tiers>& runs) {
  const size_t num_tiers = l3_.tiers->size();
  std::vector<uint32_t> shards(static_cast<size_t>(ns.shards()));
  for (size_t s = 0; s < shards.size(); ++s) shards[s] = static_cast<uint32_t>(s);
  const absl::Span<const core::PageKey> ask = lookup.subspan(from);
  const absl::Time deadline = absl::Now() + budget;
  std::vector<std::optional<storage::ExistsFuture>> futures(num_tiers);
  for (size_t t = 0; t < num_tiers; ++t) {
    absl::StatusOr<storage::ExistsFuture> f = l3_.tiers->tier(t).backend->ExistsAsync(
        {ns.digest(), ask, shards, budget});
    if (f.ok()) futures[t] = *std::move(f);
  }
  std::vector<core::L3Update> updates;
  for (size_t t = 0; t < num_tiers; ++t) {
    if (!futures[t].has_value()) continue;
    const storage::ExistsResult* r =
        futures[t]->WaitFor(std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (r == nullptr) continue;  // Too slow this time: the pages count as not found.
    runs[t] = static_cast<uint32_t>(r->present_prefix);
    for (size_t p = 0; p < r->present_prefix; ++p) {
      std::optional<core::PageKey> page_parent = p > 0 ? std::optional(ask[p - 1]) : parent;
      for (uint32_t s : shards) {
        updates.push_back({ask[p], page_parent, static_cast<uint16_t>(s),
                           static_cast<uint8_t>(t), true});
      }
    }
  }
  if (updates.empty()) return;
  // A page whose parent is unknown to the index cannot be recorded (the tree stays
  // prefix-closed); it still counts for this answer, and is read by key if prefetched.
  std::vector<absl::Status> statuses(updates.size());
  ns.index()->UpdateL3(updates, absl::MakeSpan(statuses));
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
