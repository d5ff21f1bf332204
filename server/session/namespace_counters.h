// NamespaceCounters: what one namespace's engines did since daemon start, for the AdminService
// (ListNamespaces hit rates, GetStats per namespace).
//
// The daemon-wide series of the same events are Prometheus counters (cache_metrics.h); these are
// their per-namespace split, kept out of /metrics because namespaces are labels of unbounded
// cardinality there. Their number is bounded by the namespaces the daemon serves (one per model
// served: namespace_registry.h), and each is a handful of words.
//
// Threads: any thread. Relaxed atomics: each counter is monotonic on its own, and a reader may
// see one a little ahead of another (GetStats says so).
#ifndef KVCELLAR_SERVER_SESSION_NAMESPACE_COUNTERS_H_
#define KVCELLAR_SERVER_SESSION_NAMESPACE_COUNTERS_H_

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"

namespace kvcellar::server {

struct NamespaceCounters {
  std::atomic<uint64_t> match_calls{0};
  std::atomic<uint64_t> match_sequences{0};
  std::atomic<uint64_t> lookup_pages{0};  // After num_computed_pages.
  std::atomic<uint64_t> l2_hit_pages{0};
  std::atomic<uint64_t> l3_hit_pages{0};
  std::atomic<uint64_t> evicted_objects{0};  // L2, by any eviction (pool full, watermark, admin).
  std::atomic<uint64_t> evicted_bytes{0};    // Their slot bytes.
  std::atomic<uint64_t> cleared_objects{0};  // L2 objects removed by admin Clear.
  std::atomic<int64_t> last_access_unix_ms{0};  // Last Match, Load or Backup; 0: none.

  void Touch() {
    last_access_unix_ms.store(absl::ToUnixMillis(absl::Now()), std::memory_order_relaxed);
  }
  static void Add(std::atomic<uint64_t>& c, uint64_t n) { c.fetch_add(n, std::memory_order_relaxed); }
  static uint64_t Get(const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); }
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_NAMESPACE_COUNTERS_H_
