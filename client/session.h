// Session: one registered engine rank (or scheduler process) of libkvcellar-client.
//
// A Session is what Client::Register returns. It hides the daemon's session id, which changes
// every time the library re-registers (daemon restart, lease lapse): the engine keeps one Session
// for its lifetime. Every data call is bounded by ClientOptions::rpc_timeout and never fails the
// engine: when the daemon is down, restarting, slow, or disagrees on the key spec, Match answers
// zero hits, Load and Backup answer "nothing done", and stats() counts it.
//
// Op lifetimes across re-registrations. Ops are named by OpRef {op_id, generation}. When a session
// is lost, its ops are reported kFailed only once the library knows the daemon no longer touches
// their device blocks: the daemon said the session is unknown, a new daemon epoch answered, the
// re-registration (which replaces the old session) succeeded, or lease_ms passed since the last
// renewal. Until then WaitOps reports them kPending with a non-OK status. A Load or Backup whose
// reply the transport lost has an unknown outcome; the library then replaces the session to learn
// it, so the same rule bounds how long the engine must keep those blocks.
//
// Threading: every method is thread-safe; engines call Match from the scheduler and Load/Backup/
// WaitOps from model-runner threads concurrently.
#ifndef KVCELLAR_CLIENT_SESSION_H_
#define KVCELLAR_CLIENT_SESSION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client_types.h"

namespace kvcellar::client {

class SessionImpl;

class Session {
 public:
  ~Session();  // Close().
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // The current registration (session_id 0 while not registered) and state.
  SessionInfo info() const;
  SessionState state() const;
  // Blocks until the session is kActive (true) or the timeout passes (false).
  bool WaitUntilActive(absl::Duration timeout) const;

  // The keys of every full page of `tokens` (docs/keys.md), computed locally.
  std::vector<core::PageKey> ComputeKeys(absl::Span<const uint32_t> tokens) const;

  MatchReply Match(absl::Span<const MatchSequence> sequences, const MatchOptions& options = {});
  OpResult Load(absl::Span<const LoadSequence> sequences, const LoadOptions& options = {});
  OpResult Backup(absl::Span<const BackupSequence> sequences, const BackupOptions& options = {});
  // One result per ref, in order. Returns within options.timeout + rpc_timeout.
  std::vector<OpResult> WaitOps(absl::Span<const OpRef> ops, const WaitOptions& options = {});
  ReleaseReply Release(absl::Span<const uint64_t> pin_ids, absl::Span<const OpRef> cancel_ops = {});

  // Whether the op's session has ended (daemon restart, lease lapse, replacement): the daemon
  // will neither finish nor signal it any more, and its device blocks are the engine's again.
  // Local; no RPC.
  bool Ended(const OpRef& op) const;

  // SIM engines with a completion channel: waits for layer `layer` of the Load `op`, submitted
  // with signal_layers on `slot`, to be signalled ("the daemon is done with the layer", not "it
  // succeeded"). WaitLoadSignal waits for the op word: OK when the Load is DONE, ABORTED when it
  // failed. Both return UNAVAILABLE as soon as the op's session is known to have ended (a dead
  // daemon signals nothing: recompute), DEADLINE_EXCEEDED at the deadline, and
  // FAILED_PRECONDITION without a SIM channel.
  absl::Status WaitLayerSignal(const OpRef& op, uint32_t slot, uint32_t layer,
                               absl::Time deadline) const;
  absl::Status WaitLoadSignal(const OpRef& op, uint32_t slot, absl::Time deadline) const;

  // Pins whose leases every Heartbeat renews until they are released (Release, or a Load with
  // release_pin) or the daemon reports them unknown.
  void KeepPinsAlive(absl::Span<const uint64_t> pin_ids);

  // Unregisters (waiting up to drain_timeout for unfinished ops) and stops re-registering. Later
  // calls miss. Idempotent: a second call returns an empty reply.
  CloseReply Close(absl::Duration drain_timeout = absl::Seconds(1));

 private:
  friend class Client;
  explicit Session(std::shared_ptr<SessionImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<SessionImpl> impl_;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SESSION_H_
