// GhostFifo: the fingerprints of the pages an eviction policy gave up most recently, with two bits
// of the policy's own about each, as a FIFO of bounded length (S3-FIFO's ghost queue; the adaptive
// policy's record of which expert evicted a page).
//
// Implemented as the S3-FIFO paper suggests: a bucketed hash table of (32-bit fingerprint tag,
// 2-bit payload, 30-bit add sequence number) entries. An entry is in the FIFO while fewer than
// capacity() adds followed it, so aging needs no queue; a full bucket drops its oldest entry (a
// ghost is a hint: losing one early costs a little hit rate, never correctness). One cache line per
// operation. An entry would have to sit in an untouched bucket through 2^30 adds to look young
// again.
//
// Threads: none of its own; its policy's (called under the owning index's mutex).
#ifndef KVCELLAR_CORE_GHOST_FIFO_H_
#define KVCELLAR_CORE_GHOST_FIFO_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"

namespace kvcellar::core {

class GhostFifo {
 public:
  struct Taken {
    uint8_t payload = 0;  // What Add recorded (0..3).
    uint32_t age = 0;     // Adds since (0: the last one).
  };

  // Records `fingerprint` (again: its entry moves to the FIFO's head) with `payload` (0..3),
  // first growing the FIFO to `capacity` entries when that is more than it holds (it never
  // shrinks: a policy passes a peak).
  void Add(uint64_t fingerprint, uint8_t payload, size_t capacity);
  // Removes `fingerprint`; its payload and age when it was still in the FIFO.
  std::optional<Taken> Take(uint64_t fingerprint);

  size_t capacity() const { return capacity_; }
  // Entries still young enough to count (O(table); for tests).
  size_t Size() const;
  size_t MemoryBytes() const { return table_.capacity() * sizeof(uint64_t); }
  // Checks the live entry count against the table. O(table), for tests.
  absl::Status Check() const;

 private:
  static constexpr size_t kBucket = 8;  // Entries per bucket: one 64-byte line.
  static constexpr uint32_t kSeqMask = (uint32_t{1} << 30) - 1;

  void Resize(size_t capacity);
  uint64_t* Bucket(uint64_t mixed);
  uint32_t Age(uint64_t entry) const;

  std::vector<uint64_t> table_;  // 0: empty; else tag << 32 | payload << 30 | sequence.
  size_t capacity_ = 0;          // Entries the FIFO holds.
  uint32_t seq_ = 1;             // Modulo 2^30.
  size_t live_ = 0;              // Entries added and neither taken nor replaced.
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_GHOST_FIFO_H_
