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
// There is no L3 yet: l3_hit_pages is 0, no prefetch op is started whatever the policy
// (prefetch_op_id 0, prefetch_pages 0), and nothing is ever asked of storage.
//
// step_id memo: the first Match of (instance, step_id) computes the answer and keeps it for
// group_match_window_ms; a later one with the same request gets it back with memoized = true, and
// one with a different request is STEP_MISMATCH. A call that arrives while the first is still
// computing waits for it (microseconds: the lookup is in memory).
//
// Threads: any gRPC handler; the housekeeper calls Prune. One mutex guards the memo; it is not
// held during lookups.
#ifndef KVCELLAR_SERVER_MATCHER_H_
#define KVCELLAR_SERVER_MATCHER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/cache_limits.h"
#include "server/cache_metrics.h"
#include "server/op_table.h"
#include "server/pin_table.h"
#include "server/session_registry.h"

namespace kvcellar::server {

class Matcher {
 public:
  // Every pointer outlives the matcher; `ids` provides pin ids (the daemon-wide sequence).
  Matcher(PinTable* pins, OpTable* ids, CacheMetrics* metrics, const CacheLimits* limits);

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

  void Compute(const SessionInfo& session, const v1::MatchRequest& request,
               v1::MatchResponse* response);

  PinTable* const pins_;
  OpTable* const ids_;
  CacheMetrics* const metrics_;
  const CacheLimits* const limits_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::pair<std::string, uint64_t>, std::shared_ptr<MemoEntry>> memo_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_MATCHER_H_
