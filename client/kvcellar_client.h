// libkvcellar-client: the C++ API an inference engine links to use kvcellard, the node's KV-cache
// daemon (DESIGN.md, docs/api.md). C callers and Python use kvcellar_client_c.h.
//
//   auto client = kvcellar::client::Client::Connect({.addr = "/run/kvcellar/kvcellard.sock"});
//   auto session = (*client)->Register(registration);      // one per TP rank
//   MatchReply m = (*session)->Match({{.tokens = prompt}}, {.pin = true});
//   OpResult load = (*session)->Load({{.keys = ..., .blocks = ..., .pin_id = ...}});
//   ... run the layers; WaitOps({load.ref}) before committing the step ...
//   OpResult backup = (*session)->Backup({{.keys = new_keys, .blocks = ...}}, {...ready...});
//   ... WaitOps({backup.ref}) before reusing those blocks ...
//
// Failure semantics (DESIGN.md "Failure semantics"): the cache never fails the engine. A daemon
// that is down, restarting or slow makes Match return zero hits and Load/Backup return "not done"
// within ClientOptions::rpc_timeout; nothing throws, nothing blocks past its deadline, and
// Client::stats() counts every such event. A background thread renews session leases and, when
// the daemon restarts or forgets the session, registers again with backoff; the engine keeps
// using the same Session object. Page keys are computed here from the namespace (core/), and a
// session whose daemon disagrees on the namespace digest is never used (logged once).
//
// Threading: Client and Session are thread-safe. Destroy Sessions before their Client (a Session
// that outlives it keeps working but is no longer renewed).
#ifndef KVCELLAR_CLIENT_KVCELLAR_CLIENT_H_
#define KVCELLAR_CLIENT_KVCELLAR_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/client_types.h"
#include "client/session.h"

namespace kvcellar::client {

class ClientCore;

class Client {
 public:
  // Builds the channel and starts the heartbeat thread. Does not wait for the daemon: an engine
  // starts whether or not kvcellard is up. Fails only on bad options (an unparsable address,
  // unreadable TLS files).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Registers one engine rank or scheduler. Waits at most options.register_timeout. When the
  // daemon cannot be reached (or answers UNAVAILABLE/UNIMPLEMENTED) the Session is returned in
  // kConnecting state and registers in the background; every call misses until then. Errors:
  // INVALID_ARGUMENT for a registration that fails client-side checks, and the daemon's error
  // when it rejects the registration (bad layout, GROUP_MISMATCH, SESSION_EXISTS, ...).
  absl::StatusOr<std::unique_ptr<Session>> Register(EngineRegistration registration);

  ClientStats stats() const;
  // The gRPC target ("unix:/path", "dns:host:port").
  const std::string& target() const;

 private:
  explicit Client(std::shared_ptr<ClientCore> core) : core_(std::move(core)) {}
  std::shared_ptr<ClientCore> core_;
};

// The keys of every full page of `tokens` in namespace `ns` (docs/keys.md). Same as
// Session::ComputeKeys, without a session.
std::vector<core::PageKey> ComputePageKeys(const core::NamespaceSpec& ns,
                                           absl::Span<const uint32_t> tokens);

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_KVCELLAR_CLIENT_H_
