#include "server/session/memory_access.h"

#include "absl/strings/str_cat.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {

absl::StatusOr<platform::EngineMemoryAccess> MemoryAccessPolicy::For(
    const PeerIdentity& caller, bool host_memory, absl::string_view field) const {
  platform::EngineMemoryAccess access;
  switch (caller.kind) {
    case PeerIdentity::Kind::kUnix:
      access = platform::EngineMemoryAccess::ForPeer(caller.uid, caller.pid);
      break;
    case PeerIdentity::Kind::kInProcess:
      // The daemon's own process (tests driving handlers): it could open anything anyway.
      access = platform::EngineMemoryAccess::Unchecked();
      break;
    case PeerIdentity::Kind::kCertificate:
    case PeerIdentity::Kind::kNetwork:
      if (host_memory && !tcp_host_memory_) {
        return CacheError(
            absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_MEMORY_NOT_OWNED, field,
            absl::StrCat(field,
                         ": host shared memory can be registered only over the engine Unix "
                         "socket, where the kernel tells the daemon the engine's uid to check "
                         "ownership against; this call comes from ",
                         caller.Describe(),
                         " (an operator whose engines all trust each other may set "
                         "listen.tcp_host_memory)"));
      }
      access = platform::EngineMemoryAccess::Unchecked();
      break;
  }
  access.Forbid(daemon_objects_);
  return access;
}

absl::Status MemoryAccessPolicy::OpenError(absl::string_view field, const absl::Status& status,
                                           absl::string_view message) {
  if (status.code() == absl::StatusCode::kPermissionDenied) {
    return CacheError(absl::StatusCode::kPermissionDenied,
                      platform::IsMemoryRefusal(status) ? v1::ERROR_REASON_MEMORY_NOT_OWNED
                                                        : v1::ERROR_REASON_HANDLE_OPEN_FAILED,
                      field, message);
  }
  // The object is missing, too small, or not what the registration says.
  return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_HANDLE_OPEN_FAILED,
                    field, message);
}

}  // namespace kvcellar::server
