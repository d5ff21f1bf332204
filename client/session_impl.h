// SessionImpl: the state machine behind a Session. Internal to libkvcellar-client.
//
//   kConnecting --register ok--> kActive <--probe ok-- kSuspect
//        ^                          |  \--transport error--^   |
//        |                          |                          |
//        +--- lost: session unknown, new daemon epoch, lease lapsed, or a Load/Backup outcome
//             lost in transport (forced: the re-registration replaces the old session)
//   kActive --ns_digest mismatch at registration--> kRefused (never used again)
//   any --Close()--> kClosed
//
// Generations. Each successful registration starts generation g+1. Every generation before the
// current one is "ended": the daemon no longer touches the device blocks of its ops. The current
// one may be lost but not yet ended (current_lost_), until re-registration or the lease deadline
// confirms it. OpRef.generation lets WaitOps tell which of these an op belongs to.
//
// Threading: data calls from any thread; Tick() from the client's heartbeat thread. mu_ guards the
// state; no RPC is made while holding it.
#ifndef KVCELLAR_CLIENT_SESSION_IMPL_H_
#define KVCELLAR_CLIENT_SESSION_IMPL_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/backoff.h"
#include "client/client_core.h"
#include "client/client_types.h"
#include "client/key_chain_cache.h"
#include "client/sim_signals.h"
#include "kvcellar/v1/cache_service.pb.h"

namespace kvcellar::client {

class SessionImpl {
 public:
  SessionImpl(std::shared_ptr<ClientCore> core, EngineRegistration reg);

  // Client-side checks before anything is sent: INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
  // The first registration, synchronous. OK when registered or when the daemon could not be
  // reached (the heartbeat thread keeps trying); the daemon's error when it rejected the request.
  absl::Status RegisterFirst();
  // Heartbeat thread: does whatever is due (heartbeat, probe, re-registration) and returns when
  // it next wants to run.
  absl::Time Tick(absl::Time now);

  SessionInfo info() const;
  SessionState state() const;
  bool WaitUntilActive(absl::Duration timeout) const;
  std::vector<core::PageKey> ComputeKeys(absl::Span<const uint32_t> tokens) const;

  MatchReply Match(absl::Span<const MatchSequence> sequences, const MatchOptions& options);
  OpResult Load(absl::Span<const LoadSequence> sequences, const LoadOptions& options);
  OpResult Backup(absl::Span<const BackupSequence> sequences, const BackupOptions& options);
  std::vector<OpResult> WaitOps(absl::Span<const OpRef> ops, const WaitOptions& options);
  ReleaseReply Release(absl::Span<const uint64_t> pin_ids, absl::Span<const OpRef> cancel_ops);
  void KeepPinsAlive(absl::Span<const uint64_t> pin_ids);
  bool Ended(const OpRef& op) const;
  absl::Status WaitSignal(const OpRef& op, uint32_t slot, int layer, absl::Time deadline) const;
  CloseReply Close(absl::Duration drain_timeout);

 private:
  // A data call's view of the session, taken under mu_ before the RPC.
  struct Call {
    uint64_t session_id = 0;
    uint64_t generation = 0;
  };
  // How an RPC ended, for the caller.
  enum class Outcome {
    kOk,
    kRejected,        // The daemon (or gRPC before sending) refused it: nothing was done.
    kSessionUnknown,  // The daemon does not know the session: nothing was done; re-register.
    kTransport,       // Lost in transport or timed out: the daemon may or may not have acted.
  };

  // nullopt (and a degraded call counted) unless the session is kActive.
  std::optional<Call> BeginCall();
  // Counts the RPC, reads the error reason, and moves the state machine: session unknown ->
  // lost (ended); transport failure -> suspect, or for a Load/Backup (`touches_blocks`) lost
  // (not yet ended: the session is replaced to settle the op).
  Outcome AfterCall(const Call& call, const grpc::Status& status, const grpc::ClientContext& ctx,
                    bool touches_blocks);
  // A fresh OpResult for a call that was not (or not known to be) accepted: every page MISS.
  OpResult FailedOp(OpKind kind, uint64_t generation, size_t num_sequences,
                    absl::Span<const size_t> pages, absl::Status status) const;

  absl::Status TryRegister(bool first);
  void Heartbeat(absl::Time now);
  void MarkLostLocked(absl::string_view reason, bool ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SuspectLocked(absl::string_view reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Turns a lost generation into an ended one once its lease deadline has passed.
  void ResolveLostLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EndedLocked(const OpRef& op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration HeartbeatIntervalLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration LeaseGraceLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<ClientCore> core_;
  // Blocks a Load or Backup names per page: one, or one per KV group of a hybrid namespace.
  size_t BlocksPerPage() const { return reg_.ns.Hybrid() ? reg_.ns.NumGroups() : 1; }

  const EngineRegistration reg_;
  const core::PageKey ns_digest_;
  // Keys of recent token sequences (the engine's conversations); thread-safe on its own.
  const std::unique_ptr<KeyChainCache> key_cache_;
  const v1::RegisterEngineRequest register_request_;
  // SIM: the engine's signal region, zeroed before every re-registration (a new daemon restarts
  // op ids, and stale larger ids would satisfy the engine's "word >= op_id" waits early).
  SimSignalRegion sim_signals_;

  mutable absl::Mutex mu_;
  mutable absl::CondVar cv_;  // Signalled on every state or generation change.
  SessionState state_ ABSL_GUARDED_BY(mu_) = SessionState::kConnecting;
  SessionInfo info_ ABSL_GUARDED_BY(mu_);
  // info_.page_tokens, read by Backup without mu_.
  std::atomic<bool> page_tokens_{false};
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Generations <= this have ended. Mutable: a const observer may learn that the lease ran out.
  mutable uint64_t ended_through_ ABSL_GUARDED_BY(mu_) = 0;
  mutable bool current_lost_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time lost_end_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_renewal_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time next_heartbeat_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time next_attempt_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  Backoff backoff_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> keep_pins_ ABSL_GUARDED_BY(mu_);
  bool mismatch_logged_ ABSL_GUARDED_BY(mu_) = false;
  int last_register_error_ ABSL_GUARDED_BY(mu_) = -1;  // grpc code last logged.
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SESSION_IMPL_H_
