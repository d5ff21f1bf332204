// ShmMapping: a shared-memory object mapped into this process.
//
// The sim device (host shared memory) keeps engine memory and the signal region in shared
// objects: the engine creates them and the daemon maps them (Open), so both processes see the
// same bytes, exactly as both see one GPU allocation through CUDA IPC. Two kinds of name:
//   - a POSIX shm name, "/kvc-sim-4242-rank0" (shm_open); Create makes these;
//   - "/proc/<pid>/fd/<fd>": an object another process holds open, typically a memfd
//     (memfd_create, which has no name: SGLang's HiCache host pool). Open re-opens it through
//     /proc. Only Open takes this form.
//
// Trust and permissions: re-opening another process's fd through /proc is a ptrace-mode access
// check, so the daemon must run as the engine's uid (or have CAP_SYS_PTRACE) and share its PID
// namespace (the pid is read in the daemon's namespace). The daemon maps an object an engine
// names only when the engine owns it (platform/engine_memory_access.h: the object's owner is the
// engine's uid, a /proc path is the engine's own pid, never the daemon's pool or journal),
// checked on the descriptor it opened, before mapping. A process that
// truncates an object another process has mapped makes that process's next access fault
// (SIGBUS): the sim device's copies of engine memory run under a fault guard
// (platform/bus_fault_guard.h), so such an engine fails only its own ops, and so do the daemon's
// accesses to signal words (platform/signal_region.h). A /proc name must lead to shared memory (a
// regular file on tmpfs or hugetlbfs, as memfds and /dev/shm objects are), never to a disk file,
// pipe or device.
#ifndef KVCELLAR_PLATFORM_SHM_MAPPING_H_
#define KVCELLAR_PLATFORM_SHM_MAPPING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "platform/engine_memory_access.h"

namespace kvcellar::platform {

class ShmMapping {
 public:
  // Creates a new POSIX shm object of `bytes` (zero-filled, permission bits `mode`, whatever the
  // umask) and maps all of it read-write. The mapping owns the name: destruction unlinks it.
  // ALREADY_EXISTS when the name is taken; INVALID_ARGUMENT for a /proc name. A daemon running as
  // another user than the engine opens the object only if `mode` lets it (e.g. 0660 with the
  // daemon's group); it maps it only because the engine's user owns it.
  static absl::StatusOr<ShmMapping> Create(absl::string_view name, uint64_t bytes,
                                           uint32_t mode = kDefaultMode);
  static constexpr uint32_t kDefaultMode = 0600;

  // Maps the first `bytes` of an existing object read-write; `name` is either form (above). Does
  // not own the name. NOT_FOUND when there is no such object (for /proc: no such process or fd);
  // PERMISSION_DENIED when this process may not open it or `access` refuses it (nothing is
  // mapped then); INVALID_ARGUMENT when it holds fewer than `bytes` bytes or (/proc) is not
  // shared memory.
  static absl::StatusOr<ShmMapping> Open(
      absl::string_view name, uint64_t bytes,
      const EngineMemoryAccess& access = EngineMemoryAccess::Unchecked());

  // INVALID_ARGUMENT unless `name` is a name Open takes: a portable POSIX shm name ("/" then
  // 1..254 characters, none of them "/") or exactly "/proc/<pid>/fd/<fd>" (decimal, no sign).
  static absl::Status CheckName(absl::string_view name);
  // True when `name` is of the "/proc/<pid>/fd/<fd>" form.
  static bool IsProcFdPath(absl::string_view name);

  ShmMapping() = default;
  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }

  // Unmaps (and unlinks, if owner) now.
  void Reset();

 private:
  ShmMapping(std::string name, uint8_t* data, uint64_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}

  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_SHM_MAPPING_H_
