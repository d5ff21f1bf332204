// FileStartupScan: rebuilds what the file tier holds after a restart by listing its directories
// (storage/file_layout.h), without reading a single object. Each object file found is named with
// its footprint and modification time; the backend merges them into its index, oldest coldest
// (storage/file_capacity.h), since every one predates this process's writes. Temp files whose
// writer is gone are removed on the way: same host and no such pid, or older than
// `stale_temp_age` whoever wrote them (a node that never came back).
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
#include "storage/file_layout.h"

namespace kvcellar::storage {

class FileStartupScan {
 public:
  struct Found {
    FileObjectId id;
    uint64_t bytes;  // The file's footprint (storage/file_layout.h RoundUpToBlock).
    int64_t mtime_ns;
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

  uint64_t temps_removed() const { return temps_removed_; }
  // Leaf entries with an object's or temp's name looked at so far.
  uint64_t entries_seen() const { return entries_seen_; }

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
  uint64_t temps_removed_ = 0;
  uint64_t entries_seen_ = 0;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_STARTUP_SCAN_H_
