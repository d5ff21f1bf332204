// CacheService: the engine data path (kvcellar.v1.CacheService): registration, Match, Load,
// Backup and the ops around them. See DESIGN.md, "Engine data path".
//
// Not implemented yet: every RPC answers UNIMPLEMENTED (the generated base class), so engines
// built against the full API get a clear answer and treat it as a miss.
//
// Threads: RPCs arrive on gRPC's callback threads, concurrently.
#ifndef KVCELLAR_SERVER_CACHE_SERVICE_H_
#define KVCELLAR_SERVER_CACHE_SERVICE_H_

#include "kvcellar/v1/cache_service.grpc.pb.h"

namespace kvcellar::server {

class CacheServiceImpl final : public kvcellar::v1::CacheService::CallbackService {};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CACHE_SERVICE_H_
