// Channels from the client side: turning an address a person types into a gRPC channel.
//
// Addresses: an absolute path or `unix:PATH` is a Unix socket (the default transport: file
// permissions decide who may connect); `HOST:PORT` or `dns:HOST:PORT` is TCP, plaintext unless
// TLS files are given. Used by libkvcellar-client and by kvcellarctl.
#ifndef KVCELLAR_CLIENT_CHANNEL_H_
#define KVCELLAR_CLIENT_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"

namespace kvcellar::client {

struct ChannelOptions {
  // TLS for TCP addresses. An empty ca_file means plaintext. cert_file and key_file present a
  // client certificate (mutual TLS).
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  // Overrides the name checked against the server certificate (tests use "localhost").
  std::string server_name_override;
  // Largest message sent or accepted.
  int max_receive_bytes = 64 << 20;
  // Reconnect backoff after a failed connection; zero keeps gRPC's defaults (1 s growing to
  // 120 s, which would leave a restarted daemon unused for minutes: engines set these).
  absl::Duration reconnect_backoff_min = absl::ZeroDuration();
  absl::Duration reconnect_backoff_max = absl::ZeroDuration();
  // A subchannel of this channel's own: a shared one would carry another channel's backoff.
  bool private_subchannel = false;
};

// The gRPC target string for ADDR ("unix:/run/kvcellar/kvcellard.sock", "dns:host:port").
absl::StatusOr<std::string> NormalizeTarget(absl::string_view addr);

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(absl::string_view addr,
                                                           const ChannelOptions& options);

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_CHANNEL_H_
