#include "server/rpc/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace kvcellar::server {

absl::StatusOr<std::string> ReadPemFile(absl::string_view key, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("'", key, "': cannot read '", path, "'"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "': '", path, "' does not contain a PEM block"));
  }
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& files) {
  if (files.mode == TlsMode::kPlaintext) return grpc::InsecureServerCredentials();
  absl::StatusOr<std::string> cert = ReadPemFile("tls.cert_file", files.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile("tls.key_file", files.key_file);
  if (!key.ok()) return key.status();

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (files.mode == TlsMode::kMtls) {
    absl::StatusOr<std::string> ca = ReadPemFile("tls.client_ca_file", files.client_ca_file);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace kvcellar::server
