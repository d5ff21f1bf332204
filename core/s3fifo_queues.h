// S3FifoQueues: the small and main FIFO queues of S3-FIFO (Yang et al., SOSP 2023) over intrusive
// hooks, with the index's parking, and S3-FIFO's choice of victim. Shared by S3FifoPolicy (which
// adds the ghost that sends returning pages to M) and AdaptivePolicy (which adds recency order and
// an MRU expert).
//
// A hook's `queue` is one of the values below; `freq` counts hits, capped at kMaxFreq by the owner
// (CountHit).
// The victim: from S while it holds at least 10% of the queued pages, else from M. At the tail of
// S, a page hit at least kPromoteFreq times moves to M, else it is the victim; at the tail of M, a
// page with freq > 0 goes back to the head with freq - 1, else it is the victim. An ineligible
// candidate is parked until OnEligible puts it back at its queue's tail.
//
// Threads: its owner's (called under the owning index's mutex).
#ifndef KVCELLAR_CORE_S3FIFO_QUEUES_H_
#define KVCELLAR_CORE_S3FIFO_QUEUES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/eviction_policy.h"

namespace kvcellar::core {

class S3FifoQueues {
 public:
  // The paper's small-queue share: S holds 10% of the pages.
  static constexpr size_t kSmallPercent = 10;
  // Frequency cap: a 2-bit counter in the paper.
  static constexpr uint8_t kMaxFreq = 3;
  // Hits needed at the tail of S to move to M ("freq > 1" in the paper's Algorithm 1,
  // move-to-main-threshold=2 in libCacheSim).
  static constexpr uint8_t kPromoteFreq = 2;

  // EvictionHook::queue values.
  static constexpr uint8_t kSmall = 1;
  static constexpr uint8_t kMain = 2;
  static constexpr uint8_t kParkedSmall = 3;
  static constexpr uint8_t kParkedMain = 4;

  HookList& small() { return small_; }
  HookList& main() { return main_; }
  const HookList& small() const { return small_; }
  const HookList& main() const { return main_; }

  // A new page at the head of M (`to_main`) or of S.
  void Insert(EvictionHook* hook, bool to_main);
  // The queue holding `hook`, or nullptr when it is parked or untracked.
  HookList* QueueOf(const EvictionHook& hook);
  void OnEligible(EvictionHook* hook);
  void OnRemove(EvictionHook* hook);
  // S3-FIFO's victim, taken out of its queue (nullptr when no queued page is evictable);
  // `from_small` says which queue it left.
  EvictionHook* Victim(const EvictionCandidates& candidates, bool* from_small);

  size_t Tracked() const { return small_.size() + main_.size() + parked_; }
  static bool Parked(const EvictionHook& hook) {
    return hook.queue == kParkedSmall || hook.queue == kParkedMain;
  }
  // A hit on `hook`: its count, up to kMaxFreq.
  static void CountHit(EvictionHook* hook) {
    if (hook->freq < kMaxFreq) ++hook->freq;
  }
  // Checks both queues' links, counts and frequencies (at most kMaxFreq).
  absl::Status Check(absl::string_view name) const;

 private:
  void Park(EvictionHook* h, HookList& from, uint8_t parked_queue);

  HookList small_;
  HookList main_;
  size_t parked_ = 0;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_S3FIFO_QUEUES_H_
