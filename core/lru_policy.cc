#include "core/lru_policy.h"

namespace kvcellar::core {

void LruPolicy::OnInsert(EvictionHook* hook, uint64_t /*fingerprint*/) {
  hook->queue = kList;
  hook->flags = 0;
  hook->freq = 0;
  list_.PushHead(hook);
}

void LruPolicy::OnAccess(EvictionHook* hook) {
  if (hook->queue == kList) {
    if (list_.head() != hook) {
      list_.Remove(hook);
      list_.PushHead(hook);
    }
  } else if (hook->queue == kParked) {
    hook->flags |= kTouched;
  }
}

void LruPolicy::OnEligible(EvictionHook* hook) {
  if (hook->queue != kParked) return;
  --parked_;
  hook->queue = kList;
  // Untouched since it was parked at the tail, it is still the coldest page: back to the tail.
  if (hook->flags & kTouched) {
    list_.PushHead(hook);
  } else {
    list_.PushTail(hook);
  }
  hook->flags = 0;
}

void LruPolicy::OnRemove(EvictionHook* hook) {
  if (hook->queue == kList) {
    list_.Remove(hook);
  } else if (hook->queue == kParked) {
    --parked_;
  }
  hook->queue = 0;
  hook->flags = 0;
}

EvictionHook* LruPolicy::PickVictim(const EvictionCandidates& candidates) {
  while (EvictionHook* h = list_.tail()) {
    list_.Remove(h);
    if (candidates.Evictable(*h)) {
      h->queue = 0;
      return h;
    }
    h->queue = kParked;
    h->flags = 0;
    ++parked_;
  }
  return nullptr;
}

absl::Status LruPolicy::CheckConsistency() const { return list_.Check(kList, "lru list"); }

}  // namespace kvcellar::core
