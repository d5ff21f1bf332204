// Conversions between the client API's value types (client_types.h) and kvcellar.v1 messages.
// Internal to libkvcellar-client: the public headers never include generated protobuf code.
#ifndef KVCELLAR_CLIENT_PROTO_CONVERT_H_
#define KVCELLAR_CLIENT_PROTO_CONVERT_H_

#include <string>

#include "absl/strings/string_view.h"
#include "client/client_types.h"
#include "core/namespace_spec.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "kvcellar/v1/common.pb.h"

namespace kvcellar::client {

void ToProto(const core::NamespaceSpec& ns, v1::NamespaceSpec* out);

// The RegisterEngineRequest for `reg` (replace_existing as given in `reg`).
v1::RegisterEngineRequest ToRegisterRequest(const EngineRegistration& reg);

// Unknown numbers map to the rule each enum states (docs/api.md "Compatibility within v1"):
// PageStatus -> kInternalError (failed page), OpState -> kFailed, ReleaseOutcome -> kUnknown.
PageStatus FromProto(v1::PageStatus s);
OpState FromProto(v1::OpState s);
ReleaseOutcome FromProto(v1::ReleaseOutcome s);

// Copies an OpResult message; ref.generation is set by the caller.
void FromProto(const v1::OpResult& in, OpResult* out);

// N concatenated 32-byte keys.
void AppendKeys(absl::Span<const core::PageKey> keys, std::string* out);

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_PROTO_CONVERT_H_
