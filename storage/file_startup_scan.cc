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
#include "platform/log.h"

namespace kvcellar::storage {
namespace {

// Opens `rel` under dirfd as a directory stream; nullptr when it cannot be read.
DIR* OpenDir(int dirfd, const char* rel) {
  int fd = ::openat(dirfd, rel, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = fd >= 0 ? ::fdopendir(fd) : nullptr;
  if (d == nullptr && fd >= 0) ::close(fd);
  return d;
}

// Objects dropped at scan are logged one line each up to this many per scan, then only counted:
// a crash can leave many torn files, and the end-of-scan line gives the total.
constexpr uint64_t kMaxDropLogs = 16;

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
    absl::string_view temp_suffix;
    if (TempSuffix(n, &temp_suffix)) {
      struct stat st;
      if (::fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
        continue;
      }
      const int64_t mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
      if (IsStaleTemp(temp_suffix, mtime_ns) && ::unlinkat(dfd, de->d_name, 0) == 0) {
        ++temps_removed_;
      }
      continue;
    }
    Found f;
    f.id.ns_prefix = ns.ns_prefix;
    if (!ParseObjectFile(n, &f.id.key, &f.id.shard)) continue;
    ino_t ino = 0;
    const ObjectDefect defect = ReadHeader(dfd, de->d_name, f.id, &f, &ino);
    if (defect == ObjectDefect::kNone) {
      ++objects_found_;
      if (f.version == kObjectFormatVersionV1) ++objects_legacy_;
      payload_bytes_ += f.payload_bytes;
      found_.push_back(f);
    } else if (defect == ObjectDefect::kNewerVersion) {
      ++objects_newer_;  // A newer daemon's object (a downgrade, a mixed fleet): left alone.
    } else if (ino != 0) {
      Drop(dfd, de->d_name, ino, rel, defect);
    }
  }
  ::closedir(d);
}

ObjectDefect FileStartupScan::ReadHeader(int dfd, const char* name, const FileObjectId& id,
                                         Found* found, ino_t* ino) {
  // O_NONBLOCK: a FIFO planted under an object's name must not stall the scan.
  const int fd = ::openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return ObjectDefect::kTruncated;  // Gone since listed, or not ours: skipped.
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return ObjectDefect::kTruncated;  // Not a regular file: skipped, never unlinked.
  }
  *ino = st.st_ino;
  uint8_t buf[kObjectHeaderBytes];
  const ssize_t got = ::pread(fd, buf, sizeof(buf), 0);
  ::close(fd);
  ObjectHeader h;
  const ObjectDefect defect = DecodeObjectHeader(buf, got > 0 ? static_cast<size_t>(got) : 0, &h);
  if (defect != ObjectDefect::kNone) return defect;
  if (h.key != id.key) return ObjectDefect::kForeignKey;
  if (h.shard != id.shard) return ObjectDefect::kForeignShard;
  if (NamespacePrefix(h.ns) != id.ns_prefix) return ObjectDefect::kForeignNamespace;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kFileHeaderBlockBytes + h.payload_bytes) return ObjectDefect::kTruncated;
  if (size > kFileHeaderBlockBytes + h.payload_bytes) return ObjectDefect::kSizeMismatch;
  found->bytes = RoundUpToBlock(size);
  found->mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  found->ns = NamespaceSlot(h.ns);
  found->version = h.version;
  found->parent = h.parent;
  found->payload_bytes = h.payload_bytes;
  return ObjectDefect::kNone;
}

void FileStartupScan::Drop(int dfd, const char* name, ino_t ino, const std::string& rel,
                           ObjectDefect defect) {
  struct stat st;
  if (::fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_ino != ino) return;
  ::unlinkat(dfd, name, 0);
  ++objects_dropped_;
  if (objects_dropped_ <= kMaxDropLogs) {
    KVLOG(Warn, "l3 object torn or foreign at scan, removed",
          {{"path", absl::StrCat(rel, "/", name)}, {"defect", ObjectDefectName(defect)}});
  }
}

uint32_t FileStartupScan::NamespaceSlot(const core::PageKey& digest) {
  for (size_t i = namespaces_.size(); i-- > 0;) {
    if (namespaces_[i] == digest) return static_cast<uint32_t>(i);
  }
  namespaces_.push_back(digest);
  return static_cast<uint32_t>(namespaces_.size() - 1);
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
