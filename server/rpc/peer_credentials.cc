#include "server/rpc/peer_credentials.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"

namespace kvcellar::server {
namespace {

// "ipv4:10.0.0.1:5555" -> "10.0.0.1", "ipv6:[::1]:5555" -> "[::1]"; anything else unchanged.
std::string HostOf(const std::string& peer) {
  for (absl::string_view scheme : {"ipv4:", "ipv6:"}) {
    if (!absl::StartsWith(peer, scheme)) continue;
    absl::string_view hostport = absl::string_view(peer).substr(scheme.size());
    const size_t colon = hostport.rfind(':');
    return std::string(colon == absl::string_view::npos ? hostport : hostport.substr(0, colon));
  }
  return peer;
}

}  // namespace

void PeerCredentials::Record(int fd, const PeerIdentity& peer) {
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = peer;
}

PeerIdentity PeerCredentials::Identify(const grpc::ServerContextBase* context) const {
  PeerIdentity id;
  if (context == nullptr) return id;  // kInProcess
  std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    // mTLS: gRPC verified the chain during the handshake; the subject names the certificate.
    for (const grpc::string_ref& subject :
         auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME)) {
      id.kind = PeerIdentity::Kind::kCertificate;
      id.subject.assign(subject.data(), subject.size());
      return id;
    }
  }
  const std::string peer = context->peer();
  int fd = -1;
  if (absl::StartsWith(peer, "fd:") && absl::SimpleAtoi(peer.substr(3), &fd)) {
    absl::MutexLock lock(&mu_);
    auto it = by_fd_.find(fd);
    if (it != by_fd_.end()) return it->second;
  }
  id.kind = PeerIdentity::Kind::kNetwork;
  id.address = HostOf(peer);
  return id;
}

}  // namespace kvcellar::server
