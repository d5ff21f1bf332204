#include "core/s3fifo_policy.h"

#include <algorithm>

namespace kvcellar::core {

void S3FifoPolicy::OnInsert(EvictionHook* hook, uint64_t fingerprint) {
  hook->freq = 0;
  hook->flags = 0;
  if (GhostTake(fingerprint)) {
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
      GhostAdd(candidates.Fingerprint(*h));
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

namespace {

// SplitMix64's finalizer: the bucket (low bits) and the tag (high bits) must be independent
// even when fingerprints are not uniform (opaque engine keys, small integers in tests).
uint64_t Mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The fingerprint part of a ghost entry: never 0, so 0 marks an empty entry.
uint32_t GhostTag(uint64_t mixed) {
  const auto tag = static_cast<uint32_t>(mixed >> 32);
  return tag != 0 ? tag : 1;
}

}  // namespace

uint64_t* S3FifoPolicy::GhostBucket(uint64_t mixed) {
  const size_t buckets = ghost_.size() / kGhostBucket;
  return ghost_.data() + (mixed & (buckets - 1)) * kGhostBucket;
}

void S3FifoPolicy::GhostResize(size_t capacity) {
  // Twice the entries the FIFO holds, so buckets rarely overflow; a power of two of buckets.
  size_t buckets = 1;
  while (buckets * kGhostBucket < 2 * capacity) buckets *= 2;
  ghost_capacity_ = capacity;
  if (buckets * kGhostBucket <= ghost_.size()) return;
  // The entries cannot be rebucketed (they keep only the high half of their fingerprint), so a
  // growing table starts empty. It grows only while the peak page count doubles, i.e. warm-up.
  ghost_.assign(buckets * kGhostBucket, 0);
  ghost_live_ = 0;
}

void S3FifoPolicy::GhostAdd(uint64_t fingerprint) {
  const size_t capacity = std::max<size_t>(1, peak_tracked_ * kGhostPercent / 100);
  if (capacity > ghost_capacity_) GhostResize(capacity);
  const uint32_t seq = ghost_seq_++;
  const uint64_t mixed = Mix(fingerprint);
  const uint32_t tag = GhostTag(mixed);
  uint64_t* bucket = GhostBucket(mixed);
  // Reuse this fingerprint's entry, else an empty or expired one, else the oldest.
  size_t victim = 0;
  uint32_t victim_age = 0;
  for (size_t i = 0; i < kGhostBucket; ++i) {
    const uint64_t e = bucket[i];
    if (e != 0 && static_cast<uint32_t>(e >> 32) == tag) {
      victim = i;
      break;
    }
    const uint32_t age = e == 0 ? UINT32_MAX : seq - static_cast<uint32_t>(e);
    if (age >= victim_age) {
      victim = i;
      victim_age = age;
    }
  }
  ghost_live_ += bucket[victim] == 0;
  bucket[victim] = uint64_t{tag} << 32 | seq;
}

bool S3FifoPolicy::GhostTake(uint64_t fingerprint) {
  if (ghost_.empty()) return false;
  const uint64_t mixed = Mix(fingerprint);
  const uint32_t tag = GhostTag(mixed);
  uint64_t* bucket = GhostBucket(mixed);
  for (size_t i = 0; i < kGhostBucket; ++i) {
    const uint64_t e = bucket[i];
    if (e == 0 || static_cast<uint32_t>(e >> 32) != tag) continue;
    bucket[i] = 0;
    --ghost_live_;
    // In the FIFO while fewer than ghost_capacity_ evictions came after it.
    return static_cast<uint32_t>(ghost_seq_ - static_cast<uint32_t>(e)) <= ghost_capacity_;
  }
  return false;
}

size_t S3FifoPolicy::ghost_size() const {
  size_t n = 0;
  for (uint64_t e : ghost_) {
    n += e != 0 && static_cast<uint32_t>(ghost_seq_ - static_cast<uint32_t>(e)) <= ghost_capacity_;
  }
  return n;
}

size_t S3FifoPolicy::MemoryBytes() const { return ghost_.capacity() * sizeof(uint64_t); }

absl::Status S3FifoPolicy::CheckConsistency() const {
  if (absl::Status s = small_.Check(kSmall, "s3fifo small"); !s.ok()) return s;
  if (absl::Status s = main_.Check(kMain, "s3fifo main"); !s.ok()) return s;
  for (const EvictionHook* h = small_.head(); h != nullptr; h = h->next) {
    if (h->freq > kMaxFreq) return absl::InternalError("s3fifo: freq above cap");
  }
  for (const EvictionHook* h = main_.head(); h != nullptr; h = h->next) {
    if (h->freq > kMaxFreq) return absl::InternalError("s3fifo: freq above cap");
  }
  size_t live = 0;
  for (uint64_t e : ghost_) live += e != 0;
  if (live != ghost_live_) return absl::InternalError("s3fifo: ghost entry count is wrong");
  return absl::OkStatus();
}

}  // namespace kvcellar::core
