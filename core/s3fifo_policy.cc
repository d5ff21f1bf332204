#include "core/s3fifo_policy.h"

#include <algorithm>

namespace kvcellar::core {

void S3FifoPolicy::OnInsert(EvictionHook* hook, uint64_t fingerprint) {
  hook->freq = 0;
  hook->flags = 0;
  if (ghost_.Take(fingerprint).has_value()) {
    hook->queue = kMain;
    main_.PushHead(hook);
  } else {
    hook->queue = kSmall;
    small_.PushHead(hook);
  }
  peak_tracked_ = std::max(peak_tracked_, Tracked());
}

void S3FifoPolicy::OnAccess(EvictionHook* hook) {
  if (hook->freq < kMaxFreq) ++hook->freq;
}

void S3FifoPolicy::OnEligible(EvictionHook* hook) {
  // A parked page was its queue's eviction candidate: it goes back to that tail, where its
  // frequency (hits while parked included) decides as usual.
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

void S3FifoPolicy::OnRemove(EvictionHook* hook) {
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

void S3FifoPolicy::Park(EvictionHook* h, HookList& from, uint8_t parked_queue) {
  from.Remove(h);
  h->queue = parked_queue;
  ++parked_;
}

EvictionHook* S3FifoPolicy::PickVictim(const EvictionCandidates& candidates) {
  // Each iteration moves a page S->M (once per insertion), spends one hit of a page in M, parks
  // a page, or returns: the loop is bounded by insertions + hits + parks.
  for (;;) {
    const size_t queued = small_.size() + main_.size();
    const bool from_small =
        !small_.empty() && (main_.empty() || small_.size() * 100 >= queued * kSmallPercent);
    if (from_small) {
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
      h->queue = 0;
      h->freq = 0;
      ghost_.Add(candidates.Fingerprint(*h), 0,
                 std::max<size_t>(1, peak_tracked_ * kGhostPercent / 100));
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
    h->queue = 0;
    return h;
  }
}

size_t S3FifoPolicy::MemoryBytes() const { return ghost_.MemoryBytes(); }

absl::Status S3FifoPolicy::CheckConsistency() const {
  if (absl::Status s = small_.Check(kSmall, "s3fifo small"); !s.ok()) return s;
  if (absl::Status s = main_.Check(kMain, "s3fifo main"); !s.ok()) return s;
  for (const EvictionHook* h = small_.head(); h != nullptr; h = h->next) {
    if (h->freq > kMaxFreq) return absl::InternalError("s3fifo: freq above cap");
  }
  for (const EvictionHook* h = main_.head(); h != nullptr; h = h->next) {
    if (h->freq > kMaxFreq) return absl::InternalError("s3fifo: freq above cap");
  }
  return ghost_.Check();
}

}  // namespace kvcellar::core
