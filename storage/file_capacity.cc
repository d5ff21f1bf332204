#include "storage/file_capacity.h"

#include <atomic>
#include <optional>

namespace kvcellar::storage {

bool FileCapacity::Reserve(uint64_t bytes, FileVictims* victims) {
  const uint64_t cap = capacity_bytes_;
  if (cap != 0) {
    if (bytes > cap) return false;
    while (used_bytes_ + reserved_bytes_ + bytes > cap) {
      FileObjectId id;
      uint64_t b;
      // Everything left is being written: the tier is full of in-flight writes.
      if (!index_.PopColdest(&id, &b)) return false;
      Evicted(id, b, victims);
    }
  }
  reserved_bytes_ += bytes;
  return true;
}

void FileCapacity::Written(const FileObjectId& id, uint64_t reserved) {
  const uint64_t old = index_.UpsertHot(id, reserved);
  reserved_bytes_ -= reserved;
  used_bytes_ += reserved;
  used_bytes_ -= old;
  removed_during_scan_.erase(id);
}

void FileCapacity::Read(const FileObjectId& id, uint64_t footprint, FileVictims* victims) {
  if (Authoritative()) {
    index_.Touch(id);
    return;
  }
  const uint64_t old = index_.UpsertHot(id, footprint);
  used_bytes_ += footprint;
  used_bytes_ -= old;
  EvictOverCapacity(victims);
}

void FileCapacity::Forget(const FileObjectId& id) {
  if (std::optional<uint64_t> bytes = index_.Remove(id)) used_bytes_ -= *bytes;
  NoteRemoved(id);
}

bool FileCapacity::AddScanned(const FileObjectId& id, uint64_t footprint) {
  if (removed_during_scan_.contains(id)) return false;
  if (!index_.InsertCold(id, footprint)) return false;
  used_bytes_ += footprint;
  return true;
}

void FileCapacity::CompleteScan(FileVictims* victims) {
  complete_ = true;
  removed_during_scan_.clear();
  EvictOverCapacity(victims);
}

void FileCapacity::EvictOverCapacity(FileVictims* victims) {
  const uint64_t cap = capacity_bytes_;
  if (cap == 0) return;
  while (used_bytes_ + reserved_bytes_ > cap) {
    FileObjectId id;
    uint64_t b;
    if (!index_.PopColdest(&id, &b)) return;
    Evicted(id, b, victims);
  }
}

void FileCapacity::Evicted(const FileObjectId& id, uint64_t bytes, FileVictims* victims) {
  used_bytes_ -= bytes;
  NoteRemoved(id);
  victims->push_back(id);
  stats_->evicted_objects.fetch_add(1, std::memory_order_relaxed);
  stats_->evicted_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void FileCapacity::NoteRemoved(const FileObjectId& id) {
  if (!complete_) removed_during_scan_.insert(id);
}

}  // namespace kvcellar::storage
