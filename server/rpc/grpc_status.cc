#include "server/rpc/grpc_status.h"

#include <string>

namespace kvcellar::server {

grpc::Status ToGrpcStatus(const absl::Status& status, grpc::CallbackServerContext* context) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  const auto code = static_cast<grpc::StatusCode>(static_cast<int>(status.code()));
  if (context != nullptr) {
    v1::ErrorReason reason = ErrorReasonOf(status);
    if (reason == v1::ERROR_REASON_UNSPECIFIED && (status.code() == absl::StatusCode::kInternal ||
                                                   status.code() == absl::StatusCode::kUnknown)) {
      reason = v1::ERROR_REASON_INTERNAL;
    }
    if (reason != v1::ERROR_REASON_UNSPECIFIED) {
      context->AddTrailingMetadata(kErrorReasonMetadataKey, v1::ErrorReason_Name(reason));
    }
    std::string field = ErrorFieldOf(status);
    if (!field.empty()) context->AddTrailingMetadata(kErrorFieldMetadataKey, field);
  }
  return grpc::Status(code, std::string(status.message()));
}

}  // namespace kvcellar::server
