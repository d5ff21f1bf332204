// L3Lookup: the L3 side of a Match: how many pages past a sequence's L2 hit each tier holds, and
// which tier each of those pages is read from.
//
// The radix index already says per tier how many further pages that tier holds (copies this
// daemon wrote, read or was told of). With a lookup budget > 0 (the request's
// l3_lookup_timeout_ms capped by storage.max_lookup_ms) the backends are also asked (Exists, all
// tiers at once, waiting at most the budget) about the pages past what the index knows: other
// nodes write shared tiers, and a restarted daemon's index is empty while its files are not.
// What they report is recorded in the index (UpdateL3) for the next Match. A tier's run extends
// only when the index's knowledge of it reached the pages asked about.
//
// The L3 hit is the longest run of any tier; each page is attributed to the first tier (in lookup
// order) whose run covers it, which is also the tier a prefetch reads it from.
//
// Threads: any gRPC handler; no state of its own besides the tiers it was given.
#ifndef KVCELLAR_SERVER_L3_L3_LOOKUP_H_
#define KVCELLAR_SERVER_L3_L3_LOOKUP_H_

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/page_key.h"
#include "core/radix_index.h"
#include "server/l3/l3_tiers.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

// Pages each tier holds, counted from the first page after the L2 hit.
using TierRuns = std::array<uint32_t, core::kMaxL3Tiers>;

// Where the lookup starts: the keys after the L2 hit and what is known of the page before them.
struct L3LookupInput {
  absl::Span<const core::PageKey> lookup;  // The sequence's keys from its first looked-up page.
  uint32_t l2_pages = 0;                    // lookup[0, l2_pages) hit in L2.
  TierRuns index_runs{};                    // What the index knows, from lookup[l2_pages] on.
  // The page before lookup[0]; `parent0_known` false when the engine sent keys from a page > 0
  // and that page is not known (then pages found only in a backend cannot enter the index).
  std::optional<core::PageKey> parent0;
  bool parent0_known = true;
  absl::Duration budget = absl::ZeroDuration();  // How long the backends may be asked; 0: never.
};

class L3Lookup {
 public:
  // `tiers` outlives the lookup; `max_lookup` caps every request's budget.
  L3Lookup(L3Tiers* tiers, absl::Duration max_lookup) : tiers_(tiers), max_lookup_(max_lookup) {}

  size_t num_tiers() const { return tiers_->size(); }

  // The backend budget for a request's l3_lookup_timeout_ms.
  absl::Duration Budget(uint32_t requested_ms) const {
    return std::min(absl::Milliseconds(requested_ms), max_lookup_);
  }

  // Each tier's run after the L2 hit: the index's, extended by what the backends report within
  // the budget (and recorded in the index).
  TierRuns Runs(Namespace& ns, const L3LookupInput& in);

  // The L3 hit of `runs`: its length (the longest run), and in `tier_of_page` (resized to it)
  // the tier each page is read from; `pages_by_tier` counts them per tier.
  uint32_t Attribute(const TierRuns& runs, std::vector<int>* tier_of_page,
                     absl::Span<uint32_t> pages_by_tier) const;

 private:
  // Pages after lookup[from] that each tier holds, asked of the backends within `budget`, and
  // recorded in the index under `parent` (the key before lookup[from]).
  TierRuns AskBackends(Namespace& ns, absl::Span<const core::PageKey> lookup, size_t from,
                       std::optional<core::PageKey> parent, absl::Duration budget);

  L3Tiers* const tiers_;
  const absl::Duration max_lookup_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_LOOKUP_H_
