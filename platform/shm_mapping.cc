#include "platform/shm_mapping.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvcellar::platform {
namespace {

absl::Status ErrnoStatus(int err, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case EINVAL:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(msg);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

constexpr absl::string_view kProcPrefix = "/proc/";

// A pid or fd as /proc spells it: decimal digits, no sign, no leading zero, at most INT_MAX.
bool IsProcNumber(absl::string_view text) {
  if (text.empty() || text.size() > 10 || (text.size() > 1 && text[0] == '0')) return false;
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
  }
  return value <= INT_MAX;
}

// NAME_MAX (255) bytes including the leading slash is what glibc's shm_open accepts.
absl::Status CheckPosixName(absl::string_view name) {
  if (name.size() < 2 || name.size() > 255 || name[0] != '/' ||
      name.find('/', 1) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm name \"", name, "\" is not \"/\" followed by 1..254 non-\"/\" bytes"));
  }
  if (name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("shm name contains a NUL byte");
  }
  return absl::OkStatus();
}

// Opening /proc/<pid>/fd/<fd>: the errors an engine can cause, worded for its operator.
absl::Status ProcOpenStatus(int err, absl::string_view path) {
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(
          absl::StrCat(path,
                       ": no such process or fd (the pid must be the engine's as the daemon's PID "
                       "namespace numbers it, and the engine must hold the fd open)"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat(
          path, ": ", strerror(err),
          ": the daemon must run as the engine's uid (or have CAP_SYS_PTRACE) and share its PID "
          "namespace to reopen the engine's fd"));
    case ENXIO:   // A socket.
    case EISDIR:  // A directory.
    case ENODEV:
    case ELOOP:
    case ENOTDIR:
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not shared memory (", strerror(err), ")"));
    default:
      return ErrnoStatus(err, absl::StrCat("open(", path, ")"));
  }
}

// A /proc fd must lead to shared memory: a memfd or a /dev/shm object is a regular file on tmpfs
// (hugetlbfs for MFD_HUGETLB). Anything else (a disk file, pipe, device) the daemon would write
// engine pages into is refused.
absl::Status CheckSharedMemory(int fd, const struct stat& st, absl::string_view path) {
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not shared memory (not a regular file or memfd)"));
  }
  struct statfs fs;
  if (fstatfs(fd, &fs) != 0) return ErrnoStatus(errno, absl::StrCat("fstatfs(", path, ")"));
  if (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not shared memory (a file on a file system other than tmpfs or hugetlbfs)"));
  }
  return absl::OkStatus();
}

// The <pid> of a name IsProcFdPath accepted.
int32_t ProcFdPid(absl::string_view name) {
  name.remove_prefix(kProcPrefix.size());
  int32_t pid = 0;
  (void)absl::SimpleAtoi(name.substr(0, name.find('/')), &pid);  // IsProcNumber: <= INT_MAX.
  return pid;
}

}  // namespace

bool ShmMapping::IsProcFdPath(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, kProcPrefix)) return false;
  const size_t slash = name.find('/');
  if (slash == absl::string_view::npos) return false;
  absl::string_view fd = name.substr(slash);
  return IsProcNumber(name.substr(0, slash)) && absl::ConsumePrefix(&fd, "/fd/") &&
         IsProcNumber(fd);
}

absl::Status ShmMapping::CheckName(absl::string_view name) {
  if (absl::StartsWith(name, kProcPrefix)) {
    if (IsProcFdPath(name)) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("\"", absl::CHexEscape(name.substr(0, 255)),
                     "\" is not \"/proc/<pid>/fd/<fd>\" with a decimal pid and fd"));
  }
  return CheckPosixName(name);
}

absl::StatusOr<ShmMapping> ShmMapping::Create(absl::string_view name, uint64_t bytes,
                                              uint32_t mode) {
  if (absl::Status s = CheckPosixName(name); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError("shm object size is 0");
  std::string n(name);
  int fd = shm_open(n.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open(", n, ", create)"));
  // fchmod, not shm_open's mode: the umask would take bits a daemon of another user needs.
  if ((mode != kDefaultMode && fchmod(fd, static_cast<mode_t>(mode & 07777)) != 0) ||
      ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(n.c_str());
    return ErrnoStatus(err, absl::StrCat("fchmod/ftruncate(", n, ", ", bytes, ")"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(n.c_str());
    return ErrnoStatus(err, absl::StrCat("mmap(", n, ", ", bytes, ")"));
  }
  return ShmMapping(std::move(n), static_cast<uint8_t*>(p), bytes, /*owner=*/true);
}

absl::StatusOr<ShmMapping> ShmMapping::Open(absl::string_view name, uint64_t bytes,
                                            const EngineMemoryAccess& access) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  const bool proc = IsProcFdPath(name);
  if (proc) {
    if (absl::Status s = access.CheckProcPid(ProcFdPid(name), name); !s.ok()) return s;
  }
  if (bytes == 0) return absl::InvalidArgumentError("shm mapping size is 0");
  std::string n(name);
  // A /proc name reopens the engine's fd: a new open file description of the same object.
  int fd = proc ? open(n.c_str(), O_RDWR | O_CLOEXEC) : shm_open(n.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    if (!proc && errno == ELOOP) {
      // shm_open never follows a symlink (O_NOFOLLOW): a link in /dev/shm is nobody's memory.
      return MemoryRefusal(absl::StrCat(n, " is a symbolic link: the daemon opens no links"));
    }
    return proc ? ProcOpenStatus(errno, n) : ErrnoStatus(errno, absl::StrCat("shm_open(", n, ")"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return ErrnoStatus(err, absl::StrCat("fstat(", n, ")"));
  }
  // Judged by the object opened, not by its name (engine_memory_access.h).
  if (absl::Status s = access.CheckOpened(st, n); !s.ok()) {
    close(fd);
    return s;
  }
  if (proc) {
    if (absl::Status s = CheckSharedMemory(fd, st, n); !s.ok()) {
      close(fd);
      return s;
    }
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shm object ", n, " holds ", st.st_size,
                                                   " bytes, fewer than the ", bytes, " declared"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return ErrnoStatus(err, absl::StrCat("mmap(", n, ", ", bytes, ")"));
  return ShmMapping(std::move(n), static_cast<uint8_t*>(p), bytes, /*owner=*/false);
}

ShmMapping::ShmMapping(ShmMapping&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      owner_(std::exchange(other.owner_, false)) {}

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
  }
  return *this;
}

ShmMapping::~ShmMapping() { Reset(); }

void ShmMapping::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
  data_ = nullptr;
  size_ = 0;
  owner_ = false;
}

}  // namespace kvcellar::platform
