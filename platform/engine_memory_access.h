// EngineMemoryAccess: which shared-memory objects the daemon may map on an engine's behalf.
//
// Memory is a capability, not a name (DESIGN.md, Security). kvcellard often runs with more
// privilege than its engines (root in a hostPID DaemonSet), so opening whatever object an engine
// names would let that engine read and write memory it could not open itself: another tenant's
// KV, another engine's signal words, or the daemon's own L2 pool. An engine's registration
// therefore maps an object only when
//   - its owner (st_uid) is the registering peer's uid (SO_PEERCRED): an engine's own memory is
//     memory its own user created, whatever the object's mode says about other readers;
//   - for "/proc/<pid>/fd/<fd>", <pid> is the registering peer's own pid: the engine hands over
//     its own descriptor, never another process's;
//   - it is none of the daemon's own objects (the pool and its journal), whoever owns them, so an
//     engine running as the daemon's user cannot map the pool either.
// Every check is made on the object actually opened (fstat of the descriptor, before mmap), never
// on the name: a symlink, a hard link, or an object renamed or replaced between the engine's
// naming and the daemon's open is judged by what it is. The name is only used to refuse a /proc
// path of another pid before anything is opened.
//
// Unchecked() is the engine side's own view (an engine opening its own memory, tests): nothing
// is refused but the daemon's objects it lists.
//
// Threads: a value type.
#ifndef KVCELLAR_PLATFORM_ENGINE_MEMORY_ACCESS_H_
#define KVCELLAR_PLATFORM_ENGINE_MEMORY_ACCESS_H_

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::platform {

// The identity of a file: what a hard link, a symlink or a /proc fd path resolve to.
struct FileId {
  uint64_t dev = 0;
  uint64_t ino = 0;
  bool operator==(const FileId&) const = default;

  static FileId Of(const struct stat& st) {
    return FileId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  }
  // fstat of an open descriptor.
  static absl::StatusOr<FileId> OfFd(int fd);
};

// One of the daemon's own objects, and what to call it in a refusal ("the daemon's L2 pool").
struct DaemonObject {
  FileId id;
  std::string what;
};

// Refusals carry a payload under this URL, so that a caller can tell "the engine does not own
// this" (the server's ERROR_REASON_MEMORY_NOT_OWNED) from the OS refusing the daemon (EACCES).
inline constexpr absl::string_view kMemoryRefusalPayload = "type.kvcellar.dev/memory-not-owned";
bool IsMemoryRefusal(const absl::Status& status);
// PERMISSION_DENIED with `message`, marked as a refusal.
absl::Status MemoryRefusal(std::string message);
// `status` with `prefix` before its message, code and payloads kept.
absl::Status WithPrefix(const absl::Status& status, absl::string_view prefix);

class EngineMemoryAccess {
 public:
  // Refuses nothing (but the daemon's objects added with Forbid).
  static EngineMemoryAccess Unchecked() { return EngineMemoryAccess(); }
  // Objects owned by `uid`, and /proc fd paths of `pid` only. pid 0 (the peer's pid is not
  // visible in the daemon's PID namespace): no /proc path is accepted.
  static EngineMemoryAccess ForPeer(uint32_t uid, int32_t pid);

  EngineMemoryAccess& Forbid(std::vector<DaemonObject> objects) {
    forbidden_ = std::move(objects);
    return *this;
  }

  // Before opening `name`, a "/proc/<pid>/fd/<fd>" path (ShmMapping parses it): PERMISSION_DENIED
  // when `pid` is not the peer's.
  absl::Status CheckProcPid(int32_t pid, absl::string_view name) const;
  // Before reaching process `pid`'s memory ("/proc/<pid>/mem", platform/process_memory.h):
  // PERMISSION_DENIED unless the peer is known (ForPeer with a visible pid) and `pid` is its
  // own, and always for the daemon's own process, whose memory holds the pool.
  absl::Status CheckProcessMemory(int32_t pid, absl::string_view name) const;
  // After opening it, before mapping: PERMISSION_DENIED when the object is one of the daemon's
  // own or (checked) not owned by the peer's uid. Messages name the object and the owner uid,
  // never what the object holds.
  absl::Status CheckOpened(const struct stat& st, absl::string_view name) const;

 private:
  bool check_owner_ = false;
  uint32_t uid_ = 0;
  int32_t pid_ = 0;
  std::vector<DaemonObject> forbidden_;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_ENGINE_MEMORY_ACCESS_H_
