// AdminService: what operators ask of a running daemon (kvcellar.v1.AdminService).
//
// The same class serves two listeners. On the admin socket (`allow_mutations`) every RPC is
// served. On the engine listeners the read-only ones are, and Evict and Clear answer
// PERMISSION_DENIED unless the peer presented a verified client certificate (mutual TLS):
// changing the cache needs the admin identity (DESIGN.md, Security).
//
// The cache RPCs (ListEngines, ListNamespaces, GetStats, Evict, Clear) are CacheAdmin's
// (cache_admin.h); the storage tiers come in through the optional L3Admin (l3_admin.h).
//
// Threads: RPCs arrive on gRPC's callback threads, concurrently; the class holds no mutable state
// of its own and reads daemon state through the `info` callback, which is thread-safe. The
// callback threads are the engine listener's too (gRPC shares them process-wide), so what a
// handler waits for matters to engines: only Evict and Clear of L3 tiers wait, for the backends'
// deletes, batch by batch, each within the backend's own timeout (l3_tier_admin.h); they are
// served to the admin identity only.
#ifndef KVCELLAR_SERVER_RPC_ADMIN_SERVICE_H_
#define KVCELLAR_SERVER_RPC_ADMIN_SERVICE_H_

#include <functional>
#include <string>

#include "kvcellar/v1/admin_service.grpc.pb.h"
#include "server/admin/cache_admin.h"
#include "server/config/config.h"
#include "server/events/event_hub.h"
#include "server/l3/l3_admin.h"
#include "server/admin/daemon_info.h"

namespace kvcellar::server {

class AdminServiceImpl final : public kvcellar::v1::AdminService::CallbackService {
 public:
  // `cache` serves the cache RPCs (nullptr: they answer UNAVAILABLE); `l3` is the storage tiers'
  // admin, nullptr when none is configured. Both outlive the service.
  // `events` serves WatchEvents (nullptr: it answers UNAVAILABLE); it outlives the service.
  AdminServiceImpl(std::function<DaemonInfo()> info, const Config& config, bool allow_mutations,
                   CacheAdmin* cache = nullptr, L3Admin* l3 = nullptr,
                   EventHub* events = nullptr);

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const kvcellar::v1::GetStatusRequest* request,
                                      kvcellar::v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* GetConfig(grpc::CallbackServerContext* context,
                                      const kvcellar::v1::GetConfigRequest* request,
                                      kvcellar::v1::GetConfigResponse* response) override;
  grpc::ServerUnaryReactor* ListEngines(grpc::CallbackServerContext* context,
                                        const kvcellar::v1::ListEnginesRequest* request,
                                        kvcellar::v1::ListEnginesResponse* response) override;
  grpc::ServerUnaryReactor* ListNamespaces(grpc::CallbackServerContext* context,
                                           const kvcellar::v1::ListNamespacesRequest* request,
                                           kvcellar::v1::ListNamespacesResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const kvcellar::v1::GetStatsRequest* request,
                                     kvcellar::v1::GetStatsResponse* response) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* context,
                                  const kvcellar::v1::EvictRequest* request,
                                  kvcellar::v1::EvictResponse* response) override;
  grpc::ServerUnaryReactor* Clear(grpc::CallbackServerContext* context,
                                  const kvcellar::v1::ClearRequest* request,
                                  kvcellar::v1::ClearResponse* response) override;
  grpc::ServerWriteReactor<kvcellar::v1::WatchEventsResponse>* WatchEvents(
      grpc::CallbackServerContext* context,
      const kvcellar::v1::WatchEventsRequest* request) override;

 private:
  bool MayMutate(const grpc::CallbackServerContext* context) const;
  // PERMISSION_DENIED (ADMIN_REQUIRED) when the peer may not change the cache, UNAVAILABLE
  // without a cache; OK otherwise. `mutates`: Evict and Clear.
  absl::Status CheckAccess(const grpc::CallbackServerContext* context, absl::string_view method,
                           bool mutates) const;

  std::function<DaemonInfo()> info_;
  const Config& config_;
  const bool allow_mutations_;
  CacheAdmin* const cache_;
  L3Admin* const l3_;
  EventHub* const events_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_ADMIN_SERVICE_H_
