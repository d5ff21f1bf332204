#include "server/rpc/cache_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "server/build_info.h"
#include "server/rpc/api_revision.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/request_validation.h"
#include "server/session/memory_access.h"
#include "server/session/namespace_metrics.h"

namespace kvcellar::server {
namespace {

// WaitOps answers this long before the call's own gRPC deadline, so the reply (with the states as
// they are) reaches the client instead of DEADLINE_EXCEEDED: a Unix-socket round trip is ~0.1 ms.
constexpr absl::Duration kDeadlineMargin = absl::Milliseconds(2);
grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status, context));
  return reactor;
}

// A gpu-layer error while opening an engine, as the registration's error: which field, which
// reason. gpu/ names its fields ("regions[2]: ...", "completion_region: ...", "device_uuid ...").
absl::Status OpenEngineError(const absl::Status& s) {
  absl::string_view msg = s.message();
  if (absl::StartsWith(msg, "device_uuid")) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_DEVICE_UNAVAILABLE,
                      "device.uuid", absl::StrCat("device.uuid: ", msg));
  }
  std::string field = "layout";
  // The whole message: the field path, then what happened ("layout.regions[2]: ...").
  std::string message = absl::StrCat("layout: ", msg);
  if (absl::StartsWith(msg, "completion_region")) {
    field = "completion.sim_counters.shm_name";
    message = absl::StrCat(field, msg.substr(msg.find(':')));
  } else if (absl::StartsWith(msg, "regions[")) {
    field = absl::StrCat("layout.", msg.substr(0, msg.find(']') + 1));
    message = absl::StrCat("layout.", msg);
  }
  if (s.code() == absl::StatusCode::kInvalidArgument && field == "layout") {
    return InvalidField(field, message);
  }
  return MemoryAccessPolicy::OpenError(field, s, message);
}

// The WaitOps RPC while it waits: registered with the OpTable, finished by it (Done) when the
// condition holds or the deadline passes, or by OnCancel when the client goes away first.
class WaitOpsReactor final : public grpc::ServerUnaryReactor, public OpWaiter {
 public:
  explicit WaitOpsReactor(OpTable* ops) : ops_(ops) {}
  void Done() override { Finish(grpc::Status::OK); }
  void OnCancel() override {
    if (ops_->RemoveWaiter(this)) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  OpTable* const ops_;
};

// The table of a service that was given none: it knows no connection.
const PeerCredentials& NoCredentials() {
  static const PeerCredentials* const empty = new PeerCredentials();
  return *empty;
}

}  // namespace

absl::Status CacheServiceImpl::CheckOwner(const Session& session, const PeerIdentity& caller) {
  if (session.info().owner == caller) return absl::OkStatus();
  // The owner is not named: that would tell one tenant's engine who runs another's.
  return CacheError(absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_NOT_SESSION_OWNER,
                    "session_id",
                    absl::StrCat("session_id: session ", session.id(),
                                 " was registered by another peer, and a session is usable only "
                                 "by the identity that registered it; this call comes from ",
                                 caller.Describe()));
}

absl::StatusOr<std::shared_ptr<Session>> CacheServiceImpl::OwnSession(
    const grpc::CallbackServerContext* context, uint64_t session_id) const {
  absl::StatusOr<std::shared_ptr<Session>> session = cache_->FindSession(session_id);
  if (!session.ok()) return session.status();
  if (absl::Status s = CheckOwner(**session, credentials_->Identify(context)); !s.ok()) return s;
  return session;
}

CacheServiceImpl::CacheServiceImpl(Cache* cache, const PeerCredentials* credentials)
    : cache_(cache),
      credentials_(credentials != nullptr ? credentials : &NoCredentials()),
      tenants_(TenantAccess::FromConfig(cache->config().tenants.allow)),
      memory_access_(cache->config().listen.tcp_host_memory, cache->daemon_objects()),
      config_(cache->config()),
      limits_(cache->limits()),
      daemon_epoch_(cache->daemon_epoch()),
      devices_(cache->devices()),
      namespaces_(cache->namespaces()),
      sessions_(cache->sessions()),
      ops_(cache->ops()),
      prefetcher_(cache->l3_prefetcher()),
      mover_(cache->mover()),
      matcher_(cache->matcher()) {}

// ---- RegisterEngine
// ------------------------------------------------------------------------------

absl::Status CacheServiceImpl::DoRegister(grpc::CallbackServerContext* context,
                                          const v1::RegisterEngineRequest& request,
                                          v1::RegisterEngineResponse* response) {
  if (absl::Status s = cache_->CheckNotDraining(); !s.ok()) return s;
  absl::StatusOr<Registration> reg = ParseRegistration(request, limits_, devices_.kinds());
  if (!reg.ok()) return reg.status();
  // Before anything is created: a refused tenant leaves no namespace behind.
  PeerIdentity caller = credentials_->Identify(context);
  if (absl::Status s = tenants_.Check(reg->spec.tenant, caller); !s.ok()) return s;
  // The memory it names must be its own (session/memory_access.h): checked on every object as
  // it is opened below; a TCP peer naming host memory is refused here, before anything exists.
  const bool host_memory = reg->worker && reg->device_kind == v1::DEVICE_KIND_SIM;
  absl::StatusOr<platform::EngineMemoryAccess> access = memory_access_.For(
      caller, host_memory,
      reg->engine.layout.regions.empty() ? "layout.regions" : "layout.regions[0]");
  if (!access.ok()) return access.status();
  reg->engine.memory_access = *access;

  std::shared_ptr<Namespace> ns = namespaces_.GetOrCreate(reg->spec);
  SessionInfo info;
  info.id = sessions_.NewSessionId();
  FillSessionGeometry(request, *reg, &info);
  info.ns = ns;
  info.pid = request.pid();
  info.engine_name = request.engine_name();
  info.client_version = request.client_version();
  info.owner = std::move(caller);
  info.registered = absl::Now();
  if (absl::Status s = sessions_.CheckAdd(info, request.replace_existing()); !s.ok()) return s;

  std::unique_ptr<gpu::EngineMapping> mapping;
  if (reg->worker) {
    // ParseRegistration admitted only a kind that is served.
    gpu::DeviceBackend* const device = devices_.For(reg->device_kind);
    if (device == nullptr) {
      return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_DEVICE_UNAVAILABLE,
                        "device.kind", "this daemon has no device backend");
    }
    if (!reg->sim_counters_name.empty()) {
      absl::StatusOr<std::shared_ptr<SimCounterChannel>> channel = SimCounterChannel::Open(
          reg->sim_counters_name, reg->sim_counters_bytes, info.num_load_slots, info.num_layers,
          info.num_ready_slots, *access);
      if (!channel.ok()) return channel.status();
      info.sim_signals = *std::move(channel);
    }
    absl::StatusOr<std::unique_ptr<gpu::EngineMapping>> opened = device->OpenEngine(reg->engine);
    if (!opened.ok()) return OpenEngineError(opened.status());
    mapping = *std::move(opened);
    if (absl::Status s = ns->AdoptLayout(reg->engine.layout); !s.ok()) return s;
    // The namespace has an index now: pages a file tier's startup scan found enter it.
    cache_->l3_recovery().OnIndexed(*ns);
  }

  const absl::Time deadline = absl::Now() + absl::Milliseconds(limits_.lease_ms);
  auto session = std::make_shared<Session>(std::move(info), std::move(mapping), deadline);
  std::shared_ptr<Session> replaced;
  if (absl::Status s = sessions_.Add(session, request.replace_existing(), &replaced); !s.ok()) {
    // A refused registration holds nothing; the mapping closes with `session`.
    if (reg->worker) ns->ReleaseLayout();
    return s;
  }
  if (replaced != nullptr) {
    // Before the reply, so that the engine's new session never overlaps copies of the old one:
    // no drain, so this waits only for the device to end the ops it cancels.
    cache_->EndSessionNow(replaced, /*last_of_instance=*/false, "replaced");
  }

  const SessionInfo& s = session->info();
  response->set_session_id(s.id);
  response->set_lease_ms(limits_.lease_ms);
  response->set_heartbeat_interval_ms(limits_.heartbeat_interval_ms);
  limits_.ToProto(response->mutable_limits());
  response->set_ns_digest(std::string(ns->digest().AsBytes()));
  response->set_shard_index(s.shard);
  response->set_num_shards(ns->spec().ShardsPerPage());
  response->set_is_shard_writer(s.shard_writer);
  response->set_page_object_bytes(s.is_worker() ? ns->object_bytes() : 0);
  response->set_daemon_epoch(daemon_epoch_);
  response->set_daemon_version(kVersion);
  response->set_api_revision(kApiRevision);
  if (!cache_->l3().empty()) {
    for (const std::string& name : cache_->l3().names()) response->add_l3_tier_names(name);
    response->set_default_write_policy(cache_->l3_writer().default_policy());
    response->set_default_prefetch_policy(prefetcher_.Resolve(v1::PREFETCH_POLICY_UNSPECIFIED));
  } else {
    response->set_default_write_policy(v1::WRITE_POLICY_L2_ONLY);
    response->set_default_prefetch_policy(v1::PREFETCH_POLICY_NONE);
  }
  KVLOG(Info, "session registered",
        {{"session_id", s.id},
         {"instance_id", s.instance_id},
         {"role", s.is_worker() ? "worker" : "scheduler"},
         {"rank", s.rank},
         {"shard", s.shard},
         {"ns_digest", ns->digest().Hex().substr(0, 16)},
         {"blocks", s.num_blocks},
         {"layers", s.num_layers},
         {"engine", s.engine_name},
         {"replaced", replaced != nullptr ? "true" : "false"}});
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::RegisterEngine(grpc::CallbackServerContext* context,
                                                           const v1::RegisterEngineRequest* request,
                                                           v1::RegisterEngineResponse* response) {
  return Finish(context, DoRegister(context, *request, response));
}

// ---- Heartbeat / Unregister
// ------------------------------------------------------------------------

grpc::ServerUnaryReactor* CacheServiceImpl::Heartbeat(grpc::CallbackServerContext* context,
                                                      const v1::HeartbeatRequest* request,
                                                      v1::HeartbeatResponse* response) {
  const absl::Time now = absl::Now();
  response->set_daemon_epoch(daemon_epoch_);
  response->set_draining(cache_->draining());
  if (static_cast<uint32_t>(request->renew_pin_ids_size()) > limits_.max_batch_sequences) {
    return Finish(context,
                  LimitExceeded("renew_pin_ids",
                                absl::StrCat("renew_pin_ids: ", request->renew_pin_ids_size(),
                                             " ids, more than max_batch_sequences (",
                                             limits_.max_batch_sequences, ")")));
  }
  std::shared_ptr<Session> session = sessions_.Find(request->session_id(), now);
  if (session == nullptr) {
    // Not an error: this is how a client learns to register again.
    response->set_state(v1::SESSION_STATE_UNKNOWN);
    return Finish(context, absl::OkStatus());
  }
  if (absl::Status s = CheckOwner(*session, credentials_->Identify(context)); !s.ok()) {
    return Finish(context, s);  // Another peer's heartbeat must not keep a session alive.
  }
  const absl::Time deadline = now + absl::Milliseconds(limits_.lease_ms);
  session->Renew(deadline);
  response->set_state(v1::SESSION_STATE_ACTIVE);
  response->set_lease_remaining_ms(limits_.lease_ms);
  response->set_lease_deadline_unix_ms(absl::ToUnixMillis(deadline));
  if (request->renew_pin_ids_size() > 0) {
    for (uint64_t id :
         cache_->pins().Renew(request->renew_pin_ids(), session->info().instance_id, now)) {
      response->add_unknown_pin_ids(id);
    }
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* CacheServiceImpl::UnregisterEngine(
    grpc::CallbackServerContext* context, const v1::UnregisterEngineRequest* request,
    v1::UnregisterEngineResponse* response) {
  // Checked before the removal; ids are never reused, so the session removed is the one checked.
  if (std::shared_ptr<Session> s = sessions_.Find(request->session_id(), absl::Now());
      s != nullptr) {
    if (absl::Status owner = CheckOwner(*s, credentials_->Identify(context)); !owner.ok()) {
      return Finish(context, owner);
    }
  }
  SessionRegistry::Removed removed = sessions_.Remove(request->session_id());
  if (removed.session == nullptr) return Finish(context, SessionUnknown(request->session_id()));
  // The drain runs on no thread: the session closer answers once the session's ops have ended or
  // the drain is over (cut short when the daemon drains, like WaitOps).
  const uint32_t drain_ms =
      cache_->draining() ? 0 : std::min(request->drain_timeout_ms(), limits_.max_wait_ms);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  cache_->EndSession(std::move(removed.session), removed.last_of_instance,
                     absl::Milliseconds(drain_ms), "unregistered",
                     [reactor, response](const Cache::EndCounts& counts) {
                       response->set_ops_completed(counts.ops_completed);
                       response->set_ops_cancelled(counts.ops_cancelled);
                       response->set_pins_released(counts.pins_released);
                       reactor->Finish(grpc::Status::OK);
                     });
  return reactor;
}

// ---- Match / Load / Backup
// -----------------------------------------------------------------------

absl::Status CacheServiceImpl::DoMatch(const grpc::CallbackServerContext* context,
                                       const v1::MatchRequest& request,
                                       v1::MatchResponse* response) {
  if (absl::Status s = cache_->CheckNotDraining(); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request.session_id());
  if (!session.ok()) return session.status();
  const SessionInfo& info = (*session)->info();
  if (absl::Status s = ValidateMatch(request, info.ns->spec(), limits_); !s.ok()) return s;
  return matcher_.Match(info, request, response);
}

grpc::ServerUnaryReactor* CacheServiceImpl::Match(grpc::CallbackServerContext* context,
                                                  const v1::MatchRequest* request,
                                                  v1::MatchResponse* response) {
  return Finish(context, DoMatch(context, *request, response));
}

absl::Status CacheServiceImpl::DoPrefetch(const grpc::CallbackServerContext* context,
                                          const v1::PrefetchRequest& request,
                                          v1::PrefetchResponse* response) {
  if (absl::Status s = cache_->CheckNotDraining(); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request.session_id());
  if (!session.ok()) return session.status();
  if (absl::Status s = ValidatePrefetch(request, limits_); !s.ok()) return s;
  const SessionInfo& info = (*session)->info();
  Namespace& ns = *info.ns;
  const uint32_t lease_ms = limits_.PinLeaseMs(request.pin_lease_ms());
  const absl::Time pin_deadline = absl::Now() + absl::Milliseconds(lease_ms);
  std::vector<PrefetchChain> chains;
  chains.reserve(request.sequences_size());
  uint64_t pages = 0;
  for (const v1::PrefetchSequence& seq : request.sequences()) {
    PrefetchChain& chain = chains.emplace_back();
    if (!seq.parent_key().empty()) chain.parent = ns.IndexKey(seq.parent_key().data());
    ns.AppendIndexKeys(seq.page_keys(), &chain.keys);
    pages += chain.keys.size();
    if (request.pin()) {
      chain.pin_id = ops_.NextId();
      cache_->pins().Add(chain.pin_id, info.instance_id, info.ns, {}, info.tp_size,
                         absl::Milliseconds(lease_ms), pin_deadline);
      response->add_pin_ids(chain.pin_id);
    }
  }
  // Without L3 tiers every page is ALREADY_PRESENT or MISS, and the op is done at once.
  v1::PrefetchPolicy policy = prefetcher_.Resolve(request.policy());
  if (policy == v1::PREFETCH_POLICY_NONE) policy = v1::PREFETCH_POLICY_BEST_EFFORT;
  std::shared_ptr<OpRecord> op =
      prefetcher_
          .Start(info, std::move(chains), policy,
                 prefetcher_.Deadline(policy, request.timeout_ms(), pages * ns.spec().page_size),
                 /*always_op=*/true)
          .op;
  ops_.Fill(*op, /*omit_page_status=*/false, /*submission=*/true, response->mutable_op());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::Prefetch(grpc::CallbackServerContext* context,
                                                     const v1::PrefetchRequest* request,
                                                     v1::PrefetchResponse* response) {
  return Finish(context, DoPrefetch(context, *request, response));
}

absl::Status CacheServiceImpl::DoLoad(const grpc::CallbackServerContext* context,
                                      const v1::LoadRequest& request, v1::LoadResponse* response) {
  if (absl::Status s = cache_->CheckNotDraining(); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request.session_id());
  if (!session.ok()) return session.status();
  if (absl::Status s = ValidateLoad(request, (*session)->info(), limits_); !s.ok()) return s;
  // The engine schedules with what has landed: a BEST_EFFORT prefetch under the pin stops here.
  for (const v1::LoadSequence& seq : request.sequences()) {
    if (seq.pin_id() != 0) prefetcher_.Abandon(seq.pin_id(), (*session)->info().instance_id);
  }
  absl::StatusOr<std::shared_ptr<OpRecord>> op = mover_.Load(*session, request);
  if (!op.ok()) return op.status();
  ops_.Fill(**op, /*omit_page_status=*/false, /*submission=*/true, response->mutable_op());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::Load(grpc::CallbackServerContext* context,
                                                 const v1::LoadRequest* request,
                                                 v1::LoadResponse* response) {
  return Finish(context, DoLoad(context, *request, response));
}

absl::Status CacheServiceImpl::DoBackup(const grpc::CallbackServerContext* context,
                                        const v1::BackupRequest& request,
                                        v1::BackupResponse* response) {
  if (absl::Status s = cache_->CheckNotDraining(); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request.session_id());
  if (!session.ok()) return session.status();
  if (absl::Status s = ValidateBackup(request, (*session)->info(), limits_); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<OpRecord>> op = mover_.Backup(*session, request);
  if (!op.ok()) return op.status();
  ops_.Fill(**op, /*omit_page_status=*/false, /*submission=*/true, response->mutable_op());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::Backup(grpc::CallbackServerContext* context,
                                                   const v1::BackupRequest* request,
                                                   v1::BackupResponse* response) {
  return Finish(context, DoBackup(context, *request, response));
}

// ---- WaitOps / Release
// ------------------------------------------------------------------------------

grpc::ServerUnaryReactor* CacheServiceImpl::WaitOps(grpc::CallbackServerContext* context,
                                                    const v1::WaitOpsRequest* request,
                                                    v1::WaitOpsResponse* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request->session_id());
  if (!session.ok()) return Finish(context, session.status());
  if (request->op_ids_size() == 0) {
    return Finish(context, InvalidField("op_ids", "op_ids: at least one op id is required"));
  }
  if (static_cast<uint32_t>(request->op_ids_size()) > limits_.max_inflight_ops) {
    return Finish(context,
                  LimitExceeded("op_ids", absl::StrCat("op_ids: ", request->op_ids_size(),
                                                       " ids, more than max_inflight_ops (",
                                                       limits_.max_inflight_ops, ")")));
  }
  if (!v1::WaitMode_IsValid(request->mode())) {
    return Finish(context, InvalidField("mode", absl::StrCat("mode (", request->mode(),
                                                             ") is not a WaitMode")));
  }
  const absl::Time now = absl::Now();
  absl::Time deadline =
      now + absl::Milliseconds(std::min(request->timeout_ms(), limits_.max_wait_ms));
  const absl::Time call_deadline = absl::FromChrono(context->deadline());
  if (call_deadline < deadline + kDeadlineMargin) {
    deadline = std::max(now, call_deadline - kDeadlineMargin);
  }
  if (cache_->draining()) deadline = now;  // Answer at once.
  auto* reactor = new WaitOpsReactor(&ops_);
  reactor->ids.assign(request->op_ids().begin(), request->op_ids().end());
  reactor->instance_id = (*session)->info().instance_id;
  reactor->any = request->mode() == v1::WAIT_MODE_ANY;
  reactor->omit_page_status = request->omit_page_status();
  reactor->deadline = deadline;
  reactor->response = response;
  if (ops_.Wait(reactor)) reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::Status CacheServiceImpl::DoRelease(const grpc::CallbackServerContext* context,
                                         const v1::ReleaseRequest& request,
                                         v1::ReleaseResponse* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = OwnSession(context, request.session_id());
  if (!session.ok()) return session.status();
  if (static_cast<uint32_t>(request.pin_ids_size()) > limits_.max_batch_sequences) {
    return LimitExceeded("pin_ids", absl::StrCat("pin_ids: ", request.pin_ids_size(),
                                                 " ids, more than max_batch_sequences (",
                                                 limits_.max_batch_sequences, ")"));
  }
  if (static_cast<uint32_t>(request.cancel_op_ids_size()) > limits_.max_inflight_ops) {
    return LimitExceeded(
        "cancel_op_ids",
        absl::StrCat("cancel_op_ids: ", request.cancel_op_ids_size(),
                     " ids, more than max_inflight_ops (", limits_.max_inflight_ops, ")"));
  }
  const std::string& instance = (*session)->info().instance_id;
  for (uint64_t id : request.pin_ids()) {
    const bool released = cache_->pins().Release(id, instance);
    if (released) prefetcher_.Abandon(id, instance);
    response->add_pin_outcomes(released ? v1::RELEASE_OUTCOME_RELEASED
                                        : v1::RELEASE_OUTCOME_UNKNOWN);
  }
  for (uint64_t id : request.cancel_op_ids()) response->add_op_outcomes(ops_.Cancel(id, instance));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::Release(grpc::CallbackServerContext* context,
                                                    const v1::ReleaseRequest* request,
                                                    v1::ReleaseResponse* response) {
  return Finish(context, DoRelease(context, *request, response));
}

}  // namespace kvcellar::server
