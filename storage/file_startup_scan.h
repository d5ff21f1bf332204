// FileStartupScan: rebuilds what the file tier holds after a restart by listing its directories
// (storage/file_layout.h) and reading each object's header (storage/object_format.h), so that
// the daemon can put the pages back in its index under their parents (server/l3/l3_recovery.h).
// Each object found is named with its footprint, modification time, namespace digest, parent link
// and payload size; the backend merges them into its own index, oldest coldest
// (storage/file_capacity.h), since every one predates this process's writes.
//
// What is dropped on the way (unlinked and counted, never indexed, never served): an object whose
// header does not decode (torn or short file, bad magic, an unknown version, a damaged header),
// that names another object than its file name says (key, shard, namespace tag), or whose length
// is not header block + payload size (torn, or bytes appended). Temp files whose writer is gone
// are removed too: same host and no such pid, or older than `stale_temp_age` whoever wrote them
// (a node that never came back). The payload's CRC is not checked here: that would read the whole
// tier at every start (a 10 TB tier at 3 GB/s is an hour). Every read still checks it before a
// byte is served (file_object_io.h), so a damaged payload is a miss and is removed then.
//
// The scan resumes where it stopped: the backend runs it within a time budget inside Open and
// finishes it on a background thread (storage/file_backend.h "Index and capacity").
//
// Threads: one at a time (Open's, then the scanner thread's); `stop` may be set from any thread.
#ifndef KVCELLAR_STORAGE_FILE_STARTUP_SCAN_H_
#define KVCELLAR_STORAGE_FILE_STARTUP_SCAN_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/page_key.h"
#include "storage/file_layout.h"
#include "storage/object_format.h"

namespace kvcellar::storage {

class FileStartupScan {
 public:
  struct Found {
    FileObjectId id;
    uint64_t bytes;  // The file's footprint (storage/file_layout.h RoundUpToBlock).
    int64_t mtime_ns;
    uint32_t ns = 0;             // Index into namespaces(): the full digest from the header.
    uint16_t version = 0;        // The object's format version (1: no parent link).
    ParentLink parent;           // From the header.
    uint64_t payload_bytes = 0;  // From the header.
  };

  // root_fd: the tier's root, open for the scan's lifetime. host_id and pid name this writer in
  // temp names (storage/file_layout.h); `stop` ends the scan early (ScanUntil returns false).
  FileStartupScan(int root_fd, std::string host_id, pid_t pid, absl::Duration stale_temp_age,
                  const std::atomic<bool>* stop)
      : root_fd_(root_fd),
        host_id_(std::move(host_id)),
        pid_(pid),
        stale_temp_age_(stale_temp_age),
        stop_(stop) {}

  // Lists directories until the whole tree has been read (true), or `until` has passed or stop is
  // set (false: call again to go on). Unreadable directories are skipped.
  bool ScanUntil(absl::Time until);
  // What the scan found, newest first; the scan forgets it.
  std::vector<Found> TakeFoundNewestFirst();

  // The namespace digests the objects found name (Found::ns indexes it): one per namespace
  // directory, more only on a tag collision.
  const std::vector<core::PageKey>& namespaces() const { return namespaces_; }

  uint64_t temps_removed() const { return temps_removed_; }
  // Leaf entries with an object's or temp's name looked at so far.
  uint64_t entries_seen() const { return entries_seen_; }
  // Objects with a good header, so far (kept).
  uint64_t objects_found() const { return objects_found_; }
  // Of those, version 1 objects: no parent link.
  uint64_t objects_legacy() const { return objects_legacy_; }
  // Objects of a later format version (a newer daemon's): neither indexed nor removed.
  uint64_t objects_newer() const { return objects_newer_; }
  // Torn or foreign objects unlinked (or found unlinkable), so far.
  uint64_t objects_dropped() const { return objects_dropped_; }
  // Payload bytes of the objects found.
  uint64_t payload_bytes() const { return payload_bytes_; }

  // Whether the temp whose suffix is `suffix` ("<host>-<pid>-<seq>") and whose file was modified
  // at mtime_ns has no live writer: too old, or this host's and its pid is gone (never our own).
  bool IsStaleTemp(absl::string_view suffix, int64_t mtime_ns) const;

 private:
  struct NamespaceDir {
    std::string name;
    uint64_t ns_prefix;
  };

  void ListRoot();
  // Lists the leaf directories of the next namespace directory into leaves_.
  void ListNamespace(const NamespaceDir& ns);
  void ScanLeaf(const NamespaceDir& ns, const std::string& leaf);
  // Reads and checks the header of the object file `name` in the leaf open at dfd; kNone and
  // *found filled (but id) when it is good, else why it is not.
  ObjectDefect ReadHeader(int dfd, const char* name, const FileObjectId& id, Found* found,
                          ino_t* ino);
  // Unlinks a defective object, unless the name now holds another file (a write that replaced it
  // since the scan opened it).
  void Drop(int dfd, const char* name, ino_t ino, const std::string& rel, ObjectDefect defect);
  uint32_t NamespaceSlot(const core::PageKey& digest);

  const int root_fd_;
  const std::string host_id_;
  const pid_t pid_;
  const absl::Duration stale_temp_age_;
  const std::atomic<bool>* const stop_;

  bool listed_root_ = false;
  std::vector<NamespaceDir> ns_dirs_;
  size_t ns_next_ = 0;
  std::vector<std::string> leaves_;  // Leaf directories of ns_dirs_[ns_next_ - 1] not yet read.
  std::vector<Found> found_;
  std::vector<core::PageKey> namespaces_;
  uint64_t temps_removed_ = 0;
  uint64_t entries_seen_ = 0;
  uint64_t objects_found_ = 0;
  uint64_t objects_legacy_ = 0;
  uint64_t objects_newer_ = 0;
  uint64_t objects_dropped_ = 0;
  uint64_t payload_bytes_ = 0;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_STARTUP_SCAN_H_
