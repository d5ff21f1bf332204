#include "client/session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/proto_convert.h"
#include "client/session_impl.h"
#include "client/sim_signals.h"
#include "platform/log.h"

namespace kvcellar::client {
namespace {

constexpr char kErrorReasonKey[] = "kvcellar-error-reason";
constexpr char kSessionUnknownReason[] = "ERROR_REASON_SESSION_UNKNOWN";
constexpr char kNotReadyReason[] = "ERROR_REASON_NOT_READY";
// Before the daemon's answer tells us the lease: the proto's default (config sessions.lease_ms).
constexpr uint32_t kDefaultLeaseMs = 10000;
// A daemon ends a lapsed session on its own schedule after the deadline; wait at least this long
// past it before assuming it did.
constexpr absl::Duration kMinLeaseGrace = absl::Seconds(1);

std::string ErrorReason(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(kErrorReasonKey);
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::Status ToAbsl(const grpc::Status& s, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

// gRPC codes with which the call may have reached the daemon and been acted on, its reply lost.
bool OutcomeUnknown(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::DATA_LOSS:
      return true;
    default:
      return false;
  }
}

// Registration errors worth retrying: the daemon is down, slow, starting, too old, or full.
bool RetryableRegisterError(grpc::StatusCode code) {
  return OutcomeUnknown(code) || code == grpc::StatusCode::UNIMPLEMENTED ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

absl::Status NotActive(SessionState state) {
  return absl::UnavailableError(
      absl::StrCat("kvcellar session is ", SessionStateName(state), ": answered as a miss"));
}

uint32_t ToMs(absl::Duration d) {
  return static_cast<uint32_t>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 0, UINT32_MAX));
}

}  // namespace

// ---- Session (public handle)
// ---------------------------------------------------------------------

Session::~Session() { impl_->Close(absl::Seconds(1)); }
SessionInfo Session::info() const { return impl_->info(); }
SessionState Session::state() const { return impl_->state(); }
bool Session::WaitUntilActive(absl::Duration timeout) const {
  return impl_->WaitUntilActive(timeout);
}
std::vector<core::PageKey> Session::ComputeKeys(absl::Span<const uint32_t> tokens) const {
  return impl_->ComputeKeys(tokens);
}
MatchReply Session::Match(absl::Span<const MatchSequence> sequences, const MatchOptions& options) {
  return impl_->Match(sequences, options);
}
OpResult Session::Load(absl::Span<const LoadSequence> sequences, const LoadOptions& options) {
  return impl_->Load(sequences, options);
}
OpResult Session::Backup(absl::Span<const BackupSequence> sequences, const BackupOptions& options) {
  return impl_->Backup(sequences, options);
}
std::vector<OpResult> Session::WaitOps(absl::Span<const OpRef> ops, const WaitOptions& options) {
  return impl_->WaitOps(ops, options);
}
ReleaseReply Session::Release(absl::Span<const uint64_t> pin_ids,
                              absl::Span<const OpRef> cancel_ops) {
  return impl_->Release(pin_ids, cancel_ops);
}
void Session::KeepPinsAlive(absl::Span<const uint64_t> pin_ids) { impl_->KeepPinsAlive(pin_ids); }
bool Session::Ended(const OpRef& op) const { return impl_->Ended(op); }
absl::Status Session::WaitLayerSignal(const OpRef& op, uint32_t slot, uint32_t layer,
                                      absl::Time deadline) const {
  return impl_->WaitSignal(op, slot, static_cast<int>(layer), deadline);
}
absl::Status Session::WaitLoadSignal(const OpRef& op, uint32_t slot, absl::Time deadline) const {
  return impl_->WaitSignal(op, slot, -1, deadline);
}
CloseReply Session::Close(absl::Duration drain_timeout) { return impl_->Close(drain_timeout); }

// ---- SessionImpl: registration and the state machine --------------------------------------------

SessionImpl::SessionImpl(std::shared_ptr<ClientCore> core, EngineRegistration reg)
    : core_(std::move(core)),
      reg_(std::move(reg)),
      ns_digest_(reg_.ns.Digest()),
      key_cache_(std::make_unique<KeyChainCache>(ns_digest_, reg_.ns.page_size,
                                                 core_->options().key_cache_bytes)),
      register_request_(ToRegisterRequest(reg_)),
      backoff_(core_->options().reconnect_backoff_min, core_->options().reconnect_backoff_max) {
  info_.ns_digest = ns_digest_;
  if (!reg_.scheduler && reg_.device_kind == DeviceKind::kSim &&
      !reg_.completion.sim_shm_name.empty() && reg_.completion.sim_size_bytes > 0) {
    // Opened now, while the engine certainly has it; a failure here shows up at registration.
    absl::StatusOr<SimSignalRegion> r = SimSignalRegion::Open(reg_.completion.sim_shm_name);
    if (r.ok()) sim_signals_ = *std::move(r);
  }
}

absl::Status SessionImpl::Validate() const {
  if (reg_.instance_id.empty()) return absl::InvalidArgumentError("instance_id is empty");
  if (absl::Status s = reg_.ns.Validate(); !s.ok()) return s;
  if (reg_.scheduler) return absl::OkStatus();
  if (reg_.rank >= reg_.ns.tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank (", reg_.rank, ") must be < ns.tp_size (", reg_.ns.tp_size, ")"));
  }
  if (reg_.device_kind != DeviceKind::kSim && reg_.device_kind != DeviceKind::kCuda) {
    return absl::InvalidArgumentError("device_kind must be kSim or kCuda for a worker");
  }
  if (!reg_.device_uuid.empty() && reg_.device_uuid.size() != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_uuid must be 16 bytes, not ", reg_.device_uuid.size()));
  }
  if (absl::Status s = reg_.layout.Validate(); !s.ok()) return s;
  if (reg_.layout.is_mla() != (reg_.ns.layout == core::LayoutKind::kMla)) {
    return absl::InvalidArgumentError(
        "layout shape (MLA: one buffer per layer) and ns.layout differ");
  }
  return absl::OkStatus();
}

absl::Status SessionImpl::RegisterFirst() {
  absl::Status s = TryRegister(/*first=*/true);
  if (s.ok()) return s;
  if (RetryableRegisterError(static_cast<grpc::StatusCode>(s.code()))) {
    absl::MutexLock lock(&mu_);
    next_attempt_ = absl::Now() + backoff_.Next();
    return absl::OkStatus();  // Connecting: the engine runs, and every call is a miss until then.
  }
  return s;
}

absl::Status SessionImpl::TryRegister(bool first) {
  v1::RegisterEngineRequest req = register_request_;
  // Every retry replaces: the live session holding (instance, rank) is most likely ours, from an
  // attempt whose reply was lost, or the one this process lost.
  req.set_replace_existing(first ? reg_.replace_existing : true);
  bool reregistration = false;
  {
    absl::MutexLock lock(&mu_);
    if (state_ == SessionState::kClosed) return absl::CancelledError("session closed");
    reregistration = generation_ > 0;
  }
  if (reregistration && sim_signals_.valid()) sim_signals_.ResetCounters();

  grpc::ClientContext ctx;
  ClientCore::SetDeadline(
      &ctx, first ? core_->options().register_timeout
                  : std::max(core_->options().register_timeout, core_->options().rpc_timeout));
  v1::RegisterEngineResponse resp;
  const grpc::Status st = core_->stub().RegisterEngine(&ctx, req, &resp);
  core_->CountRpc(st);
  StatsCounters& stats = core_->stats();
  if (!st.ok()) {
    StatsCounters::Add(stats.registration_failures);
    absl::MutexLock lock(&mu_);
    if (last_register_error_ != st.error_code()) {
      last_register_error_ = st.error_code();
      KVLOG(Warn, "kvcellar client: register failed",
            {{"instance", reg_.instance_id},
             {"rank", reg_.rank},
             {"code", static_cast<int>(st.error_code())},
             {"reason", ErrorReason(ctx)},
             {"error", st.error_message()}});
    }
    return ToAbsl(st, "RegisterEngine");
  }
  const absl::Time now = absl::Now();

  bool refused = false;
  {
    absl::MutexLock lock(&mu_);
    if (state_ == SessionState::kClosed) {
      // Closed while registering: undo below, outside the lock.
      refused = true;
    } else {
      StatsCounters::Add(stats.registrations);
      if (generation_ > 0) StatsCounters::Add(stats.reregistrations);
      // The old session (if any) was replaced, or belonged to a daemon that is gone.
      ended_through_ = generation_;
      current_lost_ = false;
      lost_end_deadline_ = absl::InfiniteFuture();
      ++generation_;
      keep_pins_.clear();
      last_register_error_ = -1;
      info_.session_id = resp.session_id();
      info_.generation = generation_;
      info_.daemon_epoch = resp.daemon_epoch();
      info_.lease_ms = resp.lease_ms();
      info_.heartbeat_interval_ms = resp.heartbeat_interval_ms();
      info_.shard_index = resp.shard_index();
      info_.num_shards = resp.num_shards();
      info_.is_shard_writer = resp.is_shard_writer();
      info_.page_object_bytes = resp.page_object_bytes();
      info_.default_write_policy = static_cast<uint32_t>(resp.default_write_policy());
      info_.default_prefetch_policy = static_cast<uint32_t>(resp.default_prefetch_policy());
      info_.api_revision = resp.api_revision();
      info_.max_batch_pages = resp.limits().max_batch_pages();
      info_.max_batch_sequences = resp.limits().max_batch_sequences();
      info_.max_wait_ms = resp.limits().max_wait_ms();
      info_.page_tokens = resp.limits().page_tokens();
      page_tokens_.store(info_.page_tokens, std::memory_order_relaxed);
      info_.daemon_version = resp.daemon_version();
      info_.l3_tier_names.assign(resp.l3_tier_names().begin(), resp.l3_tier_names().end());
      last_renewal_ = now;
      backoff_.Reset();
      if (resp.ns_digest() != ns_digest_.AsBytes()) {
        // The daemon and this library disagree on the key spec: keys we compute would name other
        // pages. Wrong KV is the worst failure, so this session never uses the cache.
        refused = true;
        state_ = SessionState::kRefused;
        StatsCounters::Add(stats.ns_digest_mismatches);
        if (!mismatch_logged_) {
          mismatch_logged_ = true;
          std::string theirs = resp.ns_digest();
          absl::StatusOr<core::PageKey> k = core::PageKey::FromBytes(theirs);
          KVLOG(Error, "kvcellar client: ns_digest mismatch, refusing to use the cache",
                {{"instance", reg_.instance_id},
                 {"rank", reg_.rank},
                 {"ours", ns_digest_.Hex()},
                 {"daemon", k.ok() ? k->Hex() : absl::StrCat(theirs.size(), " bytes")}});
        }
      } else {
        state_ = SessionState::kActive;
        next_heartbeat_ = now + HeartbeatIntervalLocked();
      }
    }
    cv_.SignalAll();
  }
  if (refused) {
    grpc::ClientContext uctx;
    ClientCore::SetDeadline(&uctx, core_->options().rpc_timeout);
    v1::UnregisterEngineRequest ureq;
    ureq.set_session_id(resp.session_id());
    v1::UnregisterEngineResponse uresp;
    core_->CountRpc(core_->stub().UnregisterEngine(&uctx, ureq, &uresp));
  }
  return absl::OkStatus();
}

absl::Duration SessionImpl::HeartbeatIntervalLocked() const {
  if (core_->options().heartbeat_interval > absl::ZeroDuration()) {
    return core_->options().heartbeat_interval;
  }
  if (info_.heartbeat_interval_ms > 0) return absl::Milliseconds(info_.heartbeat_interval_ms);
  const uint32_t lease = info_.lease_ms > 0 ? info_.lease_ms : kDefaultLeaseMs;
  return absl::Milliseconds(lease / 3);
}

absl::Duration SessionImpl::LeaseGraceLocked() const {
  const uint32_t lease = info_.lease_ms > 0 ? info_.lease_ms : kDefaultLeaseMs;
  return std::max({kMinLeaseGrace, absl::Milliseconds(lease / 4), core_->options().rpc_timeout});
}

void SessionImpl::MarkLostLocked(absl::string_view reason, bool ended) {
  if (state_ != SessionState::kActive && state_ != SessionState::kSuspect) return;
  StatsCounters::Add(core_->stats().sessions_lost);
  KVLOG(Warn, "kvcellar client: session lost",
        {{"instance", reg_.instance_id},
         {"rank", reg_.rank},
         {"session", info_.session_id},
         {"generation", generation_},
         {"reason", reason},
         {"ended", ended ? "yes" : "unknown"}});
  state_ = SessionState::kConnecting;
  info_.session_id = 0;
  keep_pins_.clear();
  if (ended) {
    ended_through_ = generation_;
    current_lost_ = false;
  } else {
    current_lost_ = true;
    const uint32_t lease = info_.lease_ms > 0 ? info_.lease_ms : kDefaultLeaseMs;
    lost_end_deadline_ = last_renewal_ + absl::Milliseconds(lease) + LeaseGraceLocked();
  }
  // A restarted daemon is usually back within a second: try now, then from the minimum delay
  // (probes of the suspect phase may have grown the backoff to its maximum).
  next_attempt_ = absl::Now();
  backoff_.Reset();
  next_heartbeat_ = absl::InfiniteFuture();
  cv_.SignalAll();
  core_->Wake();
}

void SessionImpl::SuspectLocked(absl::string_view reason) {
  if (state_ != SessionState::kActive) return;
  state_ = SessionState::kSuspect;
  next_heartbeat_ = absl::Now();  // Probe at once; backoff after that.
  cv_.SignalAll();
  core_->Wake();
}

void SessionImpl::ResolveLostLocked(absl::Time now) const {
  if (current_lost_ && now >= lost_end_deadline_) {
    // The lease has run out without a renewal: the daemon, if alive, has ended the session.
    ended_through_ = generation_;
    current_lost_ = false;
    cv_.SignalAll();
  }
}

absl::Time SessionImpl::Tick(absl::Time now) {
  enum { kNothing, kRegister, kHeartbeat } work = kNothing;
  {
    absl::MutexLock lock(&mu_);
    ResolveLostLocked(now);
    switch (state_) {
      case SessionState::kConnecting:
        if (now >= next_attempt_) work = kRegister;
        break;
      case SessionState::kActive:
      case SessionState::kSuspect:
        if (now >= next_heartbeat_) work = kHeartbeat;
        break;
      default:
        return absl::InfiniteFuture();
    }
  }
  if (work == kRegister) {
    absl::Status s = TryRegister(/*first=*/false);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && state_ == SessionState::kConnecting)
      next_attempt_ = absl::Now() + backoff_.Next();
  } else if (work == kHeartbeat) {
    Heartbeat(now);
  }
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  if (state_ == SessionState::kConnecting) next = next_attempt_;
  if (state_ == SessionState::kActive || state_ == SessionState::kSuspect) next = next_heartbeat_;
  if (current_lost_) next = std::min(next, lost_end_deadline_);
  return next;
}

void SessionImpl::Heartbeat(absl::Time now) {
  v1::HeartbeatRequest req;
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    req.set_session_id(info_.session_id);
    generation = generation_;
    for (uint64_t pin : keep_pins_) req.add_renew_pin_ids(pin);
  }
  grpc::ClientContext ctx;
  ClientCore::SetDeadline(&ctx, core_->options().rpc_timeout);
  v1::HeartbeatResponse resp;
  const grpc::Status st = core_->stub().Heartbeat(&ctx, req, &resp);
  core_->CountRpc(st);
  const absl::Time done = absl::Now();

  absl::MutexLock lock(&mu_);
  if (generation != generation_ ||
      (state_ != SessionState::kActive && state_ != SessionState::kSuspect)) {
    return;  // The session changed while the heartbeat was out.
  }
  StatsCounters& stats = core_->stats();
  if (st.ok()) {
    StatsCounters::Add(stats.heartbeats_ok);
    if (resp.state() != v1::SESSION_STATE_ACTIVE) {
      // UNKNOWN, or a state this revision does not know: both mean register again.
      MarkLostLocked("daemon reports the session unknown", /*ended=*/true);
      return;
    }
    if (resp.daemon_epoch() != 0 && resp.daemon_epoch() != info_.daemon_epoch) {
      MarkLostLocked("daemon epoch changed", /*ended=*/true);
      return;
    }
    last_renewal_ = done;
    backoff_.Reset();
    for (uint64_t pin : resp.unknown_pin_ids()) keep_pins_.erase(pin);
    if (resp.draining()) {
      // The daemon is shutting down: stop submitting; it will be gone within its drain timeout.
      state_ = SessionState::kSuspect;
      next_heartbeat_ = done + std::min(HeartbeatIntervalLocked(), backoff_.Next());
    } else {
      if (state_ != SessionState::kActive) cv_.SignalAll();
      state_ = SessionState::kActive;
      next_heartbeat_ = done + HeartbeatIntervalLocked();
    }
    return;
  }
  StatsCounters::Add(stats.heartbeats_failed);
  if (ErrorReason(ctx) == kSessionUnknownReason) {
    MarkLostLocked("daemon reports the session unknown", /*ended=*/true);
    return;
  }
  const uint32_t lease = info_.lease_ms > 0 ? info_.lease_ms : kDefaultLeaseMs;
  if (done >= last_renewal_ + absl::Milliseconds(lease) + LeaseGraceLocked()) {
    MarkLostLocked(absl::StrCat("no renewal within the lease: ", st.error_message()),
                   /*ended=*/true);
    return;
  }
  if (state_ == SessionState::kActive) {
    state_ = SessionState::kSuspect;
    cv_.SignalAll();
  }
  next_heartbeat_ = done + std::min(HeartbeatIntervalLocked(), backoff_.Next());
  (void)now;
}

// ---- Observers
// -----------------------------------------------------------------------------------

SessionInfo SessionImpl::info() const {
  absl::MutexLock lock(&mu_);
  return info_;
}

SessionState SessionImpl::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

bool SessionImpl::WaitUntilActive(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (state_ != SessionState::kActive) {
    if (state_ == SessionState::kRefused || state_ == SessionState::kClosed) return false;
    if (cv_.WaitWithDeadline(&mu_, deadline)) return state_ == SessionState::kActive;
  }
  return true;
}

std::vector<core::PageKey> SessionImpl::ComputeKeys(absl::Span<const uint32_t> tokens) const {
  size_t reused = 0;
  std::vector<core::PageKey> keys = key_cache_->Keys(tokens, &reused);
  StatsCounters& stats = core_->stats();
  StatsCounters::Add(stats.keyed_pages, keys.size());
  StatsCounters::Add(stats.keyed_pages_reused, reused);
  return keys;
}

void SessionImpl::KeepPinsAlive(absl::Span<const uint64_t> pin_ids) {
  absl::MutexLock lock(&mu_);
  for (uint64_t pin : pin_ids) {
    if (pin != 0) keep_pins_.insert(pin);
  }
}

bool SessionImpl::EndedLocked(const OpRef& op) const {
  ResolveLostLocked(absl::Now());
  if (op.generation == 0 || op.generation > generation_) return true;  // Never accepted.
  if (op.generation <= ended_through_) return true;
  // The current generation: an op whose submission failed outright never started; one whose
  // outcome was lost (op_id 0 in a lost generation) is settled with the generation.
  return op.op_id == 0 && !current_lost_;
}

bool SessionImpl::Ended(const OpRef& op) const {
  absl::MutexLock lock(&mu_);
  return EndedLocked(op);
}

absl::Status SessionImpl::WaitSignal(const OpRef& op, uint32_t slot, int layer,
                                     absl::Time deadline) const {
  if (!sim_signals_.valid()) {
    return absl::FailedPreconditionError("the session has no SIM completion channel");
  }
  // Short slices between liveness checks: a daemon that died mid-Load never signals, and the
  // engine should recompute as soon as that is known rather than at its deadline.
  constexpr absl::Duration kSlice = absl::Milliseconds(5);
  for (;;) {
    if (op.op_id == 0 || Ended(op)) {
      return absl::UnavailableError(
          absl::StrCat("load op ", op.op_id, " ended with its session: it will not be signalled"));
    }
    const absl::Time until = std::min(deadline, absl::Now() + kSlice);
    absl::Status s =
        layer >= 0 ? sim_signals_.WaitLayer(slot, static_cast<uint32_t>(layer), op.op_id, until)
                   : sim_signals_.WaitOp(slot, op.op_id, until);
    if (s.code() != absl::StatusCode::kDeadlineExceeded || until >= deadline) return s;
  }
}

// ---- Data calls
// ----------------------------------------------------------------------------------

std::optional<SessionImpl::Call> SessionImpl::BeginCall() {
  absl::MutexLock lock(&mu_);
  ResolveLostLocked(absl::Now());
  if (state_ != SessionState::kActive) {
    StatsCounters::Add(core_->stats().degraded_calls);
    return std::nullopt;
  }
  return Call{info_.session_id, generation_};
}

SessionImpl::Outcome SessionImpl::AfterCall(const Call& call, const grpc::Status& status,
                                            const grpc::ClientContext& ctx, bool touches_blocks) {
  core_->CountRpc(status);
  if (status.ok()) return Outcome::kOk;
  const std::string reason = ErrorReason(ctx);
  absl::MutexLock lock(&mu_);
  const bool current = call.generation == generation_;
  if (reason == kSessionUnknownReason) {
    if (current) MarkLostLocked("daemon reports the session unknown", /*ended=*/true);
    return Outcome::kSessionUnknown;
  }
  if (!reason.empty()) {
    // The daemon answered: the request was rejected whole and nothing was done.
    if (reason == kNotReadyReason && current) SuspectLocked("daemon not ready");
    return Outcome::kRejected;
  }
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    if (current) SuspectLocked("CacheService unimplemented");
    return Outcome::kRejected;
  }
  if (!OutcomeUnknown(status.error_code())) return Outcome::kRejected;
  if (touches_blocks) {
    // The daemon may have accepted this Load or Backup and may still copy into or out of its
    // blocks. Replacing the session is the only way to learn that it no longer does.
    StatsCounters::Add(core_->stats().uncertain_submissions);
    if (current) {
      MarkLostLocked(absl::StrCat("outcome of a submission lost: ", status.error_message()),
                     /*ended=*/false);
    }
  } else if (current) {
    SuspectLocked(status.error_message());
  }
  return Outcome::kTransport;
}

OpResult SessionImpl::FailedOp(OpKind kind, uint64_t generation, size_t num_sequences,
                               absl::Span<const size_t> pages, absl::Status status) const {
  OpResult r;
  r.kind = kind;
  r.ref.generation = generation;
  r.state = OpState::kFailed;
  r.status = std::move(status);
  r.sequences.resize(num_sequences);
  for (size_t i = 0; i < num_sequences; ++i) {
    r.sequences[i].page_status.assign(i < pages.size() ? pages[i] : 0, PageStatus::kMiss);
  }
  return r;
}

MatchReply SessionImpl::Match(absl::Span<const MatchSequence> sequences,
                              const MatchOptions& options) {
  MatchReply reply;
  reply.results.resize(sequences.size());
  StatsCounters& stats = core_->stats();
  StatsCounters::Add(stats.match_calls);

  v1::MatchRequest req;
  uint64_t pages = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const MatchSequence& seq = sequences[i];
    MatchResult& res = reply.results[i];
    v1::MatchSequence* ps = req.add_sequences();
    ps->set_num_computed_pages(seq.num_computed_pages);
    ps->set_request_id(seq.request_id);
    if (!seq.tokens.empty() && !seq.keys.empty()) {
      reply.status = absl::InvalidArgumentError(
          absl::StrCat("sequences[", i, "]: give tokens or keys, not both"));
      return reply;
    }
    if (!seq.tokens.empty()) {
      if (reg_.ns.opaque_keys) {
        reply.status = absl::InvalidArgumentError(
            absl::StrCat("sequences[", i, "]: tokens in an opaque-keys namespace"));
        return reply;
      }
      res.keys = ComputeKeys(seq.tokens);
      const size_t skip = std::min<size_t>(seq.num_computed_pages, res.keys.size());
      res.total_pages = static_cast<uint32_t>(res.keys.size() - skip);
      AppendKeys(absl::MakeConstSpan(res.keys).subspan(skip), ps->mutable_page_keys());
    } else {
      res.total_pages = static_cast<uint32_t>(seq.keys.size());
      AppendKeys(seq.keys, ps->mutable_page_keys());
    }
    pages += res.total_pages;
  }
  StatsCounters::Add(stats.match_pages, pages);

  std::optional<Call> call = BeginCall();
  if (!call.has_value()) {
    reply.status = NotActive(state());
    return reply;
  }
  req.set_session_id(call->session_id);
  req.set_step_id(options.step_id);
  req.set_pin(options.pin);
  req.set_pin_lease_ms(options.pin_lease_ms);
  req.set_prefetch_policy(static_cast<v1::PrefetchPolicy>(options.prefetch_policy));
  req.set_prefetch_timeout_ms(options.prefetch_timeout_ms);
  req.set_l3_lookup_timeout_ms(options.l3_lookup_timeout_ms);

  grpc::ClientContext ctx;
  ClientCore::SetDeadline(&ctx, core_->options().rpc_timeout);
  v1::MatchResponse resp;
  const grpc::Status st = core_->stub().Match(&ctx, req, &resp);
  if (AfterCall(*call, st, ctx, /*touches_blocks=*/false) != Outcome::kOk) {
    StatsCounters::Add(stats.degraded_calls);
    reply.status = ToAbsl(st, "Match");
    return reply;
  }
  if (static_cast<size_t>(resp.results_size()) != sequences.size()) {
    StatsCounters::Add(stats.degraded_calls);
    reply.status = absl::InternalError(absl::StrCat("Match: daemon answered ", resp.results_size(),
                                                    " results for ", sequences.size()));
    return reply;
  }
  uint64_t hits = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const v1::MatchResult& pr = resp.results(i);
    MatchResult& res = reply.results[i];
    // Never trust a count beyond what was asked: the engine indexes its keys with it.
    res.l2_hit_pages = std::min(pr.l2_hit_pages(), res.total_pages);
    res.l3_hit_pages = std::min(pr.l3_hit_pages(), res.total_pages - res.l2_hit_pages);
    res.prefetch_pages = pr.prefetch_pages();
    if (res.l3_hit_pages > 0) {
      res.l3_hit_pages_by_tier.assign(pr.l3_hit_pages_by_tier().begin(),
                                      pr.l3_hit_pages_by_tier().end());
    }
    res.pin_id = pr.pin_id();
    hits += res.l2_hit_pages;
  }
  StatsCounters::Add(stats.match_l2_hit_pages, hits);
  reply.prefetch_op = {resp.prefetch_op_id(), call->generation};
  reply.memoized = resp.memoized();
  return reply;
}

OpResult SessionImpl::Load(absl::Span<const LoadSequence> sequences, const LoadOptions& options) {
  std::vector<size_t> pages(sequences.size());
  v1::LoadRequest req;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const LoadSequence& seq = sequences[i];
    pages[i] = seq.keys.size();
    if (seq.keys.size() * BlocksPerPage() != seq.blocks.size()) {
      return FailedOp(OpKind::kLoad, 0, sequences.size(), pages,
                      absl::InvalidArgumentError(absl::StrCat(
                          "sequences[", i, "]: ", seq.keys.size(), " keys but ", seq.blocks.size(),
                          " blocks (", BlocksPerPage(), " per page)")));
    }
    v1::LoadSequence* ps = req.add_sequences();
    AppendKeys(seq.keys, ps->mutable_page_keys());
    (reg_.ns.Hybrid() ? ps->mutable_group_blocks() : ps->mutable_device_blocks())
        ->Add(seq.blocks.begin(), seq.blocks.end());
    ps->set_pin_id(seq.pin_id);
    ps->set_release_pin(seq.release_pin);
    ps->set_request_id(seq.request_id);
  }
  std::optional<Call> call = BeginCall();
  if (!call.has_value()) {
    return FailedOp(OpKind::kLoad, 0, sequences.size(), pages, NotActive(state()));
  }
  req.set_session_id(call->session_id);
  req.set_signal_layers(options.signal_layers);
  req.set_completion_slot(options.completion_slot);

  grpc::ClientContext ctx;
  ClientCore::SetDeadline(&ctx, core_->options().rpc_timeout);
  v1::LoadResponse resp;
  const grpc::Status st = core_->stub().Load(&ctx, req, &resp);
  const Outcome outcome = AfterCall(*call, st, ctx, /*touches_blocks=*/true);
  if (outcome == Outcome::kOk) {
    OpResult r;
    FromProto(resp.op(), &r);
    r.ref.generation = call->generation;
    absl::MutexLock lock(&mu_);
    for (const LoadSequence& seq : sequences) {
      if (seq.release_pin) keep_pins_.erase(seq.pin_id);
    }
    return r;
  }
  StatsCounters::Add(core_->stats().degraded_calls);
  OpResult r =
      FailedOp(OpKind::kLoad, call->generation, sequences.size(), pages, ToAbsl(st, "Load"));
  if (outcome == Outcome::kTransport) r.state = OpState::kPending;  // Settled by WaitOps.
  return r;
}

OpResult SessionImpl::Backup(absl::Span<const BackupSequence> sequences,
                             const BackupOptions& options) {
  std::vector<size_t> pages(sequences.size());
  v1::BackupRequest req;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const BackupSequence& seq = sequences[i];
    pages[i] = seq.keys.size();
    if (seq.keys.size() * BlocksPerPage() != seq.blocks.size()) {
      return FailedOp(OpKind::kBackup, 0, sequences.size(), pages,
                      absl::InvalidArgumentError(absl::StrCat(
                          "sequences[", i, "]: ", seq.keys.size(), " keys but ", seq.blocks.size(),
                          " blocks (", BlocksPerPage(), " per page)")));
    }
    v1::BackupSequence* ps = req.add_sequences();
    if (seq.has_parent) ps->set_parent_key(std::string(seq.parent.AsBytes()));
    AppendKeys(seq.keys, ps->mutable_page_keys());
    (reg_.ns.Hybrid() ? ps->mutable_group_blocks() : ps->mutable_device_blocks())
        ->Add(seq.blocks.begin(), seq.blocks.end());
    ps->set_request_id(seq.request_id);
    if (!seq.tokens.empty() && page_tokens_.load(std::memory_order_relaxed)) {
      ps->mutable_token_ids()->Add(seq.tokens.begin(), seq.tokens.end());
    }
  }
  std::optional<Call> call = BeginCall();
  if (!call.has_value()) {
    return FailedOp(OpKind::kBackup, 0, sequences.size(), pages, NotActive(state()));
  }
  req.set_session_id(call->session_id);
  if (options.has_ready) {
    req.mutable_ready()->set_slot(options.ready_slot);
    req.mutable_ready()->set_sim_token(options.ready_token);
  }
  req.set_write_policy(static_cast<v1::WritePolicy>(options.write_policy));
  req.set_ready_timeout_ms(options.ready_timeout_ms);

  grpc::ClientContext ctx;
  ClientCore::SetDeadline(&ctx, core_->options().rpc_timeout);
  v1::BackupResponse resp;
  const grpc::Status st = core_->stub().Backup(&ctx, req, &resp);
  const Outcome outcome = AfterCall(*call, st, ctx, /*touches_blocks=*/true);
  if (outcome == Outcome::kOk) {
    OpResult r;
    FromProto(resp.op(), &r);
    r.ref.generation = call->generation;
    return r;
  }
  StatsCounters::Add(core_->stats().degraded_calls);
  OpResult r =
      FailedOp(OpKind::kBackup, call->generation, sequences.size(), pages, ToAbsl(st, "Backup"));
  if (outcome == Outcome::kTransport) r.state = OpState::kPending;
  return r;
}

std::vector<OpResult> SessionImpl::WaitOps(absl::Span<const OpRef> ops,
                                           const WaitOptions& options) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + std::max(options.timeout, absl::ZeroDuration());
  std::vector<OpResult> out(ops.size());
  // Ops the daemon must answer for, and ops of a lost generation not yet known to be ended.
  std::vector<size_t> remote, lost;
  Call call;
  SessionState state;
  {
    absl::MutexLock lock(&mu_);
    ResolveLostLocked(start);
    state = state_;
    call = {info_.session_id, generation_};
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpRef& ref = ops[i];
      out[i].ref = ref;
      if (ref.generation == generation_ && current_lost_) {
        lost.push_back(i);
      } else if (ref.generation == 0 || ref.generation <= ended_through_ ||
                 ref.generation > generation_ || ref.op_id == 0) {
        out[i].state = OpState::kFailed;
        if (ref.op_id != 0 && ref.generation != 0 && ref.generation <= ended_through_) {
          out[i].status =
              absl::UnavailableError("the op's session ended (daemon restart or lease)");
          StatsCounters::Add(core_->stats().ops_failed_session_lost);
        } else {
          out[i].status = absl::UnavailableError("the op was never accepted by the daemon");
        }
      } else {
        remote.push_back(i);
      }
    }
  }

  if (!remote.empty()) {
    auto mark_pending = [&](absl::Status why) {
      for (size_t i : remote) {
        out[i].state = OpState::kPending;
        out[i].status = why;
      }
    };
    if (state != SessionState::kActive) {
      mark_pending(NotActive(state));
    } else {
      v1::WaitOpsRequest req;
      req.set_session_id(call.session_id);
      for (size_t i : remote) req.add_op_ids(ops[i].op_id);
      req.set_timeout_ms(ToMs(options.timeout));
      req.set_mode(options.any ? v1::WAIT_MODE_ANY : v1::WAIT_MODE_ALL);
      req.set_omit_page_status(options.omit_page_status);
      grpc::ClientContext ctx;
      ClientCore::SetDeadline(
          &ctx, std::max(options.timeout, absl::ZeroDuration()) + core_->options().rpc_timeout);
      v1::WaitOpsResponse resp;
      const grpc::Status st = core_->stub().WaitOps(&ctx, req, &resp);
      const Outcome outcome = AfterCall(call, st, ctx, /*touches_blocks=*/false);
      if (outcome == Outcome::kOk && static_cast<size_t>(resp.ops_size()) == remote.size()) {
        for (size_t j = 0; j < remote.size(); ++j) {
          const size_t i = remote[j];
          FromProto(resp.ops(static_cast<int>(j)), &out[i]);
          out[i].ref = ops[i];
        }
      } else if (outcome == Outcome::kSessionUnknown) {
        // The daemon ended the session: its ops are over (lease expiry cancels them).
        for (size_t i : remote) {
          out[i].state = OpState::kFailed;
          out[i].status = ToAbsl(st, "WaitOps");
          StatsCounters::Add(core_->stats().ops_failed_session_lost);
        }
      } else {
        mark_pending(st.ok() ? absl::InternalError("WaitOps: wrong number of results")
                             : ToAbsl(st, "WaitOps"));
      }
    }
  }

  if (!lost.empty()) {
    absl::MutexLock lock(&mu_);
    for (;;) {
      ResolveLostLocked(absl::Now());
      bool pending = false;
      for (size_t i : lost) {
        if (ops[i].generation <= ended_through_) {
          if (out[i].state != OpState::kFailed) {
            out[i].state = OpState::kFailed;
            out[i].status = absl::UnavailableError("the op's session ended");
            if (ops[i].op_id != 0) StatsCounters::Add(core_->stats().ops_failed_session_lost);
          }
        } else {
          pending = true;
          out[i].state = OpState::kPending;
          out[i].status = absl::UnavailableError(
              "the op's session was lost; its outcome is unknown until the daemon confirms");
        }
      }
      const absl::Time now = absl::Now();
      if (!pending || now >= deadline) break;
      cv_.WaitWithDeadline(&mu_, std::min(deadline, lost_end_deadline_));
    }
  }
  return out;
}

ReleaseReply SessionImpl::Release(absl::Span<const uint64_t> pin_ids,
                                  absl::Span<const OpRef> cancel_ops) {
  ReleaseReply reply;
  reply.pin_outcomes.assign(pin_ids.size(), ReleaseOutcome::kUnknown);
  reply.op_outcomes.assign(cancel_ops.size(), ReleaseOutcome::kUnknown);
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t pin : pin_ids) keep_pins_.erase(pin);
  }
  std::optional<Call> call = BeginCall();
  if (!call.has_value()) {
    reply.status = NotActive(state());
    return reply;
  }
  v1::ReleaseRequest req;
  req.set_session_id(call->session_id);
  for (uint64_t pin : pin_ids) req.add_pin_ids(pin);
  // Ops of earlier generations ended with their session; only the current ones are sent.
  std::vector<size_t> sent;
  for (size_t i = 0; i < cancel_ops.size(); ++i) {
    if (cancel_ops[i].generation == call->generation && cancel_ops[i].op_id != 0) {
      req.add_cancel_op_ids(cancel_ops[i].op_id);
      sent.push_back(i);
    }
  }
  grpc::ClientContext ctx;
  ClientCore::SetDeadline(&ctx, core_->options().rpc_timeout);
  v1::ReleaseResponse resp;
  const grpc::Status st = core_->stub().Release(&ctx, req, &resp);
  if (AfterCall(*call, st, ctx, /*touches_blocks=*/false) != Outcome::kOk) {
    reply.status = ToAbsl(st, "Release");
    return reply;
  }
  for (int i = 0; i < resp.pin_outcomes_size() && i < static_cast<int>(pin_ids.size()); ++i) {
    reply.pin_outcomes[i] = FromProto(static_cast<v1::ReleaseOutcome>(resp.pin_outcomes(i)));
  }
  for (size_t j = 0; j < sent.size() && j < static_cast<size_t>(resp.op_outcomes_size()); ++j) {
    reply.op_outcomes[sent[j]] =
        FromProto(static_cast<v1::ReleaseOutcome>(resp.op_outcomes(static_cast<int>(j))));
  }
  return reply;
}

CloseReply SessionImpl::Close(absl::Duration drain_timeout) {
  CloseReply reply;
  uint64_t session_id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (state_ == SessionState::kClosed) return reply;
    if (state_ == SessionState::kActive || state_ == SessionState::kSuspect) {
      session_id = info_.session_id;
    }
    state_ = SessionState::kClosed;
    info_.session_id = 0;
    cv_.SignalAll();
  }
  if (session_id == 0) return reply;
  v1::UnregisterEngineRequest req;
  req.set_session_id(session_id);
  req.set_drain_timeout_ms(ToMs(drain_timeout));
  grpc::ClientContext ctx;
  ClientCore::SetDeadline(
      &ctx, std::max(drain_timeout, absl::ZeroDuration()) + core_->options().rpc_timeout);
  v1::UnregisterEngineResponse resp;
  const grpc::Status status = core_->stub().UnregisterEngine(&ctx, req, &resp);
  core_->CountRpc(status);
  if (!status.ok()) {
    reply.status = ToAbsl(status, "UnregisterEngine");
    return reply;
  }
  reply.unregistered = true;
  reply.ops_completed = resp.ops_completed();
  reply.ops_cancelled = resp.ops_cancelled();
  reply.pins_released = resp.pins_released();
  return reply;
}

}  // namespace kvcellar::client
