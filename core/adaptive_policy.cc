#include "core/adaptive_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvcellar::core {

void AdaptivePolicy::OnInsert(EvictionHook* hook, uint64_t fingerprint) {
  hook->freq = 0;
  hook->flags = 0;
  bool to_main = false;
  if (std::optional<GhostFifo::Taken> back = ghost_.Take(fingerprint); back.has_value()) {
    Regret((back->payload & kByMru) != 0, back->age);
    to_main = (back->payload & kFromSmall) != 0;  // S3-FIFO: back from S's ghost into M.
  }
  queues_.Insert(hook, to_main);
  peak_tracked_ = std::max(peak_tracked_, Tracked());
}

void AdaptivePolicy::Regret(bool by_mru, uint32_t age) {
  const double n = static_cast<double>(std::max<size_t>(peak_tracked_, 1));
  const double regret = std::pow(kDiscountAtN, static_cast<double>(age) / n);
  double mru = mru_weight_;
  double queues = 1.0 - mru_weight_;
  (by_mru ? mru : queues) *= std::exp(-kLearningRate * regret);
  mru_weight_ = std::clamp(mru / (mru + queues), kMinWeight, 1.0 - kMinWeight);
}

void AdaptivePolicy::OnAccess(EvictionHook* hook) {
  S3FifoQueues::CountHit(hook);
  HookList* queue = queues_.QueueOf(*hook);
  if (queue != nullptr && queue->head() != hook) {
    queue->Remove(hook);
    queue->PushHead(hook);
  }
}

EvictionHook* AdaptivePolicy::NewestEvictable(const EvictionCandidates& candidates) {
  for (HookList* queue : {&queues_.small(), &queues_.main()}) {
    size_t seen = 0;
    for (EvictionHook* h = queue->head(); h != nullptr && seen < kMruScan; h = h->next, ++seen) {
      if (!candidates.Evictable(*h)) continue;
      queue->Remove(h);
      return h;
    }
  }
  return nullptr;
}

EvictionHook* AdaptivePolicy::PickVictim(const EvictionCandidates& candidates) {
  EvictionHook* victim = nullptr;
  uint8_t payload = 0;
  if (mru_weight_ > 0.5) {
    victim = NewestEvictable(candidates);
    if (victim != nullptr) {
      payload = kByMru | (victim->queue == S3FifoQueues::kSmall ? kFromSmall : 0);
      ++mru_evictions_;
    }
  }
  if (victim == nullptr) {
    bool from_small = false;
    victim = queues_.Victim(candidates, &from_small);
    if (victim == nullptr) return nullptr;
    payload = from_small ? kFromSmall : 0;
    ++queue_evictions_;
  }
  victim->queue = 0;
  victim->freq = 0;
  ghost_.Add(candidates.Fingerprint(*victim), payload, peak_tracked_);
  return victim;
}

absl::Status AdaptivePolicy::CheckConsistency() const {
  if (absl::Status s = queues_.Check("adaptive"); !s.ok()) return s;
  if (!(mru_weight_ >= kMinWeight && mru_weight_ <= 1.0 - kMinWeight)) {
    return absl::InternalError(absl::StrCat("adaptive: MRU weight ", mru_weight_, " out of range"));
  }
  return ghost_.Check();
}

}  // namespace kvcellar::core
