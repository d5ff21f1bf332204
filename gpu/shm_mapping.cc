#include "gpu/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcellar::gpu {
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

}  // namespace

absl::Status ShmMapping::CheckName(absl::string_view name) {
  // NAME_MAX (255) bytes including the leading slash is what glibc's shm_open accepts.
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

absl::StatusOr<ShmMapping> ShmMapping::Create(absl::string_view name, uint64_t bytes) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError("shm object size is 0");
  std::string n(name);
  int fd = shm_open(n.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open(", n, ", create)"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(n.c_str());
    return ErrnoStatus(err, absl::StrCat("ftruncate(", n, ", ", bytes, ")"));
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

absl::StatusOr<ShmMapping> ShmMapping::Open(absl::string_view name, uint64_t bytes) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError("shm mapping size is 0");
  std::string n(name);
  int fd = shm_open(n.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open(", n, ")"));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return ErrnoStatus(err, absl::StrCat("fstat(", n, ")"));
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

}  // namespace kvcellar::gpu
