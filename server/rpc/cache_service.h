// CacheService: the engine data path's RPC handlers (kvcellar.v1.CacheService): registration and
// leases, Match, Prefetch, Load, Backup, WaitOps and Release. See DESIGN.md, "Engine data path",
// docs/api.md, and docs/architecture.md for the path of a Match and a Load.
//
// Each handler finds the session, validates the request (request_validation.h: all or nothing,
// errors name the field), calls the component of the Cache (server/cache.h, the composition root)
// that does the work, and turns the result into a reply or a gRPC status with the
// kvcellar-error-reason / kvcellar-error-field trailing metadata (grpc_status.h).
//
// Threads: RPCs on gRPC's callback threads, concurrently. No handler holds its thread for a time
// another engine, or the caller itself, controls: WaitOps and UnregisterEngine's drain are
// answered later from the op completion thread and the session closer (cache/session_closer.h);
// what a handler does wait for is bounded by configuration, not by the caller: Match's L3 lookup
// (storage.max_lookup_ms), a Match memo waiting for the same instance's Compute, a session's
// submissions in progress when it closes, and the device ending the ops a replaced session's
// close cancels (RegisterEngine with replace_existing).
#ifndef KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_
#define KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"
#include "server/cache/cache.h"
#include "server/rpc/peer_credentials.h"
#include "server/session/memory_access.h"
#include "server/session/tenant_access.h"

namespace kvcellar::server {

class CacheServiceImpl final : public kvcellar::v1::CacheService::CallbackService {
 public:
  // `cache` and `credentials` outlive the service. `credentials` knows the peers of the engine
  // socket's connections (UnixListener); nullptr: peers are told apart by gRPC's peer names
  // only, as for TCP without client certificates.
  explicit CacheServiceImpl(Cache* cache, const PeerCredentials* credentials = nullptr);
  CacheServiceImpl(const CacheServiceImpl&) = delete;
  CacheServiceImpl& operator=(const CacheServiceImpl&) = delete;

  grpc::ServerUnaryReactor* RegisterEngine(grpc::CallbackServerContext* context,
                                           const v1::RegisterEngineRequest* request,
                                           v1::RegisterEngineResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterEngine(grpc::CallbackServerContext* context,
                                             const v1::UnregisterEngineRequest* request,
                                             v1::UnregisterEngineResponse* response) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* context,
                                  const v1::MatchRequest* request,
                                  v1::MatchResponse* response) override;
  grpc::ServerUnaryReactor* Prefetch(grpc::CallbackServerContext* context,
                                     const v1::PrefetchRequest* request,
                                     v1::PrefetchResponse* response) override;
  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* context,
                                 const v1::LoadRequest* request,
                                 v1::LoadResponse* response) override;
  grpc::ServerUnaryReactor* Backup(grpc::CallbackServerContext* context,
                                   const v1::BackupRequest* request,
                                   v1::BackupResponse* response) override;
  grpc::ServerUnaryReactor* WaitOps(grpc::CallbackServerContext* context,
                                    const v1::WaitOpsRequest* request,
                                    v1::WaitOpsResponse* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;

 private:
  absl::Status DoRegister(grpc::CallbackServerContext* context,
                          const v1::RegisterEngineRequest& request,
                          v1::RegisterEngineResponse* response);
  absl::Status DoMatch(const grpc::CallbackServerContext* context, const v1::MatchRequest& request,
                       v1::MatchResponse* response);
  absl::Status DoPrefetch(const grpc::CallbackServerContext* context,
                          const v1::PrefetchRequest& request, v1::PrefetchResponse* response);
  absl::Status DoLoad(const grpc::CallbackServerContext* context, const v1::LoadRequest& request,
                      v1::LoadResponse* response);
  absl::Status DoBackup(const grpc::CallbackServerContext* context,
                        const v1::BackupRequest& request, v1::BackupResponse* response);
  absl::Status DoRelease(const grpc::CallbackServerContext* context,
                         const v1::ReleaseRequest& request, v1::ReleaseResponse* response);

  // The session `session_id` names, if the caller is the identity that registered it: else
  // FAILED_PRECONDITION (SESSION_UNKNOWN) or PERMISSION_DENIED (NOT_SESSION_OWNER).
  absl::StatusOr<std::shared_ptr<Session>> OwnSession(const grpc::CallbackServerContext* context,
                                                      uint64_t session_id) const;
  // OK when `caller` registered `session`, else PERMISSION_DENIED (NOT_SESSION_OWNER).
  static absl::Status CheckOwner(const Session& session, const PeerIdentity& caller);

  Cache* const cache_;
  const PeerCredentials* const credentials_;  // Never null (an empty table when none is given).
  const TenantAccess tenants_;
  // Whose memory a registration may name (session/memory_access.h).
  const MemoryAccessPolicy memory_access_;
  // The cache's components the handlers use most.
  const Config& config_;
  const CacheLimits& limits_;
  const uint64_t daemon_epoch_;
  const DeviceSet& devices_;
  NamespaceRegistry& namespaces_;
  SessionRegistry& sessions_;
  OpTable& ops_;
  L3Prefetcher& prefetcher_;
  DeviceMover& mover_;
  Matcher& matcher_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_
