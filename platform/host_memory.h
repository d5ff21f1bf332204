// HostMemory: one large mapping of host memory, made once and unmapped when destroyed. It holds
// the bytes of the daemon's L2 pool; core/host_pool.h carves them into slots and never maps
// anything itself.
//
// Two kinds. Anonymous memory is private to the process (engines reach it through CUDA, not by
// mapping it). Named memory is a POSIX shared memory object (platform/shm_object.h) that outlives
// the process, so that a restarted daemon with the same size re-attaches the same bytes (warm
// restart). Either may be backed by huge pages (platform/huge_pages.h): hugetlb pages for
// anonymous memory, transparent huge pages where the kernel allows them.
//
// The mapping never touches its bytes: it does not populate (MAP_POPULATE) or mlock them. Pages
// are faulted in by the first copy into them, and pinned by cudaHostRegister in gpu/ when a GPU is
// present; prefaulting 100+ GiB at startup would only delay it.
//
// Threading: one thread maps and destroys; the accessors are immutable and may be read from any.
#ifndef KVCELLAR_PLATFORM_HOST_MEMORY_H_
#define KVCELLAR_PLATFORM_HOST_MEMORY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "platform/huge_pages.h"
#include "platform/shm_object.h"

namespace kvcellar::platform {

struct HostMemoryOptions {
  // Size of the mapping; must be positive. With huge_pages=on, a multiple of HugePageBytes().
  uint64_t bytes = 0;
  HugePages huge_pages = HugePages::kAuto;
  // Empty: anonymous private memory. Otherwise a POSIX shared memory object (/dev/shm) of that
  // name ("/" prepended if missing) that a later mapping of the same size re-attaches. One live
  // mapping per object: a second Map while the first lives fails.
  std::string shm_name;
  // An existing shm object of another size is emptied and resized instead of refused (its bytes
  // were laid out for another geometry; the daemon's warm restart then starts empty).
  bool recreate_on_size_change = false;
  // Remove the shm object when the mapping is destroyed. Off by default: surviving the process is
  // the point of named memory. Use UnlinkShm to remove it later.
  bool unlink_on_destroy = false;
};

class HostMemory {
 public:
  // Maps the memory. Errors name the option at fault: InvalidArgument for bad options (a bad
  // shm_name, huge_pages=on with shm or with a size that is not whole huge pages),
  // ResourceExhausted when the kernel refuses the memory (no hugetlb pages with huge_pages=on, a
  // full /dev/shm), FailedPrecondition for a shm object in use or of another size.
  static absl::StatusOr<std::unique_ptr<HostMemory>> Map(const HostMemoryOptions& options);

  // Removes a shm object ("/" prepended if missing). NotFound if absent.
  static absl::Status UnlinkShm(absl::string_view shm_name);

  // Unmaps, then removes the shm object if asked (HostMemoryOptions::unlink_on_destroy), then
  // closes it.
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  std::span<uint8_t> bytes() const { return {base_, size_}; }
  // The page size the kernel maps it with: the huge page size when hugetlb-backed, else the base
  // page size (transparent huge pages do not change what the mapping promises).
  uint64_t page_bytes() const { return page_bytes_; }
  HugePageBacking backing() const { return backing_; }
  // True when Map attached an existing shm object, with its bytes, rather than creating it (or
  // recreating it at another size).
  bool reattached() const {
    return shm_ != nullptr && !shm_->created() && shm_->previous_bytes() == 0;
  }
  // The size the shm object had when Map recreated it at this size; 0 otherwise.
  uint64_t previous_bytes() const { return shm_ != nullptr ? shm_->previous_bytes() : 0; }
  // Normalized shm object name ("/..."), empty for anonymous memory.
  const std::string& shm_name() const { return shm_name_; }
  // The shm object's descriptor (for its identity: engines may not register it), -1 for
  // anonymous memory.
  int shm_fd() const { return shm_ != nullptr ? shm_->fd() : -1; }

 private:
  HostMemory() = default;

  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t page_bytes_ = 0;
  HugePageBacking backing_ = HugePageBacking::kNone;
  std::string shm_name_;
  // Held open (and locked) for the mapping's life; nullptr for anonymous memory.
  std::unique_ptr<ShmObject> shm_;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_HOST_MEMORY_H_
