#include "core/s3fifo_queues.h"

#include "absl/strings/str_cat.h"

namespace kvcellar::core {

void S3FifoQueues::Insert(EvictionHook* hook, bool to_main) {
  hook->queue = to_main ? kMain : kSmall;
  (to_main ? main_ : small_).PushHead(hook);
}

HookList* S3FifoQueues::QueueOf(const EvictionHook& hook) {
  if (hook.queue == kSmall) return &small_;
  if (hook.queue == kMain) return &main_;
  return nullptr;
}

void S3FifoQueues::OnEligible(EvictionHook* hook) {
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

void S3FifoQueues::OnRemove(EvictionHook* hook) {
  if (HookList* q = QueueOf(*hook); q != nullptr) {
    q->Remove(hook);
  } else if (Parked(*hook)) {
    --parked_;
  }
  hook->queue = 0;
  hook->freq = 0;
}

void S3FifoQueues::Park(EvictionHook* h, HookList& from, uint8_t parked_queue) {
  from.Remove(h);
  h->queue = parked_queue;
  ++parked_;
}

EvictionHook* S3FifoQueues::Victim(const EvictionCandidates& candidates, bool* from_small) {
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

absl::Status S3FifoQueues::Check(absl::string_view name) const {
  if (absl::Status s = small_.Check(kSmall, absl::StrCat(name, " small")); !s.ok()) return s;
  if (absl::Status s = main_.Check(kMain, absl::StrCat(name, " main")); !s.ok()) return s;
  for (const HookList* q : {&small_, &main_}) {
    for (const EvictionHook* h = q->head(); h != nullptr; h = h->next) {
      if (h->freq > kMaxFreq) return absl::InternalError(absl::StrCat(name, ": freq above cap"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcellar::core
