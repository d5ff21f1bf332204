// The one place where the daemon's errors become gRPC statuses: the status code and message of an
// absl::Status, plus the trailing metadata entries common.proto documents for its ErrorReason and
// request field (server/errors/cache_error.h):
//   kvcellar-error-reason: ERROR_REASON_BLOCK_OUT_OF_RANGE
//   kvcellar-error-field:  sequences[2].device_blocks[5]
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_SERVER_RPC_GRPC_STATUS_H_
#define KVCELLAR_SERVER_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {

inline constexpr char kErrorReasonMetadataKey[] = "kvcellar-error-reason";
inline constexpr char kErrorFieldMetadataKey[] = "kvcellar-error-field";

// The gRPC status for `status` (same code and message). When `context` is given and the status
// is not OK, adds the trailing metadata entries for its reason and field. A status without a
// reason gets ERROR_REASON_INTERNAL for INTERNAL/UNKNOWN codes and no reason entry otherwise.
grpc::Status ToGrpcStatus(const absl::Status& status, grpc::CallbackServerContext* context);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_GRPC_STATUS_H_
