// Requests that do not parse: an INVALID_ARGUMENT the daemon logs, not protobuf's stderr line.
//
// kvcellar.v1's `string` fields are proto3 strings, which protobuf's parser requires to be valid
// UTF-8. A request holding invalid UTF-8 in one (or any other bytes that do not parse) never
// reaches a handler: protobuf prints a raw "[libprotobuf ERROR ...]" line on stderr and gRPC
// (1.51) answers UNIMPLEMENTED with no message. Two pieces make it an ordinary rejected request:
//
//  - InstallProtobufLogHandler() routes protobuf's log lines through KVLOG, and notes on the
//    parsing thread which string field held invalid UTF-8;
//  - MalformedRequestInterceptorFactory's interceptor sees that the request did not parse (its
//    message is null after the POST_RECV_MESSAGE hook, which runs on that same thread right after
//    parsing) and replaces the status with INVALID_ARGUMENT (ERROR_REASON_INVALID_FIELD, and the
//    field's request path in kvcellar-error-field when known), logging one line.
//
// A call whose request never arrived (the client cancelled it, its deadline passed, its process
// died mid-call: an engine killed at random in the soak) also comes with a null message. It is
// not a malformed request: when its read failed, or the call is known to be cancelled by the time
// its status is sent, it is answered CANCELLED; its log line waits for the close, and is written
// only for a call that was not cancelled. (A cancellation gRPC reports only after the status was
// sent still counts INVALID_ARGUMENT in kvcellar_rpc_requests_total, but logs nothing.)
//
// Threads: the handler is process-wide (protobuf's only hook), installed once at startup before
// any server starts; the interceptors are created and run on gRPC's threads.
#ifndef KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_
#define KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_

#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/server_interceptor.h"

namespace kvcellar::server {

// Replaces protobuf's stderr logging with KVLOG. Idempotent.
void InstallProtobufLogHandler();

// The request path of the field `full_name` ("kvcellar.v1.NamespaceSpec.tenant") inside
// messages of type `root`, shortest first ("namespace_spec.tenant"); a repeated field on the way
// is written "sequences[]". "" when `root` does not contain it.
std::string FieldPath(const google::protobuf::Descriptor* root, absl::string_view full_name);

class MalformedRequestInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_
