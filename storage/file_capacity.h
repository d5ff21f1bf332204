// FileCapacity: the file tier's capacity accounting. It keeps the object index
// (storage/file_object_index.h) and the bytes the tier holds against `capacity_bytes`: the
// footprint of every indexed object, plus what writes in flight have reserved. A write reserves
// its footprint before it starts; when that would exceed the capacity the coldest objects are
// evicted (the caller unlinks the victims). The reservation becomes the object's footprint when
// the write lands, or is given back when it fails.
//
// It also knows whether the index is complete, i.e. authoritative for misses: only once the
// startup scan (storage/file_startup_scan.h) has been merged, and never when the root is shared
// (other nodes add objects the index never hears of). While the scan runs, objects removed are
// remembered, so that merging the scan does not re-add what it listed before they went.
//
// Threads: no lock of its own; the file backend's mutex guards it (every method is called with
// that mutex held). Evictions are counted into the backend's StatsCounters (atomics).
#ifndef KVCELLAR_STORAGE_FILE_CAPACITY_H_
#define KVCELLAR_STORAGE_FILE_CAPACITY_H_

#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "storage/backend.h"
#include "storage/file_layout.h"
#include "storage/file_object_index.h"

namespace kvcellar::storage {

// Objects evicted to make room; the caller unlinks them (without the lock).
using FileVictims = absl::InlinedVector<FileObjectId, 8>;

class FileCapacity {
 public:
  // capacity_bytes: 0 = no limit. shared: other daemons use the root too.
  FileCapacity(uint64_t capacity_bytes, bool shared, StatsCounters* stats)
      : capacity_bytes_(capacity_bytes), shared_(shared), stats_(stats) {}

  // A key missing from the index is absent: the scan has been merged and nobody else writes here.
  bool Authoritative() const { return !shared_ && complete_; }
  bool Knows(const FileObjectId& id) const { return index_.Contains(id); }

  // Reserves `bytes` for a write, evicting the coldest objects into `victims` until it fits.
  // False, with nothing reserved: larger than the capacity, or everything left is being written.
  bool Reserve(uint64_t bytes, FileVictims* victims);
  // Gives back a reservation whose write did not land.
  void Unreserve(uint64_t bytes) { reserved_bytes_ -= bytes; }
  // A write landed: its reservation becomes the object's footprint, at the hot end.
  void Written(const FileObjectId& id, uint64_t reserved);
  // A read found the object whole. In an authoritative index it moves to the hot end (absent
  // means evicted or deleted while it was read: it stays out); otherwise the index learns it
  // (written by another node, or not scanned yet), evicting as the capacity requires.
  void Read(const FileObjectId& id, uint64_t footprint, FileVictims* victims);
  // The object is gone: deleted, found missing, or found corrupt and removed.
  void Forget(const FileObjectId& id);

  // Merging the startup scan: an object it found enters at the cold end (call newest first, so
  // the oldest ends up coldest), unless this process wrote it since (it is known) or removed it.
  // True when it was indexed.
  bool AddScanned(const FileObjectId& id, uint64_t footprint);
  // The scan is merged: the index is complete; evicts what the capacity does not hold.
  void CompleteScan(FileVictims* victims);

  bool complete() const { return complete_; }
  uint64_t used_bytes() const { return used_bytes_; }
  size_t objects() const { return index_.size(); }

 private:
  void EvictOverCapacity(FileVictims* victims);
  void Evicted(const FileObjectId& id, uint64_t bytes, FileVictims* victims);
  void NoteRemoved(const FileObjectId& id);

  const uint64_t capacity_bytes_;
  const bool shared_;
  StatsCounters* const stats_;
  FileObjectIndex index_;
  uint64_t used_bytes_ = 0;
  uint64_t reserved_bytes_ = 0;
  bool complete_ = false;
  absl::flat_hash_set<FileObjectId> removed_during_scan_;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_CAPACITY_H_
