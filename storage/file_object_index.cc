#include "storage/file_object_index.h"

namespace kvcellar::storage {

uint64_t FileObjectIndex::UpsertHot(const FileObjectId& id, uint64_t bytes) {
  auto [it, inserted] = map_.try_emplace(id, kNil);
  uint64_t old = 0;
  if (inserted) {
    it->second = NewEntry(id, bytes);
  } else {
    old = slab_[it->second].bytes;
    slab_[it->second].bytes = bytes;
    Unlink(it->second);
  }
  LinkHot(it->second);
  return old;
}

bool FileObjectIndex::InsertCold(const FileObjectId& id, uint64_t bytes) {
  auto [it, inserted] = map_.try_emplace(id, kNil);
  if (!inserted) return false;
  it->second = NewEntry(id, bytes);
  LinkCold(it->second);
  return true;
}

void FileObjectIndex::Touch(const FileObjectId& id) {
  auto it = map_.find(id);
  if (it == map_.end()) return;
  Unlink(it->second);
  LinkHot(it->second);
}

std::optional<uint64_t> FileObjectIndex::Remove(const FileObjectId& id) {
  auto it = map_.find(id);
  if (it == map_.end()) return std::nullopt;
  uint32_t e = it->second;
  map_.erase(it);
  uint64_t bytes = slab_[e].bytes;
  Unlink(e);
  free_.push_back(e);
  return bytes;
}

bool FileObjectIndex::PopColdest(FileObjectId* id, uint64_t* bytes) {
  if (cold_ == kNil) return false;
  *id = slab_[cold_].id;
  *bytes = *Remove(*id);
  return true;
}

uint32_t FileObjectIndex::NewEntry(const FileObjectId& id, uint64_t bytes) {
  uint32_t e;
  if (!free_.empty()) {
    e = free_.back();
    free_.pop_back();
  } else {
    e = static_cast<uint32_t>(slab_.size());
    slab_.emplace_back();
  }
  slab_[e] = Entry{id, bytes, kNil, kNil};
  return e;
}

void FileObjectIndex::Unlink(uint32_t e) {
  Entry& x = slab_[e];
  if (x.hotter != kNil) slab_[x.hotter].colder = x.colder; else hot_ = x.colder;
  if (x.colder != kNil) slab_[x.colder].hotter = x.hotter; else cold_ = x.hotter;
  x.hotter = x.colder = kNil;
}

void FileObjectIndex::LinkHot(uint32_t e) {
  slab_[e].colder = hot_;
  slab_[e].hotter = kNil;
  if (hot_ != kNil) slab_[hot_].hotter = e; else cold_ = e;
  hot_ = e;
}

void FileObjectIndex::LinkCold(uint32_t e) {
  slab_[e].hotter = cold_;
  slab_[e].colder = kNil;
  if (cold_ != kNil) slab_[cold_].colder = e; else hot_ = e;
  cold_ = e;
}

}  // namespace kvcellar::storage
