// The file tier's layout: where an object lives under the root, how a write's temp file is named,
// and how the names found in a directory read back into objects (the startup scan).
//
//   <root>/<ns>/<kk>/<key>.<shard>                           an object (storage/object_format.h)
//   <root>/<ns>/<kk>/<key>.<shard>.tmp-<host>-<pid>-<seq>    being written
//
// <ns> is the namespace tag (storage/object_name.h: 16 hex characters), <key> the page key in hex
// (64), <kk> its first two characters: 256 leaf directories per namespace keep directories small.
// The temp file sits in the object's own directory, so the rename that publishes it is atomic and
// cheap on every file system (storage/file_backend.h "Writes"); its name says which writer made it
// so a restarted daemon removes only the temps whose writer is gone.
//
// All paths are relative to the root, NUL-terminated, and fit in kMaxRelPath.
//
// Threads: pure functions, any thread.
#ifndef KVCELLAR_STORAGE_FILE_LAYOUT_H_
#define KVCELLAR_STORAGE_FILE_LAYOUT_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "core/page_key.h"
#include "storage/object_format.h"

namespace kvcellar::storage {

// "<ns16>/<kk>/<key64>.<shard>" is at most 95 characters; the temp suffix adds
// ".tmp-" + host (at most kMaxHostChars) + "-<pid>-<seq>" (at most 32).
inline constexpr size_t kMaxHostChars = 64;
inline constexpr size_t kMaxRelPath = 256;
inline constexpr char kTempMarker[] = ".tmp-";

// An object of the file tier: the directory's namespace tag (as the 8 bytes it is), the page key,
// the shard. What the object index and the eviction know an object by.
struct FileObjectId {
  uint64_t ns_prefix = 0;
  core::PageKey key;
  uint32_t shard = 0;

  friend bool operator==(const FileObjectId& a, const FileObjectId& b) {
    return a.ns_prefix == b.ns_prefix && a.shard == b.shard && a.key == b.key;
  }
  template <typename H>
  friend H AbslHashValue(H h, const FileObjectId& k) {
    return H::combine(std::move(h), k.key, k.ns_prefix, k.shard);
  }
};

// The namespace tag of `ns` as FileObjectId::ns_prefix holds it.
uint64_t NamespacePrefix(const core::PageKey& ns);

// Disk footprint of a file of `file_bytes`: whole blocks.
inline uint64_t RoundUpToBlock(uint64_t file_bytes) {
  return (file_bytes + kFileHeaderBlockBytes - 1) / kFileHeaderBlockBytes * kFileHeaderBlockBytes;
}
// Disk footprint of an object: the header block plus the payload in whole blocks.
inline uint64_t FileFootprint(uint64_t payload) {
  return kFileHeaderBlockBytes + RoundUpToBlock(payload);
}

// "<ns16>/<kk>" into out; returns the end. The namespace directory is its first 16 characters.
char* FormatLeafDir(uint64_t ns_prefix, const core::PageKey& key, char* out);
// "<ns16>/<kk>/<key64>.<shard>" into out; returns the end.
char* FormatObjectPath(uint64_t ns_prefix, const core::PageKey& key, uint32_t shard, char* out);
// "<object path>.tmp-<host>-<pid>-<seq>" into out (kMaxRelPath bytes).
void FormatTempPath(const char* object_path, const std::string& host_id, pid_t pid, uint64_t seq,
                    char* out);
// The host part of temp names: `host` with '/' and NUL replaced, at most kMaxHostChars.
std::string TempHostId(absl::string_view host);

// Names the startup scan reads back. A namespace directory: 16 hex characters.
bool ParseNamespaceDir(absl::string_view name, uint64_t* ns_prefix);
// A leaf directory: 2 hex characters.
bool IsLeafDir(absl::string_view name);
// Whether a leaf entry may be an object or a temp ("<key64>." and more); others are not ours.
inline bool MayBeObjectFile(absl::string_view name) { return name.size() >= 66 && name[64] == '.'; }
// The "<host>-<pid>-<seq>" after the temp marker, or false when `name` is not a temp.
bool TempSuffix(absl::string_view name, absl::string_view* suffix);
// Splits a temp suffix into its writer's host and pid; false when it is not one of ours.
bool ParseTempWriter(absl::string_view suffix, absl::string_view* host, uint32_t* pid);
// "<key64>.<shard>" (a name MayBeObjectFile accepted) into key and shard.
bool ParseObjectFile(absl::string_view name, core::PageKey* key, uint32_t* shard);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_LAYOUT_H_
