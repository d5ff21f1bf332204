// ShmObject: open or create, lock, size check, free-space check, unlink.
#include "platform/shm_object.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcellar::platform {
namespace {

// Where tmpfs shm objects live, for the free-space check.
constexpr char kShmDir[] = "/dev/shm";

std::string Errno(int err) { return std::strerror(err); }

// Opens an existing object, else creates it exclusively; retries once if another process created
// it between the two calls. Returns the descriptor and whether this call created the object.
absl::StatusOr<std::pair<int, bool>> OpenOrCreate(const std::string& name) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    bool created = false;
    if (fd < 0 && errno == ENOENT) {
      fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      created = fd >= 0;
      if (fd < 0 && errno == EEXIST) continue;
    }
    if (fd < 0) {
      const int err = errno;
      const std::string msg = absl::StrCat("shm_open(\"", name, "\") failed: ", Errno(err));
      return err == EACCES ? absl::PermissionDeniedError(msg) : absl::InternalError(msg);
    }
    return std::make_pair(fd, created);
  }
  return absl::UnavailableError(absl::StrCat("shm_open(\"", name, "\") kept racing"));
}

// Takes the object for this owner and gives it `bytes`: the lock, then the size check of an
// existing object or the sizing of a new one.
absl::Status LockAndSize(int fd, const std::string& name, uint64_t bytes, bool recreate,
                         uint64_t* previous_bytes) {
  // One owner per object: two allocators over the same bytes would hand out the same slots.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm object ", name, " is in use by another live host pool"));
    }
    return absl::InternalError(absl::StrCat("flock on shm object ", name, ": ", Errno(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat of shm object ", name, ": ", Errno(errno)));
  }
  if (st.st_size != 0) {
    if (static_cast<uint64_t>(st.st_size) == bytes) return absl::OkStatus();
    if (recreate) {
      // Its bytes were laid out for another size: dropped, and the object sized anew below.
      *previous_bytes = static_cast<uint64_t>(st.st_size);
      if (ftruncate(fd, 0) != 0) {
        return absl::InternalError(
            absl::StrCat("ftruncate of shm object ", name, " to 0: ", Errno(errno)));
      }
    }
  }
  if (st.st_size != 0 && !recreate) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm object ", name, " has ", st.st_size, " bytes but the pool wants ", bytes,
        "; the geometry changed: remove the object (HostMemory::UnlinkShm) or restore the "
        "capacity"));
  }
  // tmpfs allocates on first touch; a write past its free space is SIGBUS, not an error. Refuse
  // up front when the object could never fit (e.g. a container's default 64 MiB /dev/shm).
  struct statvfs vfs;
  if (statvfs(kShmDir, &vfs) == 0) {
    const uint64_t avail = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    if (avail < bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          kShmDir, " has ", avail, " bytes free but the pool needs ", bytes,
          " (in Kubernetes mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm)"));
    }
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate of shm object ", name, " to ", bytes, ": ", Errno(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ShmObject::NormalizeName(absl::string_view name) {
  std::string n = name.empty() || name[0] != '/' ? absl::StrCat("/", name) : std::string(name);
  if (n.size() < 2 || n.find('/', 1) != std::string::npos || n.size() > NAME_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_name \"", name, "\" must be one path component (no '/' after the first), 1 to ",
        NAME_MAX - 1, " characters"));
  }
  return n;
}

absl::StatusOr<std::unique_ptr<ShmObject>> ShmObject::Open(const std::string& name,
                                                           uint64_t bytes, bool recreate) {
  absl::StatusOr<std::string> normalized = NormalizeName(name);
  if (!normalized.ok()) return normalized.status();
  absl::StatusOr<std::pair<int, bool>> opened = OpenOrCreate(*normalized);
  if (!opened.ok()) return opened.status();
  // From here the object owns the descriptor: an error below closes it, and removes the object
  // if this call created it.
  std::unique_ptr<ShmObject> object(
      new ShmObject(*std::move(normalized), opened->first, opened->second));
  if (absl::Status s =
          LockAndSize(object->fd_, object->name_, bytes, recreate, &object->previous_bytes_);
      !s.ok()) {
    if (object->created_) object->UnlinkOnDestroy();
    return s;
  }
  return object;
}

absl::Status ShmObject::Unlink(absl::string_view name) {
  absl::StatusOr<std::string> normalized = NormalizeName(name);
  if (!normalized.ok()) return normalized.status();
  if (shm_unlink(normalized->c_str()) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no shm object ", *normalized));
    return absl::InternalError(absl::StrCat("shm_unlink(\"", *normalized, "\"): ", Errno(err)));
  }
  return absl::OkStatus();
}

ShmObject::~ShmObject() {
  if (unlink_on_destroy_) shm_unlink(name_.c_str());
  close(fd_);
}

}  // namespace kvcellar::platform
