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
// One user's connections are bounded (`max_per_uid`, listen.max_connections_per_uid): past it a
// new connection of that uid is refused, so a runaway or hostile client of one team cannot take
// the file descriptors the daemon needs for every other engine. A refused connection is not
// served, but told why (RefusedConnections: its gRPC calls fail UNAVAILABLE with the bound in
// the message) and closed within a second; it is counted per uid
// (kvcellar_unix_connections_refused_total, at most kMaxRefusedUidSeries uids, then "other"),
// and the first refusal of a uid is logged, then at most one line a minute per uid. gRPC closes a
// connection's fd without telling the listener, so the count is kept honest lazily: when a uid
// reaches its bound, the listener checks which of its recorded fds still are those sockets
// (fstat: same inode) before refusing.
//
// Threads: Start and Stop from the daemon's thread; the accept thread in between.
#ifndef KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_
#define KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_

#include <sys/socket.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/metrics/metrics.h"
#include "server/rpc/peer_credentials.h"
#include "server/rpc/refused_connection.h"

namespace kvcellar::server {

// Series of kvcellar_unix_connections_refused_total: one per uid refused, up to this many, then
// "other". A node has a handful of service accounts running engines; 64 leaves room for many and
// keeps a client that changes uid in a loop from growing the exposition.
inline constexpr size_t kMaxRefusedUidSeries = 64;

class UnixListener {
 public:
  // Binds PATH (which PrepareUnixSocketPath made ready) and starts accepting for `server`.
  // `server`, `credentials` and `registry` outlive the listener (or its Stop).
  // `max_per_uid` 0: no bound. `registry` null: refusals are not exported.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(const std::string& path,
                                                             grpc::Server* server,
                                                             PeerCredentials* credentials,
                                                             size_t max_per_uid = 0,
                                                             MetricsRegistry* registry = nullptr);
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Stops accepting (connections already handed to gRPC stay with it). Idempotent.
  void Stop();

  // Connections accepted so far, and of those closed at once for their uid's bound.
  uint64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  UnixListener(int listen_fd, int stop_fd, grpc::Server* server, PeerCredentials* credentials,
               size_t max_per_uid, CounterFamily* refused_by_uid);
  void AcceptLoop();
  // Accepts every pending connection; false when out of fds (retry after a pause).
  bool AcceptPending();
  // Whether `uid` may open one more connection; forgets its connections that gRPC has closed.
  bool AdmitUid(uint32_t uid);
  void Track(int fd, uint32_t uid);
  // Counts, logs and answers a connection refused for its uid's bound; takes `fd`.
  void Refuse(int fd, const ucred& cred);

  // An accepted connection as the accept thread last saw it (touched by that thread only).
  struct Open {
    uint64_t inode = 0;
    uint32_t uid = 0;
  };

  const int listen_fd_;
  const int stop_fd_;  // An eventfd; written by Stop.
  grpc::Server* const server_;
  PeerCredentials* const credentials_;
  const size_t max_per_uid_;
  CounterFamily* const refused_by_uid_;  // Null: not exported.
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  absl::flat_hash_map<int, Open> open_;               // By fd.
  absl::flat_hash_map<uint32_t, size_t> per_uid_;     // Entries of open_ by uid.
  absl::flat_hash_map<uint32_t, absl::Time> logged_;  // Last refusal logged, by uid.
  RefusedConnections refusing_;                       // Being told why.
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_UNIX_LISTENER_H_
