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
//    field's request path in kvcellar-error-field when known), and records it in a
//    MalformedRequestLog.
//
// MalformedRequestLog counts such requests (kvcellar_rpc_malformed_requests_total) and logs at
// most one line a minute, saying how many were not logged since the last one: one client sending
// garbage in a loop wrote 11,027 lines in 5 s before (issue #24), as the events' replay socket
// already bounds its malformed requests (event_hub.cc).
//
// A call whose request never arrived (the client cancelled it, its deadline passed, its process
// died mid-call: an engine killed at random in the soak) also comes with a null message. It is
// not a malformed request: when its read failed, or the call is known to be cancelled by the time
// its status is sent, it is answered CANCELLED; its log line waits for the close, and is written
// only for a call that was not cancelled. (A cancellation gRPC reports only after the status was
// sent still counts INVALID_ARGUMENT in kvcellar_rpc_requests_total, but logs nothing.)
//
// Threads: the handler is process-wide (protobuf's only hook), installed once at startup before
// any server starts; the interceptors are created and run on gRPC's threads, and call their
// factory's MalformedRequestLog from them (it is thread-safe).
#ifndef KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_
#define KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

// Replaces protobuf's stderr logging with KVLOG. Idempotent.
void InstallProtobufLogHandler();

// The request path of the field `full_name` ("kvcellar.v1.NamespaceSpec.tenant") inside
// messages of type `root`, shortest first ("namespace_spec.tenant"); a repeated field on the way
// is written "sequences[]". "" when `root` does not contain it.
std::string FieldPath(const google::protobuf::Descriptor* root, absl::string_view full_name);

// Counts the requests that did not parse and logs them, at most one line per `interval`. One
// per daemon, shared by the interceptors of every server.
class MalformedRequestLog {
 public:
  // A minute, as the events' replay log (event_hub.cc): a client in a loop cannot flood the log,
  // and an operator still sees within a minute that one is at it.
  static constexpr absl::Duration kDefaultInterval = absl::Minutes(1);

  // `registry` (may be null: nothing exported) outlives the log.
  explicit MalformedRequestLog(MetricsRegistry* registry,
                               absl::Duration interval = kDefaultInterval);
  MalformedRequestLog(const MalformedRequestLog&) = delete;
  MalformedRequestLog& operator=(const MalformedRequestLog&) = delete;

  // A request of `method` did not parse; `field` is the field at fault ("" when unknown) and
  // `error` the message the client was given. Logged unless a line was written less than
  // `interval` ago; then only counted, and the next line says how many went unlogged.
  void Record(absl::string_view method, absl::string_view field, absl::string_view error);

  uint64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }

 private:
  const absl::Duration interval_;
  Counter* const counter_;  // Null without a registry.
  std::atomic<uint64_t> rejected_{0};
  absl::Mutex mu_;
  absl::Time last_logged_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t unlogged_ ABSL_GUARDED_BY(mu_) = 0;  // Recorded since the last line, not logged.
};

class MalformedRequestInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `log` outlives the factory and every interceptor it creates (the server).
  explicit MalformedRequestInterceptorFactory(MalformedRequestLog* log) : log_(log) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  MalformedRequestLog* const log_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_MALFORMED_REQUEST_H_
