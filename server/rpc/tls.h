// Server-side gRPC credentials for the TCP listener: plaintext, TLS, or mutual TLS.
//
// Certificates and keys are read from PEM files once at startup. With mutual TLS the server
// requires and verifies a client certificate signed by the configured CA; a client without one
// is refused during the handshake, before any RPC runs.
#ifndef KVCELLAR_SERVER_RPC_TLS_H_
#define KVCELLAR_SERVER_RPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "server/config/config.h"

namespace kvcellar::server {

// Credentials for tls.mode with the files tls.cert_file, tls.key_file, tls.client_ca_file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& tls);

// Reads a whole file; errors name the config key the path came from.
absl::StatusOr<std::string> ReadPemFile(absl::string_view key, const std::string& path);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_TLS_H_
