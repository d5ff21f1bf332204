#include "server/l3/l3_lookup.h"

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "storage/backend.h"

namespace kvcellar::server {

TierRuns L3Lookup::Runs(Namespace& ns, const L3LookupInput& in) {
  const size_t num_tiers = tiers_->size();
  TierRuns runs = in.index_runs;
  uint32_t known = 0;
  for (size_t t = 0; t < num_tiers; ++t) known = std::max(known, runs[t]);
  const size_t from = in.l2_pages + known;
  // Pages found only in a backend enter the index under their parent: not knowable for the
  // first page sent when the engine sent keys from a page > 0.
  if (in.budget <= absl::ZeroDuration() || from >= in.lookup.size() ||
      (from == 0 && !in.parent0_known)) {
    return runs;
  }
  std::optional<core::PageKey> parent = from > 0 ? std::optional(in.lookup[from - 1]) : in.parent0;
  const TierRuns found = AskBackends(ns, in.lookup, from, parent, in.budget);
  for (size_t t = 0; t < num_tiers; ++t) {
    // A tier's run extends only when it reached the pages asked about.
    if (runs[t] == known) runs[t] += found[t];
  }
  return runs;
}

uint32_t L3Lookup::Attribute(const TierRuns& runs, std::vector<int>* tier_of_page,
                             absl::Span<uint32_t> pages_by_tier) const {
  const size_t num_tiers = tiers_->size();
  uint32_t best = 0;
  for (size_t t = 0; t < num_tiers; ++t) best = std::max(best, runs[t]);
  tier_of_page->resize(best);
  for (uint32_t p = 0; p < best; ++p) {
    for (size_t t = 0; t < num_tiers; ++t) {
      if (runs[t] > p) {
        (*tier_of_page)[p] = static_cast<int>(t);
        ++pages_by_tier[t];
        break;
      }
    }
  }
  return best;
}

TierRuns L3Lookup::AskBackends(Namespace& ns, absl::Span<const core::PageKey> lookup, size_t from,
                               std::optional<core::PageKey> parent, absl::Duration budget) {
  const size_t num_tiers = tiers_->size();
  TierRuns runs{};
  std::vector<uint32_t> shards(static_cast<size_t>(ns.shards()));
  for (size_t s = 0; s < shards.size(); ++s) shards[s] = static_cast<uint32_t>(s);
  const absl::Span<const core::PageKey> ask = lookup.subspan(from);
  const absl::Time deadline = absl::Now() + budget;
  std::vector<std::optional<storage::ExistsFuture>> futures(num_tiers);
  for (size_t t = 0; t < num_tiers; ++t) {
    absl::StatusOr<storage::ExistsFuture> f =
        tiers_->tier(t).backend->ExistsAsync({ns.digest(), ask, shards, budget});
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
  if (updates.empty()) return runs;
  // A page whose parent is unknown to the index cannot be recorded (the tree stays
  // prefix-closed); it still counts for this answer, and is read by key if prefetched.
  std::vector<absl::Status> statuses(updates.size());
  ns.index()->UpdateL3(updates, absl::MakeSpan(statuses));
  return runs;
}

}  // namespace kvcellar::server
