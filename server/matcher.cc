#include "server/matcher.h"

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

Matcher::Matcher(PinTable* pins, OpTable* ids, CacheMetrics* metrics, const CacheLimits* limits)
    : pins_(pins), ids_(ids), metrics_(metrics), limits_(limits) {}

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

  std::vector<core::PageKey> keys;
  uint64_t hits = 0;
  uint64_t lookups = 0;
  response->mutable_results()->Reserve(request.sequences_size());
  for (const v1::MatchSequence& seq : request.sequences()) {
    v1::MatchResult* result = response->add_results();
    result->set_request_id(seq.request_id());
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
    result->set_l2_hit_pages(m->l2_pages);
    hits += m->l2_pages;
    if (pin_id != 0 && m->pinned_pages > 0) {
      pins_->Add(pin_id, session.instance_id, session.ns,
                 std::vector<core::PageKey>(lookup.begin(), lookup.begin() + m->l2_pages),
                 session.tp_size, lease, deadline, session.id);
      result->set_pin_id(pin_id);
    }
  }
  metrics_->CountMatch(hits, lookups - hits, page_size);
  NamespaceCounters& c = ns.counters();
  NamespaceCounters::Add(c.match_calls, 1);
  NamespaceCounters::Add(c.match_sequences, static_cast<uint64_t>(request.sequences_size()));
  NamespaceCounters::Add(c.lookup_pages, lookups);
  NamespaceCounters::Add(c.l2_hit_pages, hits);
  c.Touch();
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
