// The revision of kvcellar.v1 this daemon implements (docs/api.md, compatibility): reported in
// RegisterEngineResponse and GetStatusResponse, bumped when RPCs or fields gain behaviour.
//   1: the first stable revision.
//   2: AdminService.WatchEvents (KV events, docs/events.md).
#ifndef KVCELLAR_SERVER_RPC_API_REVISION_H_
#define KVCELLAR_SERVER_RPC_API_REVISION_H_

#include <cstdint>

namespace kvcellar::server {

inline constexpr uint32_t kApiRevision = 2;

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_API_REVISION_H_
