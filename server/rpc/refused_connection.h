// RefusedConnections: tells a gRPC client why the daemon refused its connection, in words its
// gRPC library shows, instead of closing the socket under it.
//
// UnixListener refuses a connection past its user's bound (listen.max_connections_per_uid).
// Closed at once, the client saw only "failed to connect to all addresses; last error:
// UNAVAILABLE: unix:...: Broken pipe" (issue #24). A GOAWAY frame alone does not help either:
// gRPC retries the call it had not sent yet on a new connection until its deadline. So the
// connection is answered in HTTP/2, as a gRPC server would: the server preface (an empty
// SETTINGS), then every call the client opens gets a trailers-only response, grpc-status 14
// (UNAVAILABLE) with the reason as grpc-message, then a GOAWAY (ENHANCE_YOUR_CALM, the reason as
// debug data) and the write side is shut. A grpcio 1.51 client then fails its call with
// UNAVAILABLE and that message. The connection is read (and the bytes dropped) until the client
// closes it or kLinger passes: closing a socket with unread input would reset it before the
// client read the answer.
//
// What a hostile client can cost is bounded: at most kMaxPending connections are being told at
// once (past that the oldest is closed outright), each for at most kLinger, and nothing the
// client sends is kept beyond one frame header.
//
// Threads: one thread owns it (UnixListener's accept thread): every method is called from it.
#ifndef KVCELLAR_SERVER_RPC_REFUSED_CONNECTION_H_
#define KVCELLAR_SERVER_RPC_REFUSED_CONNECTION_H_

#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvcellar::server {

// The frames a refused connection is answered with (HTTP/2, RFC 9113; gRPC's trailers-only
// response). Exposed for tests.
namespace http2 {
// An empty SETTINGS frame: the server connection preface.
std::string ServerPreface();
// The acknowledgement of the client's SETTINGS.
std::string SettingsAck();
// A HEADERS frame ending stream `stream_id`: :status 200, content-type application/grpc,
// grpc-status 14 (UNAVAILABLE), grpc-message `message` (percent-encoded as gRPC requires).
std::string UnavailableTrailers(uint32_t stream_id, absl::string_view message);
// GOAWAY: no stream past `last_stream_id` was processed; ENHANCE_YOUR_CALM, `debug` as debug data.
std::string GoAway(uint32_t last_stream_id, absl::string_view debug);
}  // namespace http2

class RefusedConnections {
 public:
  // Connections being answered at once. A client with more refused connections open than this
  // is opening them in a loop; each past the bound is closed without a word.
  static constexpr size_t kMaxPending = 64;
  // How long a refused connection is kept for the client to read its answer. A local gRPC client
  // sends its preface and first call at once, and closes on the GOAWAY within milliseconds.
  static constexpr absl::Duration kLinger = absl::Seconds(1);

  RefusedConnections() = default;
  ~RefusedConnections();  // Closes what is still pending.
  RefusedConnections(const RefusedConnections&) = delete;
  RefusedConnections& operator=(const RefusedConnections&) = delete;

  // Takes `fd` (an accepted, non-blocking stream socket) and answers it with `reason`.
  void Add(int fd, std::string reason, absl::Time now);

  // The descriptors to poll for input, appended to `fds`; OnPoll takes them back, in order.
  void AppendPollFds(std::vector<pollfd>* fds) const;
  void OnPoll(const pollfd* fds, size_t n, absl::Time now);
  // Milliseconds until the first deadline (for poll), or -1 when none is pending.
  int TimeoutMs(absl::Time now) const;

  size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    int fd = -1;
    absl::Time deadline;
    std::string reason;
    // The parser's state over the client's bytes: the 24-byte preface, then frames.
    size_t preface_left = 24;
    uint8_t header[9] = {};
    size_t header_bytes = 0;
    uint32_t payload_left = 0;
    uint32_t last_stream = 0;  // The last call answered.
    bool gone_away = false;    // GOAWAY sent, write side shut.
  };

  // Reads what the client sent and answers it; false when the connection is done.
  bool Serve(Pending& p);
  // Feeds bytes to p's parser, answering each new call; false on a protocol error.
  bool Parse(Pending& p, const uint8_t* data, size_t n);
  static bool Send(int fd, absl::string_view bytes);

  std::deque<Pending> pending_;  // Oldest first.
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_REFUSED_CONNECTION_H_
