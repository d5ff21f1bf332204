#include "core/s3fifo_policy.h"

#include <algorithm>

namespace kvcellar::core {

void S3FifoPolicy::OnInsert(EvictionHook* hook, uint64_t fingerprint) {
  hook->freq = 0;
  hook->flags = 0;
  queues_.Insert(hook, /*to_main=*/ghost_.Take(fingerprint).has_value());
  peak_tracked_ = std::max(peak_tracked_, Tracked());
}

void S3FifoPolicy::OnAccess(EvictionHook* hook) { S3FifoQueues::CountHit(hook); }

EvictionHook* S3FifoPolicy::PickVictim(const EvictionCandidates& candidates) {
  bool from_small = false;
  EvictionHook* h = queues_.Victim(candidates, &from_small);
  if (h == nullptr) return nullptr;
  h->queue = 0;
  h->freq = 0;
  if (from_small) {
    ghost_.Add(candidates.Fingerprint(*h), 0,
               std::max<size_t>(1, peak_tracked_ * kGhostPercent / 100));
  }
  return h;
}

absl::Status S3FifoPolicy::CheckConsistency() const {
  if (absl::Status s = queues_.Check("s3fifo"); !s.ok()) return s;
  return ghost_.Check();
}

}  // namespace kvcellar::core
