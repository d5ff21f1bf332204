// EvictionSim: replays a trace of prompts against an L2 of a fixed number of pages, offline, to
// judge eviction policies against Belady's bound: the radix index with its own policies (the code
// the daemon runs), a policy under study, and the offline optimum on the same trace.
//
// A trace is the full pages of each request's prompt, as page ids from its sequence's first page.
// An id always has the same parent (the id before it in every request naming it), as a page key
// does. Per request, in order:
//   1. its hit is the longest prefix of its pages in the cache (what a Match answers);
//   2. every page of it is then in the cache (the engine backs up its misses);
//   3. the cache gives up pages until it holds at most `capacity_pages`; or, with watermarks as
//      the daemon's L2Space keeps them (pool.high_watermark, pool.low_watermark), once it holds
//      more than high x capacity, down to low x capacity.
// The hit rate is hit tokens over prompt tokens (a prompt's tail short of a page never hits).
//
// Belady's bound: on overflow the page whose next use is farthest leaves (never used again:
// farthest of all), the deepest first on ties; the request's own new pages compete like any other
// (a page used later than everything cached is not kept: a bypass). A child is never used before
// its parent, so the deepest-first tie keeps the cache prefix-closed and every page cached is a
// hit when next asked for: the bound is the most hits any eviction order gets (the simulator's
// test compares it with an exhaustive search on small traces).
//
// Threads: the functions keep no state; a trace may be replayed from several threads at once.
#ifndef KVCELLAR_CORE_EVICTION_SIM_H_
#define KVCELLAR_CORE_EVICTION_SIM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/eviction_policy.h"
#include "core/page_key.h"

namespace kvcellar::core {

struct TraceRequest {
  std::vector<uint64_t> pages;  // The prompt's full pages, from the sequence's first.
  uint64_t tokens = 0;          // Prompt tokens (at least pages x page_size).
};

struct Trace {
  uint32_t page_size = 1;  // Tokens per page.
  std::vector<TraceRequest> requests;

  // Distinct pages the trace names (what an unbounded cache ends up holding).
  uint64_t DistinctPages() const;
};

struct SimResult {
  uint64_t requests = 0;
  uint64_t tokens = 0;      // Prompt tokens over all requests.
  uint64_t hit_tokens = 0;  // Hit pages x page_size.
  uint64_t evicted_pages = 0;

  double HitRate() const {
    return tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(tokens);
  }
};

// The key the simulator gives page `id` in the index (distinct ids, distinct keys).
PageKey SimPageKey(uint64_t id);

// Where the index's replay evicts: past high x capacity_pages, down to low x capacity_pages.
struct SimCapacity {
  uint64_t pages = 0;
  double high_watermark = 1.0;
  double low_watermark = 1.0;
};

// The radix index with one of its policies, driven as the daemon drives it: per request a Match
// (an access of the hit), the Load's Match of the hit (a second access), the misses written and
// committed, then EvictPages to the capacity. InvalidArgument when the trace gives a page two
// parents.
absl::StatusOr<SimResult> SimulateIndex(const Trace& trace, EvictionPolicyKind policy,
                                        SimCapacity capacity);
// The same with a policy the caller makes (one index, one policy).
absl::StatusOr<SimResult> SimulateIndex(
    const Trace& trace, const std::function<std::unique_ptr<EvictionPolicy>()>& make_policy,
    SimCapacity capacity);

// Belady's bound (see the file comment).
SimResult SimulateBelady(const Trace& trace, uint64_t capacity_pages);

// No eviction: the trace's best case.
SimResult SimulateUnbounded(const Trace& trace);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_EVICTION_SIM_H_
