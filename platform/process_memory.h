// ProcessMemory: an engine process's own memory, which the daemon reads and writes with
// process_vm_readv / process_vm_writev, for engines whose KV cache is plain host memory (vLLM's
// CPU worker allocates it with torch.zeros: no shared object the daemon could map). The engine
// names it "/proc/<pid>/mem" with its own pid and the virtual addresses of its buffers; nothing
// is copied engine-side and nothing is shared beyond what the engine registered.
//
// Who may be reached (docs/security.md):
//   - only the registering peer's own process: the pid is the one SO_PEERCRED gave for the
//     connection (EngineMemoryAccess::CheckProcessMemory), never the daemon itself, and never for
//     a peer whose pid the daemon cannot see (TCP, another PID namespace);
//   - the kernel checks on every call that the daemon may ptrace the engine (same uid and Yama
//     permitting, or CAP_SYS_PTRACE); Open probes every range, so a refusal or an address the
//     engine has not mapped fails the registration, not a later copy;
//   - the process is held by a pidfd: once it has exited every copy fails, so a pid the kernel
//     hands to a new process is never written. (A copy already inside the kernel when the engine
//     exits could only reach a new process if the pid space wrapped around within it.)
//
// Threading: Read and Write may run on several threads at once; Open and destruction on one.
#ifndef KVCELLAR_PLATFORM_PROCESS_MEMORY_H_
#define KVCELLAR_PLATFORM_PROCESS_MEMORY_H_

#include <sys/uio.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "platform/engine_memory_access.h"

namespace kvcellar::platform {

// The pid of a "/proc/<pid>/mem" name (decimal, no sign, no leading zero), else nullopt.
std::optional<int32_t> ParseProcessMemoryName(absl::string_view name);

class ProcessMemory {
 public:
  // An address range in the engine: [address, address + bytes).
  struct Range {
    uint64_t address = 0;
    uint64_t bytes = 0;
  };

  // `name` is "/proc/<pid>/mem". PERMISSION_DENIED (a memory refusal) when `access` refuses the
  // pid; FAILED_PRECONDITION when the kernel refuses the daemon access to the process (the
  // message says what to grant); INVALID_ARGUMENT naming ranges[i] when a range is not mapped in
  // the engine; NOT_FOUND when the process is gone.
  // Errors about a range name it as "<what>[i]"; errors about the process as a whole start with
  // "<process_what>: " when process_what is not empty (the field the caller took `name` from).
  static absl::StatusOr<ProcessMemory> Open(absl::string_view name,
                                            const EngineMemoryAccess& access,
                                            absl::Span<const Range> ranges,
                                            absl::string_view what = "ranges",
                                            absl::string_view process_what = "");

  ProcessMemory(ProcessMemory&& other) noexcept
      : pid_(std::exchange(other.pid_, 0)), pidfd_(std::exchange(other.pidfd_, -1)) {}
  ProcessMemory& operator=(ProcessMemory&& other) noexcept;
  ProcessMemory(const ProcessMemory&) = delete;
  ProcessMemory& operator=(const ProcessMemory&) = delete;
  ~ProcessMemory();

  int32_t pid() const { return pid_; }
  // False once the process has exited.
  bool alive() const;

  // Engine -> daemon: remote[i] into local[i], in order; the i-th runs have equal lengths. At
  // most IOV_MAX runs per call are passed to the kernel; more are split. false (errno set) when
  // the process is gone or a byte could not be copied; the local bytes are then undefined.
  bool Read(absl::Span<const iovec> local, absl::Span<const iovec> remote) const;
  // Daemon -> engine: local[i] into remote[i].
  bool Write(absl::Span<const iovec> local, absl::Span<const iovec> remote) const;

 private:
  ProcessMemory(int32_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}
  bool Transfer(absl::Span<const iovec> local, absl::Span<const iovec> remote, bool write) const;

  int32_t pid_ = 0;
  int pidfd_ = -1;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_PROCESS_MEMORY_H_
