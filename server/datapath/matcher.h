// Matcher: the Match RPC's lookups: group-consistent L2 hits, optional pins, and the step_id memo
// that gives every rank of an instance the same answer for one scheduler step.
//
// Per sequence the keys are the ones sent (scoped for opaque namespaces) or computed from token
// ids (core::ComputePageKeys from ns_digest: the daemon's chain is the one in docs/keys.md), from
// page num_computed_pages on. A page counts only when every shard the group needs is committed in
// L2 (MHA: all tp_size shards; MLA: the one shared shard); in-flight writes are invisible. With
// `pin`, the hit is pinned in the same index call (no eviction can slip between lookup and pin)
// under a new pin id with tp_size holds (PinTable).
//
// L3 (when tiers are configured): after the L2 hit, L3Lookup (server/l3/l3_lookup.h) says how many
// further pages each tier holds, asking the backends within the request's budget, and which tier
// each page is read from. Under a prefetch policy other than NONE one prefetch op (L3Prefetcher)
// covers every sequence's L3 hit; with `pin` the sequence's pin grows over its pages as they land
// (a pin is created for this even when the L2 hit is 0). L2 hits are reported to the L3Writer
// (write_through_selective and admission count them).
//
// step_id memo: the first Match of (instance, step_id) computes the answer and keeps it for
// group_match_window_ms; a later one with the same request gets it back with memoized = true, and
// one with a different request is STEP_MISMATCH. A call that arrives while the first is still
// computing waits for it (microseconds: the lookup is in memory).
//
// Threads: any gRPC handler; the housekeeper calls Prune. One mutex guards the memo; it is not
// held during lookups.
#ifndef KVCELLAR_SERVER_DATAPATH_MATCHER_H_
#define KVCELLAR_SERVER_DATAPATH_MATCHER_H_

#include <array>
#include <cstdint>
#include <optional>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/config/cache_limits.h"
#include "server/metrics/cache_metrics.h"
#include "server/l3/l3_lookup.h"
#include "server/l3/l3_prefetcher.h"
#include "server/l3/l3_tiers.h"
#include "server/l3/l3_writer.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

// The L3 side of Match; every pointer null (and no tiers) when the daemon has no L3.
struct MatcherL3 {
  L3Tiers* tiers = nullptr;
  L3Prefetcher* prefetcher = nullptr;
  L3Writer* writer = nullptr;
  absl::Duration max_lookup = absl::ZeroDuration();
};

class Matcher {
 public:
  // Every pointer outlives the matcher; `ids` provides pin ids (the daemon-wide sequence).
  Matcher(PinTable* pins, OpTable* ids, CacheMetrics* metrics, const CacheLimits* limits,
          MatcherL3 l3);

  // Answers a validated Match of `session`. Errors: STEP_MISMATCH.
  absl::Status Match(const SessionInfo& session, const v1::MatchRequest& request,
                     v1::MatchResponse* response) ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets memoized answers older than the window. Returns how many.
  size_t Prune(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct MemoEntry {
    uint64_t fingerprint = 0;
    absl::Time expires;
    bool ready = false;
    v1::MatchResponse response;
  };

  // One Match's state shared by its sequences' lookups.
  struct Call;
  // What one sequence's lookup found.
  struct SequenceHit;

  void Compute(const SessionInfo& session, const v1::MatchRequest& request,
               v1::MatchResponse* response);
  // The phases of Compute, in order.
  // The sequence's index keys from its first page to look up; returns that page's index in `keys`.
  size_t SequenceKeys(Namespace& ns, const v1::MatchSequence& seq,
                      std::vector<core::PageKey>* keys) const;
  // The L2 hit, pinned under a new pin id when the request asks for pins.
  absl::StatusOr<SequenceHit> MatchL2(Call& call, absl::Span<const core::PageKey> lookup,
                                      v1::MatchResult* result);
  // The L3 hit after the L2 hit, and the prefetch chain that will read it.
  void MatchL3(Call& call, const v1::MatchSequence& seq, absl::Span<const core::PageKey> keys,
               size_t first, const SequenceHit& hit, v1::MatchResult* result,
               PrefetchChain* chain);
  // The per-call counters into the metrics and the namespace's statistics.
  void Count(Call& call, const v1::MatchRequest& request);
  // One prefetch op over every sequence's L3 hit, named in the response.
  void StartPrefetch(Call& call, const v1::MatchRequest& request, v1::MatchResponse* response);

  PinTable* const pins_;
  OpTable* const ids_;
  CacheMetrics* const metrics_;
  const CacheLimits* const limits_;
  const MatcherL3 l3_;
  std::optional<L3Lookup> l3_lookup_;  // Set when the daemon has L3 tiers.

  absl::Mutex mu_;
  absl::flat_hash_map<std::pair<std::string, uint64_t>, std::shared_ptr<MemoEntry>> memo_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_DATAPATH_MATCHER_H_
