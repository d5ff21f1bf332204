// MemoryAccessPolicy: which shared memory a registering engine may have the daemon map.
//
// An engine names its memory (docs/api.md, MemoryRegion and SimCounterSignals); the daemon maps
// what it names with its own privileges. So a registration may name only memory the engine owns
// (platform/engine_memory_access.h, docs/security.md):
//   - Unix socket peers: objects their own uid owns, /proc fd paths of their own pid;
//   - TCP peers (plaintext, TLS or mTLS) have no uid, so their host-memory registrations are
//     refused unless the operator says the node's engines trust each other
//     (listen.tcp_host_memory);
//   - nobody: the daemon's own pool and journal.
// CUDA IPC handles carry no owner the daemon could check (docs/security.md, "CUDA").
// Refusals are PERMISSION_DENIED with ERROR_REASON_MEMORY_NOT_OWNED naming the field; nothing is
// mapped.
//
// Threads: immutable after construction; call from any thread.
#ifndef KVCELLAR_SERVER_SESSION_MEMORY_ACCESS_H_
#define KVCELLAR_SERVER_SESSION_MEMORY_ACCESS_H_

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "platform/engine_memory_access.h"
#include "server/session/peer_identity.h"

namespace kvcellar::server {

class MemoryAccessPolicy {
 public:
  MemoryAccessPolicy(bool tcp_host_memory, std::vector<platform::DaemonObject> daemon_objects)
      : tcp_host_memory_(tcp_host_memory), daemon_objects_(std::move(daemon_objects)) {}

  // What `caller` may have mapped. `host_memory`: the registration names host shared memory
  // (first named by `field`); a TCP caller is then refused unless tcp_host_memory.
  absl::StatusOr<platform::EngineMemoryAccess> For(const PeerIdentity& caller, bool host_memory,
                                                   absl::string_view field) const;

  // An error opening memory named by `field`, as the registration's error: PERMISSION_DENIED
  // (MEMORY_NOT_OWNED when the policy refused it, HANDLE_OPEN_FAILED when the OS refused the
  // daemon), otherwise FAILED_PRECONDITION / HANDLE_OPEN_FAILED. `message` is the whole text.
  static absl::Status OpenError(absl::string_view field, const absl::Status& status,
                                absl::string_view message);

 private:
  const bool tcp_host_memory_;
  const std::vector<platform::DaemonObject> daemon_objects_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_MEMORY_ACCESS_H_
