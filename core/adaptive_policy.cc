#include "core/adaptive_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/splitmix.h"

namespace kvcellar::core {

void AdaptivePolicy::OnInsert(EvictionHook* hook, uint64_t fingerprint) {
  hook->freq = 0;
  hook->flags = 0;
  bool to_main = false;
  if (std::optional<GhostFifo::Taken> back = ghost_.Take(fingerprint); back.has_value()) {
    Regret((back->payload & kByMru) != 0, back->age);
    to_main = (back->payload & kFromSmall) != 0;  // S3-FIFO: back from S's ghost into M.
  }
  hook->queue = to_main ? kMain : kSmall;
  (to_main ? main_ : small_).PushHead(hook);
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
  if (hook->freq < kMaxFreq) ++hook->freq;
  HookList* queue = hook->queue == kSmall ? &small_ : hook->queue == kMain ? &main_ : nullptr;
  if (queue != nullptr && queue->head() != hook) {
    queue->Remove(hook);
    queue->PushHead(hook);
  }
}

void AdaptivePolicy::OnEligible(EvictionHook* hook) {
  // A parked page was its queue's candidate: back to that tail, where its hits decide.
  if (hook->queue == kParkedSmall) {
    --parked_;
    hook->queue = kSmall;
    small_.PushTail(hook);
  } else if (hook->queue == kParkedMain) {
    --parked_;
    hook->queue = kMain;
    main_.PushTail(hook);
  }
}

void AdaptivePolicy::OnRemove(EvictionHook* hook) {
  switch (hook->queue) {
    case kSmall:
      small_.Remove(hook);
      break;
    case kMain:
      main_.Remove(hook);
      break;
    case kParkedSmall:
    case kParkedMain:
      --parked_;
      break;
    default:
      break;
  }
  hook->queue = 0;
  hook->freq = 0;
}

void AdaptivePolicy::Park(EvictionHook* h, HookList& from, uint8_t parked_queue) {
  from.Remove(h);
  h->queue = parked_queue;
  ++parked_;
}

double AdaptivePolicy::Draw() {
  return static_cast<double>(SplitMix64(++draws_) >> 11) * 0x1.0p-53;
}

EvictionHook* AdaptivePolicy::NewestEvictable(const EvictionCandidates& candidates) {
  for (HookList* queue : {&small_, &main_}) {
    size_t seen = 0;
    for (EvictionHook* h = queue->head(); h != nullptr && seen < kMruScan; h = h->next, ++seen) {
      if (!candidates.Evictable(*h)) continue;
      queue->Remove(h);
      return h;
    }
  }
  return nullptr;
}

EvictionHook* AdaptivePolicy::QueuesVictim(const EvictionCandidates& candidates, bool* from_small) {
  // Each iteration moves a page S->M (once per insertion), spends one hit of a page in M, parks
  // a page, or returns: the loop is bounded by insertions + hits + parks.
  for (;;) {
    const size_t queued = small_.size() + main_.size();
    *from_small =
        !small_.empty() && (main_.empty() || small_.size() * 100 >= queued * kSmallPercent);
    if (*from_small) {
      EvictionHook* h = small_.tail();
      if (h->freq >= kPromoteFreq) {
        small_.Remove(h);
        h->freq = 0;
        h->queue = kMain;
        main_.PushHead(h);
        continue;
      }
      if (!candidates.Evictable(*h)) {
        Park(h, small_, kParkedSmall);
        continue;
      }
      small_.Remove(h);
      return h;
    }
    if (main_.empty()) return nullptr;
    EvictionHook* h = main_.tail();
    if (h->freq > 0) {
      main_.Remove(h);
      --h->freq;
      main_.PushHead(h);
      continue;
    }
    if (!candidates.Evictable(*h)) {
      Park(h, main_, kParkedMain);
      continue;
    }
    main_.Remove(h);
    return h;
  }
}

EvictionHook* AdaptivePolicy::PickVictim(const EvictionCandidates& candidates) {
  EvictionHook* victim = nullptr;
  uint8_t payload = 0;
  if (Draw() < mru_weight_) {
    victim = NewestEvictable(candidates);
    if (victim != nullptr) payload = kByMru | (victim->queue == kSmall ? kFromSmall : 0);
  }
  if (victim == nullptr) {
    bool from_small = false;
    victim = QueuesVictim(candidates, &from_small);
    if (victim == nullptr) return nullptr;
    payload = from_small ? kFromSmall : 0;
  }
  victim->queue = 0;
  victim->freq = 0;
  ghost_.Add(candidates.Fingerprint(*victim), payload, peak_tracked_);
  return victim;
}

absl::Status AdaptivePolicy::CheckConsistency() const {
  if (absl::Status s = small_.Check(kSmall, "adaptive small"); !s.ok()) return s;
  if (absl::Status s = main_.Check(kMain, "adaptive main"); !s.ok()) return s;
  if (!(mru_weight_ >= kMinWeight && mru_weight_ <= 1.0 - kMinWeight)) {
    return absl::InternalError(absl::StrCat("adaptive: MRU weight ", mru_weight_, " out of range"));
  }
  return ghost_.Check();
}

}  // namespace kvcellar::core
