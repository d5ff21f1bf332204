// AdminService: what operators ask of a running daemon (kvcellar.v1.AdminService).
//
// The same class serves two listeners. On the admin socket (`allow_mutations`) every RPC is
// served. On the engine listeners the read-only ones are, and Evict and Clear answer
// PERMISSION_DENIED unless the peer presented a verified client certificate (mutual TLS):
// changing the cache needs the admin identity (DESIGN.md, Security).
//
// Threads: RPCs arrive on gRPC's callback threads, concurrently; the class holds no mutable state
// of its own and reads daemon state through the `info` callback, which is thread-safe.
#ifndef KVCELLAR_SERVER_ADMIN_SERVICE_H_
#define KVCELLAR_SERVER_ADMIN_SERVICE_H_

#include <functional>
#include <string>

#include "kvcellar/v1/admin_service.grpc.pb.h"
#include "server/config.h"
#include "server/daemon_info.h"

namespace kvcellar::server {

class AdminServiceImpl final : public kvcellar::v1::AdminService::CallbackService {
 public:
  AdminServiceImpl(std::function<DaemonInfo()> info, const Config& config, bool allow_mutations);

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const kvcellar::v1::GetStatusRequest* request,
                                      kvcellar::v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* GetConfig(grpc::CallbackServerContext* context,
                                      const kvcellar::v1::GetConfigRequest* request,
                                      kvcellar::v1::GetConfigResponse* response) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* context,
                                  const kvcellar::v1::EvictRequest* request,
                                  kvcellar::v1::EvictResponse* response) override;
  grpc::ServerUnaryReactor* Clear(grpc::CallbackServerContext* context,
                                  const kvcellar::v1::ClearRequest* request,
                                  kvcellar::v1::ClearResponse* response) override;

 private:
  bool MayMutate(const grpc::CallbackServerContext* context) const;

  std::function<DaemonInfo()> info_;
  const Config& config_;
  const bool allow_mutations_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_ADMIN_SERVICE_H_
