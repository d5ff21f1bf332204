// PeerCredentials: the identity of the peer behind each RPC (session/peer_identity.h).
//
// gRPC does not tell a handler the Unix-socket peer's credentials, so the engine socket is not
// bound by gRPC but by UnixListener (unix_listener.h), which accepts each connection itself,
// reads the kernel's SO_PEERCRED, records it here under the connection's fd, and only then hands
// the fd to gRPC. gRPC names such a connection's peer "fd:N", so a handler finds the credentials
// by that name. An fd is recorded again before gRPC sees a new connection on a reused number,
// and a connection's fd stays open while any of its calls runs, so a call never meets another
// connection's credentials.
//
// Other peers: TCP with a verified client certificate -> its subject (mutual TLS); TCP without
// one -> its host address; no context (handlers called in-process) -> kInProcess. A peer name
// this table does not know (a Unix socket bound by gRPC itself) is treated like a network peer
// named by that string: it matches only itself and is granted no tenant.
//
// Threads: Record from the listener's thread, Identify from gRPC handlers, concurrently.
#ifndef KVCELLAR_SERVER_RPC_PEER_CREDENTIALS_H_
#define KVCELLAR_SERVER_RPC_PEER_CREDENTIALS_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "server/session/peer_identity.h"

namespace kvcellar::server {

class PeerCredentials {
 public:
  // The connection on `fd` was made by `peer` (kUnix).
  void Record(int fd, const PeerIdentity& peer) ABSL_LOCKS_EXCLUDED(mu_);

  // Who made the call of `context` (nullptr: kInProcess).
  PeerIdentity Identify(const grpc::ServerContextBase* context) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, PeerIdentity> by_fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_PEER_CREDENTIALS_H_
