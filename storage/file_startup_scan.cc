#include "storage/file_startup_scan.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::storage {
namespace {

// Opens `rel` under dirfd as a directory stream; nullptr when it cannot be read.
DIR* OpenDir(int dirfd, const char* rel) {
  int fd = ::openat(dirfd, rel, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = fd >= 0 ? ::fdopendir(fd) : nullptr;
  if (d == nullptr && fd >= 0) ::close(fd);
  return d;
}

}  // namespace

bool FileStartupScan::ScanUntil(absl::Time until) {
  if (!listed_root_) ListRoot();
  for (;;) {
    if (stop_->load(std::memory_order_relaxed)) return false;
    if (leaves_.empty()) {
      if (ns_next_ == ns_dirs_.size()) return true;
      ListNamespace(ns_dirs_[ns_next_++]);
      continue;
    }
    ScanLeaf(ns_dirs_[ns_next_ - 1], leaves_.back());
    leaves_.pop_back();
    if (absl::Now() >= until) return false;
  }
}

void FileStartupScan::ListRoot() {
  if (DIR* d = OpenDir(root_fd_, ".")) {
    while (dirent* de = ::readdir(d)) {
      uint64_t ns_prefix;
      if (ParseNamespaceDir(de->d_name, &ns_prefix)) ns_dirs_.push_back({de->d_name, ns_prefix});
    }
    ::closedir(d);
  }
  listed_root_ = true;
}

void FileStartupScan::ListNamespace(const NamespaceDir& ns) {
  DIR* d = OpenDir(root_fd_, ns.name.c_str());
  if (d == nullptr) return;
  while (dirent* de = ::readdir(d)) {
    if (IsLeafDir(de->d_name)) leaves_.emplace_back(de->d_name);
  }
  ::closedir(d);
}

void FileStartupScan::ScanLeaf(const NamespaceDir& ns, const std::string& leaf) {
  const std::string rel = absl::StrCat(ns.name, "/", leaf);
  DIR* d = OpenDir(root_fd_, rel.c_str());
  if (d == nullptr) return;
  const int dfd = ::dirfd(d);
  while (dirent* de = ::readdir(d)) {
    absl::string_view n = de->d_name;
    if (!MayBeObjectFile(n)) continue;
    ++entries_seen_;
    struct stat st;
    if (::fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
      continue;
    }
    const int64_t mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
    absl::string_view temp_suffix;
    if (TempSuffix(n, &temp_suffix)) {
      if (IsStaleTemp(temp_suffix, mtime_ns) && ::unlinkat(dfd, de->d_name, 0) == 0) {
        ++temps_removed_;
      }
      continue;
    }
    Found f;
    f.id.ns_prefix = ns.ns_prefix;
    if (!ParseObjectFile(n, &f.id.key, &f.id.shard)) continue;
    f.bytes = RoundUpToBlock(static_cast<uint64_t>(st.st_size));
    f.mtime_ns = mtime_ns;
    found_.push_back(f);
  }
  ::closedir(d);
}

bool FileStartupScan::IsStaleTemp(absl::string_view suffix, int64_t mtime_ns) const {
  const int64_t age_ns = absl::GetCurrentTimeNanos() - mtime_ns;
  if (age_ns > absl::ToInt64Nanoseconds(stale_temp_age_)) return true;
  absl::string_view host;
  uint32_t pid;
  if (!ParseTempWriter(suffix, &host, &pid) || host != host_id_) {
    return false;  // Another node's writer: only age can tell it is gone.
  }
  if (static_cast<pid_t>(pid) == pid_) return false;  // Ours, maybe in flight.
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::vector<FileStartupScan::Found> FileStartupScan::TakeFoundNewestFirst() {
  std::vector<Found> found = std::move(found_);
  found_ = {};
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.mtime_ns > b.mtime_ns; });
  return found;
}

}  // namespace kvcellar::storage
