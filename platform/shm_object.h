// ShmObject: a named POSIX shared memory object (/dev/shm) of a fixed size, held by one owner at
// a time.
//
// It is what lets the host pool outlive the daemon (platform/host_memory.h maps it): a restarted
// daemon opens the same name and finds the same bytes. Two owners at once would hand out the same
// bytes twice, so opening takes an exclusive flock on the descriptor; the lock goes with the
// descriptor, so a crashed owner never leaves it held. The size is fixed at creation: an existing
// object of another size is refused rather than resized, because its bytes were laid out for the
// old size.
//
// Threading: one thread creates and destroys an object; its accessors may be read from any.
#ifndef KVCELLAR_PLATFORM_SHM_OBJECT_H_
#define KVCELLAR_PLATFORM_SHM_OBJECT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::platform {

class ShmObject {
 public:
  // Accepts "name" or "/name" and returns "/name": POSIX wants exactly one leading slash and no
  // other. InvalidArgument, naming shm_name, for anything else.
  static absl::StatusOr<std::string> NormalizeName(absl::string_view name);

  // Opens the object `name` (normalized, see NormalizeName), creating it if absent, and locks it
  // for this owner. An existing object must have exactly `bytes` (FailedPrecondition otherwise);
  // a new one is sized to `bytes` once /dev/shm is seen to have room for it (ResourceExhausted
  // otherwise: tmpfs would fail the first write past its free space with SIGBUS, not an error).
  // FailedPrecondition when another owner holds the lock. On any error nothing is left behind:
  // an object this call created is removed. With `recreate`, an existing object of another size
  // is emptied and sized anew instead (its bytes are lost; previous_bytes() says it happened).
  static absl::StatusOr<std::unique_ptr<ShmObject>> Open(const std::string& name, uint64_t bytes,
                                                         bool recreate = false);

  // Removes the object's name ("/" prepended if missing); owners that have it open keep their
  // bytes. NotFound if absent.
  static absl::Status Unlink(absl::string_view name);

  // Removes the name first if UnlinkOnDestroy was called, then closes the descriptor: the lock is
  // dropped only after the unlink, so no new owner attaches a dying object.
  ~ShmObject();
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  // Makes the destructor remove the object's name.
  void UnlinkOnDestroy() { unlink_on_destroy_ = true; }

  // The open descriptor, for mmap; owned by this object.
  int fd() const { return fd_; }
  // True when Open created the object; false when it opened an existing one.
  bool created() const { return created_; }
  // The size an existing object had when Open recreated it at another size; 0 otherwise.
  uint64_t previous_bytes() const { return previous_bytes_; }
  // The normalized name ("/...").
  const std::string& name() const { return name_; }

 private:
  ShmObject(std::string name, int fd, bool created)
      : name_(std::move(name)), fd_(fd), created_(created) {}

  const std::string name_;
  const int fd_;
  const bool created_;
  uint64_t previous_bytes_ = 0;
  bool unlink_on_destroy_ = false;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_SHM_OBJECT_H_
