// FileObjectIndex: the objects the file tier knows, with their disk footprint, in recency order
// (hot end = most recently written or read, cold end = the next to evict).
//
// It answers "is this object here?" without a system call once it is complete
// (storage/file_capacity.h), and gives the eviction its order. Entries live in a slab linked by
// index, so inserting, touching and evicting allocate nothing once the slab and the map have grown
// to the working set.
//
// Threads: none of its own and no lock; its owner's mutex guards it (storage/file_capacity.h).
#ifndef KVCELLAR_STORAGE_FILE_OBJECT_INDEX_H_
#define KVCELLAR_STORAGE_FILE_OBJECT_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "storage/file_layout.h"

namespace kvcellar::storage {

class FileObjectIndex {
 public:
  size_t size() const { return map_.size(); }
  bool Contains(const FileObjectId& id) const { return map_.contains(id); }

  // Inserts at the hot end or moves there; returns the footprint it replaced (0 when new).
  uint64_t UpsertHot(const FileObjectId& id, uint64_t bytes);
  // Inserts at the cold end; false (nothing changed) when present.
  bool InsertCold(const FileObjectId& id, uint64_t bytes);
  // Moves a known object to the hot end; nothing when absent.
  void Touch(const FileObjectId& id);
  // The footprint removed, or nullopt when absent.
  std::optional<uint64_t> Remove(const FileObjectId& id);
  // Removes the coldest object; false when the index is empty.
  bool PopColdest(FileObjectId* id, uint64_t* bytes);

 private:
  static constexpr uint32_t kNil = UINT32_MAX;

  struct Entry {
    FileObjectId id;
    uint64_t bytes = 0;
    uint32_t hotter = kNil;
    uint32_t colder = kNil;
  };

  uint32_t NewEntry(const FileObjectId& id, uint64_t bytes);
  void Unlink(uint32_t e);
  void LinkHot(uint32_t e);
  void LinkCold(uint32_t e);

  absl::flat_hash_map<FileObjectId, uint32_t> map_;
  std::vector<Entry> slab_;
  std::vector<uint32_t> free_;
  uint32_t hot_ = kNil;
  uint32_t cold_ = kNil;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_OBJECT_INDEX_H_
