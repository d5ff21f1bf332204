// UnixListener: the engine socket, accepted by the daemon itself so that every connection's
// peer credentials are known (peer_credentials.h) before gRPC serves it.
//
// Start binds and listens on PATH (owner-only until the caller applies the configured mode with
// SecureUnixSocket), then a thread accepts: for each connection it reads SO_PEERCRED (uid, gid,
// pid as the kernel saw them at connect), records them, and hands the fd to the gRPC server
// (grpc::AddInsecureChannelFromFd), which serves it like a connection of its own listener. When
// the process is out of fds, the pending connection waits in the backlog and the thread retries
// after a pause, logging once per episode.
//
// Threads: Start and Stop from the daemon's thread; the accept thread in between.
#ifndef KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_
#define KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "server/rpc/peer_credentials.h"

namespace kvcellar::server {

class UnixListener {
 public:
  // Binds PATH (which PrepareUnixSocketPath made ready) and starts accepting for `server`.
  // `server` and `credentials` outlive the listener (or its Stop).
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(const std::string& path,
                                                             grpc::Server* server,
                                                             PeerCredentials* credentials);
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Stops accepting (connections already handed to gRPC stay with it). Idempotent.
  void Stop();

  // Connections accepted so far.
  uint64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }

 private:
  UnixListener(int listen_fd, int stop_fd, grpc::Server* server, PeerCredentials* credentials);
  void AcceptLoop();
  // Accepts every pending connection; false when out of fds (retry after a pause).
  bool AcceptPending();

  const int listen_fd_;
  const int stop_fd_;  // An eventfd; written by Stop.
  grpc::Server* const server_;
  PeerCredentials* const credentials_;
  std::atomic<uint64_t> accepted_{0};
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_
