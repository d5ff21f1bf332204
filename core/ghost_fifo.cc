#include "core/ghost_fifo.h"

#include <algorithm>

#include "core/splitmix.h"

namespace kvcellar::core {
namespace {

// The bucket (low bits) and the tag (high bits) must be independent even when fingerprints are
// not uniform (opaque engine keys, small integers in tests).
uint64_t Mix(uint64_t x) { return SplitMix64(x); }

// The fingerprint part of an entry: never 0, so 0 marks an empty entry.
uint32_t Tag(uint64_t mixed) {
  const auto tag = static_cast<uint32_t>(mixed >> 32);
  return tag != 0 ? tag : 1;
}

}  // namespace

uint64_t* GhostFifo::Bucket(uint64_t mixed) {
  const size_t buckets = table_.size() / kBucket;
  return table_.data() + (mixed & (buckets - 1)) * kBucket;
}

uint32_t GhostFifo::Age(uint64_t entry) const {
  return (seq_ - static_cast<uint32_t>(entry)) & kSeqMask;
}

void GhostFifo::Resize(size_t capacity) {
  // Twice the entries the FIFO holds, so buckets rarely overflow; a power of two of buckets.
  size_t buckets = 1;
  while (buckets * kBucket < 2 * capacity) buckets *= 2;
  capacity_ = capacity;
  if (buckets * kBucket <= table_.size()) return;
  // The entries cannot be rebucketed (they keep only the high half of their fingerprint), so a
  // growing table starts empty. It grows only while the peak page count doubles, i.e. warm-up.
  table_.assign(buckets * kBucket, 0);
  live_ = 0;
}

void GhostFifo::Add(uint64_t fingerprint, uint8_t payload, size_t capacity) {
  capacity = std::max<size_t>(1, capacity);
  if (capacity > capacity_) Resize(capacity);
  const uint32_t seq = seq_;
  seq_ = (seq_ + 1) & kSeqMask;
  const uint64_t mixed = Mix(fingerprint);
  const uint32_t tag = Tag(mixed);
  uint64_t* bucket = Bucket(mixed);
  // Reuse this fingerprint's entry, else an empty or expired one, else the oldest.
  size_t victim = 0;
  uint32_t victim_age = 0;
  for (size_t i = 0; i < kBucket; ++i) {
    const uint64_t e = bucket[i];
    if (e != 0 && static_cast<uint32_t>(e >> 32) == tag) {
      victim = i;
      break;
    }
    const uint32_t age = e == 0 ? UINT32_MAX : Age(e);
    if (age >= victim_age) {
      victim = i;
      victim_age = age;
    }
  }
  live_ += bucket[victim] == 0;
  bucket[victim] = uint64_t{tag} << 32 | uint64_t{payload & 3u} << 30 | seq;
}

std::optional<GhostFifo::Taken> GhostFifo::Take(uint64_t fingerprint) {
  if (table_.empty()) return std::nullopt;
  const uint64_t mixed = Mix(fingerprint);
  const uint32_t tag = Tag(mixed);
  uint64_t* bucket = Bucket(mixed);
  for (size_t i = 0; i < kBucket; ++i) {
    const uint64_t e = bucket[i];
    if (e == 0 || static_cast<uint32_t>(e >> 32) != tag) continue;
    bucket[i] = 0;
    --live_;
    // In the FIFO while fewer than capacity_ adds came after it (the last add has age 1).
    const uint32_t age = Age(e);
    if (age > capacity_) return std::nullopt;
    return Taken{static_cast<uint8_t>(e >> 30 & 3u), age - 1};
  }
  return std::nullopt;
}

size_t GhostFifo::Size() const {
  size_t n = 0;
  for (uint64_t e : table_) n += e != 0 && Age(e) <= capacity_;
  return n;
}

absl::Status GhostFifo::Check() const {
  size_t live = 0;
  for (uint64_t e : table_) live += e != 0;
  if (live != live_) return absl::InternalError("ghost: entry count is wrong");
  return absl::OkStatus();
}

}  // namespace kvcellar::core
