// Status helpers for CacheService: errors as absl::Status values that carry the API's
// ErrorReason and the offending request field, and their conversion to a gRPC status.
//
// Everything below the RPC handlers returns absl::Status (STYLE.md: errors are values, gRPC codes
// are produced in server/ only). The reason and field travel as status payloads, so a helper deep
// in validation can say "ERROR_REASON_BLOCK_OUT_OF_RANGE at sequences[2].device_blocks[5]" without
// knowing about gRPC; the handler turns it into the status code, the message, and the two
// trailing metadata entries the proto documents (common.proto, ErrorReason):
//   kvcellar-error-reason: ERROR_REASON_BLOCK_OUT_OF_RANGE
//   kvcellar-error-field:  sequences[2].device_blocks[5]
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_SERVER_STATUS_UTIL_H_
#define KVCELLAR_SERVER_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "kvcellar/v1/common.pb.h"

namespace kvcellar::server {

inline constexpr char kErrorReasonMetadataKey[] = "kvcellar-error-reason";
inline constexpr char kErrorFieldMetadataKey[] = "kvcellar-error-field";

// `code` with `message`, tagged with `reason` and (when not empty) the request field at fault.
absl::Status CacheError(absl::StatusCode code, v1::ErrorReason reason, absl::string_view field,
                        absl::string_view message);

// Shorthands for the common cases. The message should name the field and its value; `field` is
// the machine-readable path ("sequences[3].device_blocks[17]").
absl::Status InvalidField(absl::string_view field, absl::string_view message);
absl::Status LimitExceeded(absl::string_view field, absl::string_view message);
absl::Status BlockOutOfRange(absl::string_view field, absl::string_view message);
absl::Status SessionUnknown(uint64_t session_id);

// Adds (or replaces) the reason and field of an existing status, keeping its code and message.
absl::Status WithReason(absl::Status status, v1::ErrorReason reason, absl::string_view field);

// The reason and field a status carries; UNSPECIFIED / "" when none.
v1::ErrorReason ErrorReasonOf(const absl::Status& status);
std::string ErrorFieldOf(const absl::Status& status);

// The gRPC status for `status` (same code and message). When `context` is given and the status
// is not OK, adds the trailing metadata entries for its reason and field. A status without a
// reason gets ERROR_REASON_INTERNAL for INTERNAL/UNKNOWN codes and no reason entry otherwise.
grpc::Status ToGrpcStatus(const absl::Status& status, grpc::CallbackServerContext* context);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_STATUS_UTIL_H_
