#include "server/errors/cache_error.h"

#include <algorithm>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace kvcellar::server {
namespace {

// Payload type URLs: private to this file, never sent on the wire.
constexpr char kReasonPayload[] = "type.kvcellar.dev/error-reason";
constexpr char kFieldPayload[] = "type.kvcellar.dev/error-field";

}  // namespace

absl::Status CacheError(absl::StatusCode code, v1::ErrorReason reason, absl::string_view field,
                        absl::string_view message) {
  return WithReason(absl::Status(code, message), reason, field);
}

absl::Status InvalidField(absl::string_view field, absl::string_view message) {
  return CacheError(absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD, field,
                    message);
}

absl::Status LimitExceeded(absl::string_view field, absl::string_view message) {
  return CacheError(absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_LIMIT_EXCEEDED, field,
                    message);
}

absl::Status BlockOutOfRange(absl::string_view field, absl::string_view message) {
  return CacheError(absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, field,
                    message);
}

absl::Status SessionUnknown(uint64_t session_id) {
  return CacheError(
      absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_SESSION_UNKNOWN, "session_id",
      absl::StrCat("session_id ", session_id, " is unknown or its lease expired; register again"));
}

std::string BlockField(const std::vector<uint32_t>& seq_begin, size_t flat) {
  auto it = std::upper_bound(seq_begin.begin(), seq_begin.end(), static_cast<uint32_t>(flat));
  const size_t s = static_cast<size_t>(it - seq_begin.begin()) - 1;
  return absl::StrCat("sequences[", s, "].device_blocks[", flat - seq_begin[s], "]");
}

absl::Status WithReason(absl::Status status, v1::ErrorReason reason, absl::string_view field) {
  if (status.ok()) return status;
  status.SetPayload(kReasonPayload, absl::Cord(v1::ErrorReason_Name(reason)));
  if (field.empty()) {
    status.ErasePayload(kFieldPayload);
  } else {
    status.SetPayload(kFieldPayload, absl::Cord(field));
  }
  return status;
}

v1::ErrorReason ErrorReasonOf(const absl::Status& status) {
  auto payload = status.GetPayload(kReasonPayload);
  v1::ErrorReason reason = v1::ERROR_REASON_UNSPECIFIED;
  if (payload.has_value()) v1::ErrorReason_Parse(std::string(*payload), &reason);
  return reason;
}

std::string ErrorFieldOf(const absl::Status& status) {
  auto payload = status.GetPayload(kFieldPayload);
  return payload.has_value() ? std::string(*payload) : std::string();
}

}  // namespace kvcellar::server
