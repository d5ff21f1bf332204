// PeerIdentity: who is on the other end of an RPC, as the transport proved it (never as the
// request says). A session is bound to the identity that registered it, and tenants are granted
// to identities (tenant_access.h; DESIGN.md, Security).
//
//   kUnix         the engine socket: the peer process's uid, gid and pid, from the kernel
//                 (SO_PEERCRED, taken when the daemon accepted the connection).
//   kCertificate  TCP with mutual TLS: the subject of the verified client certificate.
//   kNetwork      TCP without a client certificate: the peer's address (host, not port). Proves
//                 little; such peers get no tenant that the operator granted to identities.
//   kInProcess    a call made in the daemon's own process (tests that drive handlers directly).
//
// Threads: a value type.
#ifndef KVCELLAR_SERVER_SESSION_PEER_IDENTITY_H_
#define KVCELLAR_SERVER_SESSION_PEER_IDENTITY_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvcellar::server {

struct PeerIdentity {
  enum class Kind { kInProcess, kUnix, kCertificate, kNetwork };
  Kind kind = Kind::kInProcess;
  uint32_t uid = 0;     // kUnix
  uint32_t gid = 0;     // kUnix: the primary group at connect time.
  int32_t pid = 0;      // kUnix: 0 when the peer's pid is not visible in the daemon's namespace.
  std::string subject;  // kCertificate
  std::string address;  // kNetwork

  // A Unix-socket peer as the kernel describes it (SO_PEERCRED).
  static PeerIdentity Unix(uint32_t uid, uint32_t gid, int32_t pid) {
    PeerIdentity p;
    p.kind = Kind::kUnix;
    p.uid = uid;
    p.gid = gid;
    p.pid = pid;
    return p;
  }

  // Equal identities may use each other's sessions: the same process on the Unix socket (uid,
  // gid and pid), the same certificate subject, the same network host.
  bool operator==(const PeerIdentity&) const = default;

  // The same user behind both, whatever the process: uid and gid on the Unix socket, else the
  // same identity. An engine restarted by its supervisor is a new process of the same
  // principal: it may take over its instance's seats (replace_existing), and every rank of an
  // instance must be of one principal.
  bool SamePrincipal(const PeerIdentity& other) const {
    if (kind != other.kind) return false;
    if (kind == Kind::kUnix) return uid == other.uid && gid == other.gid;
    return *this == other;
  }

  // For errors, logs and listings: "uid 1000 gid 1000 pid 4242", "certificate CN=a,O=b", ...
  std::string Describe() const {
    switch (kind) {
      case Kind::kUnix:
        return absl::StrCat("uid ", uid, " gid ", gid, " pid ", pid);
      case Kind::kCertificate:
        return absl::StrCat("certificate '", subject, "'");
      case Kind::kNetwork:
        return absl::StrCat("address ", address, " (no client certificate)");
      case Kind::kInProcess:
        break;
    }
    return "the daemon's own process";
  }
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_PEER_IDENTITY_H_
