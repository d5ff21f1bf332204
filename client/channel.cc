#include "client/channel.h"

#include <fstream>
#include <sstream>

#include <algorithm>
#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvcellar::client {
namespace {

absl::StatusOr<std::string> ReadFile(absl::string_view what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read '", path, "'"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::string> NormalizeTarget(absl::string_view addr) {
  if (addr.empty()) return absl::InvalidArgumentError("address is empty");
  if (absl::StartsWith(addr, "unix:") || absl::StartsWith(addr, "dns:") ||
      absl::StartsWith(addr, "ipv4:") || absl::StartsWith(addr, "ipv6:")) {
    return std::string(addr);
  }
  if (addr[0] == '/' || absl::StartsWith(addr, "./")) return absl::StrCat("unix:", addr);
  if (addr.find(':') == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", addr, "' is neither a socket path (absolute) nor HOST:PORT"));
  }
  return absl::StrCat("dns:", addr);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(absl::string_view addr,
                                                           const ChannelOptions& options) {
  absl::StatusOr<std::string> target = NormalizeTarget(addr);
  if (!target.ok()) return target.status();
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.ca_file.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = ReadFile("CA file", options.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    if (!options.cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFile("client certificate", options.cert_file);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFile("client key", options.key_file);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_bytes);
  args.SetMaxSendMessageSize(options.max_receive_bytes);
  if (!options.server_name_override.empty()) {
    args.SetSslTargetNameOverride(options.server_name_override);
  }
  auto ms = [](absl::Duration d) {
    return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT32_MAX));
  };
  if (options.reconnect_backoff_min > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ms(options.reconnect_backoff_min));
  }
  if (options.reconnect_backoff_max > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms(options.reconnect_backoff_max));
  }
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: despite its name it is the minimum time gRPC gives a
  // connection attempt (MIN_CONNECT_TIMEOUT in gRPC's doc/connection-backoff.md). Set to a
  // backoff-sized value it makes handshakes with a busy daemon fail ("timed out before receiving
  // SETTINGS frame"); RPC deadlines bound what a caller waits anyway.
  if (options.private_subchannel) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(*target, creds, args);
}

}  // namespace kvcellar::client
