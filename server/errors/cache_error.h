// The daemon's error vocabulary: errors as absl::Status values that carry the API's ErrorReason
// and the offending request field, without any transport.
//
// Everything below the RPC handlers returns absl::Status (STYLE.md: errors are values). The reason
// and field travel as status payloads, so a helper deep in validation can say
// "ERROR_REASON_BLOCK_OUT_OF_RANGE at sequences[2].device_blocks[5]" without knowing about gRPC;
// only the RPC room (server/rpc/grpc_status.h) turns it into a gRPC status code, message, and the
// trailing metadata entries the proto documents (common.proto, ErrorReason).
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_SERVER_ERRORS_CACHE_ERROR_H_
#define KVCELLAR_SERVER_ERRORS_CACHE_ERROR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvcellar/v1/common.pb.h"

namespace kvcellar::server {

// `code` with `message`, tagged with `reason` and (when not empty) the request field at fault.
absl::Status CacheError(absl::StatusCode code, v1::ErrorReason reason, absl::string_view field,
                        absl::string_view message);

// Shorthands for the common cases. The message should name the field and its value; `field` is
// the machine-readable path ("sequences[3].device_blocks[17]").
absl::Status InvalidField(absl::string_view field, absl::string_view message);
absl::Status LimitExceeded(absl::string_view field, absl::string_view message);
absl::Status BlockOutOfRange(absl::string_view field, absl::string_view message);
absl::Status SessionUnknown(uint64_t session_id);

// The request field of a device block: "sequences[s].device_blocks[i]" for the flat index `flat`
// of a request whose sequence s starts at seq_begin[s].
std::string BlockField(const std::vector<uint32_t>& seq_begin, size_t flat);

// Adds (or replaces) the reason and field of an existing status, keeping its code and message.
absl::Status WithReason(absl::Status status, v1::ErrorReason reason, absl::string_view field);

// The reason and field a status carries; UNSPECIFIED / "" when none.
v1::ErrorReason ErrorReasonOf(const absl::Status& status);
std::string ErrorFieldOf(const absl::Status& status);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_ERRORS_CACHE_ERROR_H_
