// CacheMetrics: the data path's Prometheus series (names start kvcellar_, labels bounded).
//
// Counters are registered once and their series resolved up front, so hot paths update an atomic
// and never look anything up. Gauges that mirror state owned elsewhere (sessions, L2 pages) are
// scrape-time collectors added by their owner through AddCollector; they are removed when this
// object is destroyed, so nothing runs against freed state.
//
// Series (docs/metrics.md is the catalogue, with labels and meanings):
//   kvcellar_match_requests_total, kvcellar_match_{pages,tokens}_total{tier,result},
//   kvcellar_match_l3_tier_pages_total{tier}, kvcellar_match_l3_tier_tokens_total{tier,result},
//   kvcellar_moved_bytes_total{direction}, kvcellar_transfer_duration_seconds{direction},
//   kvcellar_ops_total{kind,outcome}, kvcellar_op_pages_total{kind,status},
//   kvcellar_prefetch_pages_total{policy,status}, kvcellar_l3_writes_total{tier,result},
//   kvcellar_{session,pin}_lease_expiries_total, kvcellar_evicted_{pages,bytes}_total{reason},
//   kvcellar_cleared_objects_total, kvcellar_pins_revoked_total.
//
// Threads: every method may be called from any thread.
#ifndef KVCELLAR_SERVER_METRICS_CACHE_METRICS_H_
#define KVCELLAR_SERVER_METRICS_CACHE_METRICS_H_

#include <array>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvcellar/v1/common.pb.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

enum class EvictReason { kPoolFull = 0, kWatermark = 1, kAdmin = 2, kRegionRelease = 3 };
inline constexpr int kEvictReasons = 4;

// The counters' values at one moment (AdminService.GetStats), read series by series.
struct CacheCountersSnapshot {
  uint64_t match_requests = 0;
  uint64_t l2_hit_pages = 0;
  uint64_t l2_miss_pages = 0;
  uint64_t l2_hit_tokens = 0;
  uint64_t l2_miss_tokens = 0;
  uint64_t h2d_bytes = 0;  // Load.
  uint64_t d2h_bytes = 0;  // Backup.
  uint64_t l3_hit_pages = 0;
  uint64_t l3_hit_tokens = 0;
  uint64_t l3_miss_pages = 0;  // Missed in L2 and every L3 tier (counted only with L3 tiers).
  uint64_t l3_miss_tokens = 0;
  uint64_t l2_to_l3_bytes = 0;
  uint64_t l3_to_l2_bytes = 0;
  // [kind: 0 load, 1 backup, 2 prefetch][outcome: 0 done, 1 failed, 2 cancelled].
  std::array<std::array<uint64_t, 3>, 3> ops{};
  // [kind][PageStatus number].
  std::array<std::array<uint64_t, v1::PageStatus_ARRAYSIZE>, 3> pages{};
  uint64_t session_lease_expiries = 0;
  uint64_t pin_lease_expiries = 0;
  uint64_t pins_revoked = 0;
  uint64_t evicted_pages = 0;  // All reasons.
  uint64_t evicted_bytes = 0;
  uint64_t cleared_objects = 0;
};

class CacheMetrics {
 public:
  // Registers the families in `registry` (which outlives this object). Registration of a name
  // that already exists with the same shape returns the existing family, so several services in
  // one process (tests) share series.
  explicit CacheMetrics(MetricsRegistry* registry);
  ~CacheMetrics();
  CacheMetrics(const CacheMetrics&) = delete;
  CacheMetrics& operator=(const CacheMetrics&) = delete;

  // A scrape-time collector, removed by RemoveCollectors() or the destructor.
  void AddCollector(std::function<void(MetricWriter&)> collect);
  // Removes every collector added here; once it returns none of them runs again. Owners call it
  // before destroying what the collectors read.
  void RemoveCollectors();

  void CountMatch(uint64_t l2_hit_pages, uint64_t l2_miss_pages, uint32_t page_size);
  // A device copy that finished: h2d for Load, d2h for Backup, `seconds` from submission to
  // completion (a Backup's includes waiting for the engine's ready signal).
  void CountMovedBytes(v1::OpKind kind, uint64_t bytes, double seconds);
  void CountOp(v1::OpKind kind, v1::OpState state);
  void CountPages(v1::OpKind kind, v1::PageStatus status, uint64_t pages);
  void CountSessionLeaseExpiry() { session_lease_expiries_->Increment(); }
  void CountPinLeaseExpiries(uint64_t n) { pin_lease_expiries_->Add(n); }
  void CountEviction(EvictReason reason, uint64_t pages, uint64_t bytes);
  void CountCleared(uint64_t objects) { cleared_objects_->Add(objects); }
  void CountPinsRevoked(uint64_t n) { pins_revoked_->Add(n); }

  CacheCountersSnapshot Snapshot() const;

  // ---- L3 ----
  // Creates the per-tier series (names in lookup order). Call once, before the first count.
  void SetL3Tiers(const std::vector<std::string>& names);
  // One Match's L3 outcome: pages hit per tier (first tier holding each page), and pages missed
  // in L2 and every L3 tier.
  void CountL3Match(absl::Span<const uint32_t> hit_pages_by_tier, uint64_t miss_pages,
                    uint32_t page_size);
  // Bytes moved between L2 and L3 (write: one tier's L2 -> L3 put batch; read: one prefetch's
  // L3 -> L2 reads), and the seconds the transfer took. Nothing is counted when bytes == 0.
  void CountL3Bytes(bool write, uint64_t bytes, double seconds);
  enum class L3WriteResult { kOk = 0, kFailed, kDropped, kNotResident };
  void CountL3Writes(size_t tier, L3WriteResult result, uint64_t objects);
  // Final page statuses of a prefetch op, by the policy it ran under.
  void CountPrefetchPages(v1::PrefetchPolicy policy, v1::PageStatus status, uint64_t pages);

 private:
  static constexpr int kKinds = 3;  // load, backup, prefetch
  static constexpr int kOutcomes = 3;  // done, failed, cancelled
  static constexpr int kStatuses = v1::PageStatus_ARRAYSIZE;
  static int KindIndex(v1::OpKind kind) {
    return kind == v1::OP_KIND_BACKUP ? 1 : kind == v1::OP_KIND_PREFETCH ? 2 : 0;
  }
  static constexpr int kPolicies = v1::PrefetchPolicy_ARRAYSIZE;
  static constexpr int kWriteResults = 4;

  MetricsRegistry* const registry_;
  Counter* match_requests_ = nullptr;
  Counter* l2_hit_pages_ = nullptr;
  Counter* l2_miss_pages_ = nullptr;
  Counter* l2_hit_tokens_ = nullptr;
  Counter* l2_miss_tokens_ = nullptr;
  Counter* h2d_bytes_ = nullptr;
  Counter* d2h_bytes_ = nullptr;
  // kvcellar_transfer_duration_seconds by direction: h2d, d2h, l2_to_l3, l3_to_l2.
  std::array<Histogram*, 4> transfer_seconds_{};
  std::array<std::array<Counter*, kOutcomes>, kKinds> ops_{};
  std::array<std::array<Counter*, kStatuses>, kKinds> pages_{};
  Counter* session_lease_expiries_ = nullptr;
  Counter* pin_lease_expiries_ = nullptr;
  std::array<Counter*, kEvictReasons> evicted_pages_{};
  std::array<Counter*, kEvictReasons> evicted_bytes_{};
  Counter* cleared_objects_ = nullptr;
  Counter* pins_revoked_ = nullptr;
  Counter* l3_hit_pages_ = nullptr;
  Counter* l3_miss_pages_ = nullptr;
  Counter* l3_hit_tokens_ = nullptr;
  Counter* l3_miss_tokens_ = nullptr;
  Counter* l2_to_l3_ = nullptr;
  Counter* l3_to_l2_ = nullptr;
  std::vector<Counter*> l3_tier_hit_pages_;                          // Per tier.
  std::vector<Counter*> l3_tier_hit_tokens_;                         // Per tier.
  std::vector<Counter*> l3_tier_miss_tokens_;                        // Per tier.
  std::vector<std::array<Counter*, kWriteResults>> l3_tier_writes_;  // Per tier.
  std::array<std::array<Counter*, kStatuses>, kPolicies> prefetch_pages_{};

  absl::Mutex mu_;
  std::vector<CollectorId> collectors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_METRICS_CACHE_METRICS_H_
