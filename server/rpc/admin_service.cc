#include "server/rpc/admin_service.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "server/build_info.h"
#include "server/config/cache_limits.h"
#include "server/rpc/event_stream.h"
#include "server/rpc/api_revision.h"
#include "server/rpc/grpc_status.h"

namespace kvcellar::server {
namespace {

namespace v1 = ::kvcellar::v1;

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

v1::ListenerKind ToProto(ListenerInfo::Kind kind) {
  switch (kind) {
    case ListenerInfo::Kind::kUnix: return v1::LISTENER_KIND_UNIX;
    case ListenerInfo::Kind::kAdmin: return v1::LISTENER_KIND_ADMIN;
    case ListenerInfo::Kind::kTcp: return v1::LISTENER_KIND_TCP;
    case ListenerInfo::Kind::kHttp: return v1::LISTENER_KIND_HTTP;
  }
  return v1::LISTENER_KIND_UNSPECIFIED;
}

v1::ListenerSecurity ToProto(ListenerInfo::Security security) {
  switch (security) {
    case ListenerInfo::Security::kUnixPermissions: return v1::LISTENER_SECURITY_UNIX_PERMISSIONS;
    case ListenerInfo::Security::kPlaintext: return v1::LISTENER_SECURITY_PLAINTEXT;
    case ListenerInfo::Security::kTls: return v1::LISTENER_SECURITY_TLS;
    case ListenerInfo::Security::kMtls: return v1::LISTENER_SECURITY_MTLS;
  }
  return v1::LISTENER_SECURITY_UNSPECIFIED;
}

// The peer proved its identity with a client certificate chained to tls.client_ca_file (mutual
// TLS; gRPC verified it during the handshake). Unix-socket and plain-TLS peers are not
// authenticated this way.
bool HasVerifiedClientCertificate(const grpc::CallbackServerContext* context) {
  std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
  return auth != nullptr && auth->IsPeerAuthenticated();
}

std::string Hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

}  // namespace

AdminServiceImpl::AdminServiceImpl(std::function<DaemonInfo()> info, const Config& config,
                                   bool allow_mutations, CacheAdmin* cache, L3Admin* l3,
                                   EventHub* events)
    : info_(std::move(info)),
      config_(config),
      allow_mutations_(allow_mutations),
      cache_(cache),
      l3_(l3),
      events_(events) {}

absl::Status AdminServiceImpl::CheckAccess(const grpc::CallbackServerContext* context,
                                           absl::string_view method, bool mutates) const {
  if (mutates && !MayMutate(context)) {
    return CacheError(absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_ADMIN_REQUIRED, "",
                      absl::StrCat(method,
                                   " changes the cache: call it on the admin socket "
                                   "(listen.admin_socket) or over mutual TLS"));
  }
  if (cache_ == nullptr) {
    return CacheError(absl::StatusCode::kUnavailable, v1::ERROR_REASON_NOT_READY, "",
                      "the cache service is not running");
  }
  return absl::OkStatus();
}

bool AdminServiceImpl::MayMutate(const grpc::CallbackServerContext* context) const {
  return allow_mutations_ || HasVerifiedClientCertificate(context);
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                      const v1::GetStatusRequest* request,
                                                      v1::GetStatusResponse* response) {
  DaemonInfo info = info_();
  absl::Time now = absl::Now();
  response->set_version(kVersion);
  response->set_git_commit(kGitCommit);
  response->set_build_type(kBuildType);
  response->set_cuda_built(kCudaEnabled);
  response->set_api_revision(kApiRevision);
  response->set_start_time_unix_ms(absl::ToUnixMillis(info.start_time));
  response->set_uptime_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(now - info.start_time)));
  response->set_daemon_epoch(info.epoch);
  for (const ListenerInfo& l : info.listeners) {
    v1::Listener* out = response->add_listeners();
    out->set_kind(ToProto(l.kind));
    out->set_address(l.address);
    out->set_security(ToProto(l.security));
  }
  response->set_config_digest(info.config_digest);
  v1::HostPoolStatus* pool = response->mutable_pool();
  pool->set_capacity_bytes(info.pool_capacity_bytes);
  pool->set_used_bytes(info.pool_used_bytes);
  pool->set_pinned_bytes(info.pool_pinned_bytes);
  pool->set_in_flight_bytes(info.pool_in_flight_bytes);
  pool->set_huge_pages(info.pool_huge_pages);
  pool->set_shm_name(config_.pool.shm_name);
  const L2RecoveryStats& l2 = info.l2_recovery;
  pool->set_warm_restarted(l2.warm);
  v1::L2RecoveryStatus* recovery = pool->mutable_recovery();
  recovery->set_enabled(l2.enabled);
  recovery->set_warm(l2.warm);
  recovery->set_cold_reason(l2.cold_reason);
  recovery->set_namespaces(l2.namespaces);
  recovery->set_pages(l2.pages);
  recovery->set_objects(l2.objects);
  recovery->set_bytes(l2.bytes);
  recovery->set_dropped_in_flight(l2.dropped_in_flight);
  recovery->set_dropped_unsealed(l2.dropped_unsealed);
  recovery->set_dropped_torn(l2.dropped_torn);
  recovery->set_dropped_checksum(l2.dropped_checksum);
  recovery->set_dropped_mismatch(l2.dropped_mismatch);
  recovery->set_dropped_orphan(l2.dropped_orphan);
  recovery->set_seconds(l2.seconds);
  response->set_device_kind(info.device_kind == "sim"    ? v1::DEVICE_KIND_SIM
                            : info.device_kind == "cuda" ? v1::DEVICE_KIND_CUDA
                                                         : v1::DEVICE_KIND_UNSPECIFIED);
  if (MayMutate(context)) {
    for (const TenantUsage& u : info.tenants) {
      v1::TenantStatus* out = response->add_tenants();
      out->set_tenant(u.tenant);
      out->set_has_quota(u.has_quota);
      out->set_guarantee_bytes(u.guarantee_bytes);
      out->set_ceiling_bytes(u.ceiling_bytes);
      out->set_l2_used_bytes(u.l2_bytes);
      out->set_l2_pages(u.l2_pages);
      out->set_namespaces(u.namespaces);
      out->set_match_requests(u.match_requests);
      out->set_lookup_pages(u.lookup_pages);
      out->set_l2_hit_pages(u.l2_hit_pages);
      out->set_l3_hit_pages(u.l3_hit_pages);
      auto evicted = [&u](TenantEvictCause c) { return u.evicted_pages[static_cast<int>(c)]; };
      out->set_evicted_own_pages(evicted(TenantEvictCause::kOwn));
      out->set_evicted_by_other_tenant_pages(evicted(TenantEvictCause::kOtherTenant));
      out->set_evicted_watermark_pages(evicted(TenantEvictCause::kWatermark));
      out->set_evicted_region_release_pages(evicted(TenantEvictCause::kRegionRelease));
      out->set_evicted_admin_pages(evicted(TenantEvictCause::kAdmin));
      out->set_ceiling_refusals(u.ceiling_refusals);
    }
  }
  for (const L3TierInfo& t : info.l3_tiers) {
    v1::L3TierStatus* out = response->add_l3_tiers();
    out->set_name(t.name);
    out->set_kind(t.kind);
    out->set_healthy(t.healthy);
    out->set_used_bytes(t.used_bytes);
    out->set_capacity_bytes(t.capacity_bytes);
    out->set_last_error(t.last_error);
    out->set_last_error_unix_ms(t.last_error_unix_ms);
    const L3ScanStats& r = t.recovery;
    v1::L3RecoveryStatus* rec = out->mutable_recovery();
    rec->set_source(r.file_tier ? "file_scan" : r.redis_tier ? "redis_index" : "");
    rec->set_done(r.complete);
    rec->set_partial(r.partial);
    rec->set_objects_found(r.found);
    rec->set_objects_legacy(r.legacy);
    rec->set_objects_dropped(r.dropped);
    rec->set_objects_pending(r.objects_pending);
    rec->set_pages_inserted(r.pages_inserted);
    rec->set_pages_orphaned(r.pages_orphaned);
    rec->set_pages_legacy(r.pages_legacy);
    rec->set_pages_mismatched(r.pages_mismatched);
    rec->set_bytes(r.payload_bytes);
    rec->set_seconds(r.seconds);
  }
  response->set_sessions(static_cast<uint32_t>(info.sessions));
  response->set_instances(static_cast<uint32_t>(info.instances));
  response->set_namespaces(static_cast<uint32_t>(info.namespaces));
  response->set_ready(info.ready);
  response->set_draining(info.draining);
  if (!info.ready) response->set_not_ready_reason(info.draining ? "draining" : "starting");
  CacheLimits::FromConfig(config_).ToProto(response->mutable_limits());
  response->set_hostname(Hostname());
  return Finish(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetConfig(grpc::CallbackServerContext* context,
                                                      const v1::GetConfigRequest* request,
                                                      v1::GetConfigResponse* response) {
  DaemonInfo info = info_();
  response->set_yaml(ConfigToYaml(config_, /*redact_secrets=*/true));
  response->set_config_digest(info.config_digest);
  response->set_config_file(info.config_file);
  response->set_loaded_unix_ms(absl::ToUnixMillis(info.start_time));
  return Finish(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListEngines(grpc::CallbackServerContext* context,
                                                        const v1::ListEnginesRequest* request,
                                                        v1::ListEnginesResponse* response) {
  absl::Status s = CheckAccess(context, "ListEngines", /*mutates=*/false);
  if (s.ok()) s = cache_->ListEngines(*request, response);
  if (s.ok() && !MayMutate(context)) {
    // A session id is its holder's credential: only admin callers see them.
    for (v1::EngineSession& e : *response->mutable_sessions()) e.set_session_id(0);
  }
  return Finish(context, ToGrpcStatus(s, context));
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListNamespaces(
    grpc::CallbackServerContext* context, const v1::ListNamespacesRequest* request,
    v1::ListNamespacesResponse* response) {
  absl::Status s = CheckAccess(context, "ListNamespaces", /*mutates=*/false);
  if (s.ok()) s = cache_->ListNamespaces(*request, l3_, response);
  return Finish(context, ToGrpcStatus(s, context));
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStats(grpc::CallbackServerContext* context,
                                                     const v1::GetStatsRequest* request,
                                                     v1::GetStatsResponse* response) {
  absl::Status s = CheckAccess(context, "GetStats", /*mutates=*/false);
  if (s.ok()) s = cache_->GetStats(*request, response);
  return Finish(context, ToGrpcStatus(s, context));
}

grpc::ServerUnaryReactor* AdminServiceImpl::Evict(grpc::CallbackServerContext* context,
                                                  const v1::EvictRequest* request,
                                                  v1::EvictResponse* response) {
  absl::Status s = CheckAccess(context, "Evict", /*mutates=*/true);
  if (s.ok()) s = cache_->Evict(*request, l3_, response);
  if (s.ok()) {
    KVLOG(Info, "admin evict",
          {{"dry_run", request->dry_run()},
           {"target_bytes", request->target_bytes()},
           {"evicted_bytes", response->evicted_size() > 0 ? response->evicted(0).bytes() : 0}});
  }
  return Finish(context, ToGrpcStatus(s, context));
}

grpc::ServerUnaryReactor* AdminServiceImpl::Clear(grpc::CallbackServerContext* context,
                                                  const v1::ClearRequest* request,
                                                  v1::ClearResponse* response) {
  absl::Status s = CheckAccess(context, "Clear", /*mutates=*/true);
  if (s.ok()) s = cache_->Clear(*request, l3_, response);
  if (s.ok()) {
    KVLOG(Info, "admin clear",
          {{"dry_run", request->dry_run()},
           {"removed_bytes", response->removed_size() > 0 ? response->removed(0).bytes() : 0},
           {"pins_revoked", response->pins_revoked()},
           {"deferred_pages", response->deferred_pages()}});
  }
  return Finish(context, ToGrpcStatus(s, context));
}

grpc::ServerWriteReactor<v1::WatchEventsResponse>* AdminServiceImpl::WatchEvents(
    grpc::CallbackServerContext* context, const v1::WatchEventsRequest* request) {
  if (events_ == nullptr) {
    // A reactor that only finishes: no event hub in this daemon.
    class Unavailable final : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
     public:
      Unavailable() { Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "no event hub")); }
      void OnDone() override { delete this; }
    };
    return new Unavailable();
  }
  return new EventStream(events_, *request);
}

}  // namespace kvcellar::server
