// S3FifoPolicy: S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction",
// SOSP 2023), adapted to an index that evicts on demand.
//
// Three FIFO queues: a small queue S that new pages enter, a main queue M, and a ghost queue G of
// fingerprints of pages recently evicted from S. A hit only bumps a 2-bit counter (capped at 3),
// so hits never touch the queues. Eviction takes from S while S holds at least 10% of the queued
// pages, else from M. At the tail of S, a page hit at least kPromoteFreq times moves to M,
// otherwise it is evicted and remembered in G. At the tail of M, a page with freq > 0 is
// reinserted at the head with freq - 1, otherwise evicted. A page inserted while its fingerprint
// is in G goes straight to M. One-hit pages (a long scan) thus pass through S without displacing
// the pages in M, which is what makes S3-FIFO scan-resistant where LRU is not.
//
// The index has no fixed cache size (it evicts when asked), so "10% of the cache" is 10% of the
// pages queued now, and G holds 90% of the most pages ever tracked at once (the cache size as the
// workload has shown it), as libCacheSim's defaults do for a fixed size.
//
// Threads: called only under the owning RadixIndex's mutex (see eviction_policy.h).
#ifndef KVCELLAR_CORE_S3FIFO_POLICY_H_
#define KVCELLAR_CORE_S3FIFO_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/eviction_policy.h"
#include "core/ghost_fifo.h"
#include "core/s3fifo_queues.h"

namespace kvcellar::core {

class S3FifoPolicy final : public EvictionPolicy {
 public:
  static constexpr size_t kSmallPercent = S3FifoQueues::kSmallPercent;
  // The paper's ghost size: as many entries as M, i.e. 90% of the pages.
  static constexpr size_t kGhostPercent = 90;
  static constexpr uint8_t kMaxFreq = S3FifoQueues::kMaxFreq;
  static constexpr uint8_t kPromoteFreq = S3FifoQueues::kPromoteFreq;

  S3FifoPolicy() = default;
  S3FifoPolicy(const S3FifoPolicy&) = delete;
  S3FifoPolicy& operator=(const S3FifoPolicy&) = delete;

  absl::string_view Name() const override { return "s3fifo"; }
  void OnInsert(EvictionHook* hook, uint64_t fingerprint) override;
  void OnAccess(EvictionHook* hook) override;
  void OnEligible(EvictionHook* hook) override { queues_.OnEligible(hook); }
  void OnRemove(EvictionHook* hook) override { queues_.OnRemove(hook); }
  EvictionHook* PickVictim(const EvictionCandidates& candidates) override;

  size_t Tracked() const override { return queues_.Tracked(); }
  bool Parked(const EvictionHook& hook) const override { return S3FifoQueues::Parked(hook); }
  size_t MemoryBytes() const override { return ghost_.MemoryBytes(); }
  absl::Status CheckConsistency() const override;

  // For tests: queue sizes and ghost size.
  size_t small_size() const { return queues_.small().size(); }
  size_t main_size() const { return queues_.main().size(); }
  // Entries still young enough to count (O(table); for tests).
  size_t ghost_size() const { return ghost_.Size(); }

 private:
  S3FifoQueues queues_;
  size_t peak_tracked_ = 0;
  GhostFifo ghost_;  // Pages evicted from S; holds 90% of peak tracked (kGhostPercent).
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_S3FIFO_POLICY_H_
