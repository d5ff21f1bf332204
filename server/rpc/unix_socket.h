// Unix-socket listener paths: preparing them before gRPC binds, and securing them after.
//
// gRPC binds `unix:PATH` itself, so the daemon's job is around the bind: create the parent
// directory, refuse to start when a live daemon already answers on PATH, replace a stale socket
// file left by a crash, and give the socket its configured mode and group.
#ifndef KVCELLAR_SERVER_RPC_UNIX_SOCKET_H_
#define KVCELLAR_SERVER_RPC_UNIX_SOCKET_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::server {

// Makes PATH ready for a bind: creates missing parent directories (mode 0750: owner and group,
// see unix_socket.cc), fails with
// FailedPrecondition if a process accepts connections on it ("another kvcellard is listening"),
// removes a stale socket file, and fails if PATH exists and is not a socket (never deletes a
// regular file by mistake).
absl::Status PrepareUnixSocketPath(const std::string& path);

// Applies mode and group (empty group = leave the process group) to a bound socket.
absl::Status SecureUnixSocket(const std::string& path, mode_t mode, const std::string& group);

// Removes PATH if it is a socket (at shutdown).
void RemoveUnixSocket(const std::string& path);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_UNIX_SOCKET_H_
