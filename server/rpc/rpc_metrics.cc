#include "server/rpc/rpc_metrics.h"

#include <chrono>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Every method name of every service the daemon registers is a series; 256 is far above that
// and bounds what an unknown-method flood could create.
constexpr size_t kMaxRpcSeries = 256;

// Canonical gRPC status code names, as grpc-go and grpcurl print them.
absl::string_view CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "Canceled";
    case grpc::StatusCode::UNKNOWN: return "Unknown";
    case grpc::StatusCode::INVALID_ARGUMENT: return "InvalidArgument";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DeadlineExceeded";
    case grpc::StatusCode::NOT_FOUND: return "NotFound";
    case grpc::StatusCode::ALREADY_EXISTS: return "AlreadyExists";
    case grpc::StatusCode::PERMISSION_DENIED: return "PermissionDenied";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "ResourceExhausted";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FailedPrecondition";
    case grpc::StatusCode::ABORTED: return "Aborted";
    case grpc::StatusCode::OUT_OF_RANGE: return "OutOfRange";
    case grpc::StatusCode::UNIMPLEMENTED: return "Unimplemented";
    case grpc::StatusCode::INTERNAL: return "Internal";
    case grpc::StatusCode::UNAVAILABLE: return "Unavailable";
    case grpc::StatusCode::DATA_LOSS: return "DataLoss";
    case grpc::StatusCode::UNAUTHENTICATED: return "Unauthenticated";
    default: return "Unknown";
  }
}

class RpcMetricsInterceptor : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(absl::string_view full_method, CounterFamily* requests,
                        HistogramFamily* duration)
      : requests_(requests), duration_(duration), start_(std::chrono::steady_clock::now()) {
    // "/kvcellar.v1.CacheService/Match" -> service "kvcellar.v1.CacheService", method "Match".
    absl::string_view m = full_method;
    if (!m.empty() && m[0] == '/') m.remove_prefix(1);
    size_t slash = m.find('/');
    service_ = slash == absl::string_view::npos ? m : m.substr(0, slash);
    method_ = slash == absl::string_view::npos ? absl::string_view() : m.substr(slash + 1);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      const absl::string_view labels[] = {service_, method_, CodeName(status.error_code())};
      requests_->WithLabels(labels).Increment();
      duration_->WithLabels(absl::MakeConstSpan(labels, 2)).Observe(seconds);
    }
    methods->Proceed();
  }

 private:
  CounterFamily* requests_;
  HistogramFamily* duration_;
  std::chrono::steady_clock::time_point start_;
  // Views into the method string, which gRPC keeps alive for the call.
  absl::string_view service_;
  absl::string_view method_;
};

template <typename T>
T* MustRegister(absl::StatusOr<T*> family) {
  if (!family.ok()) {
    // The names are fixed in this file; a failure is a programming error found by every test.
    KVLOG(Error, "metric registration failed", {{"error", std::string(family.status().message())}});
    std::abort();
  }
  return *family;
}

}  // namespace

RpcMetricsInterceptorFactory::RpcMetricsInterceptorFactory(MetricsRegistry* registry) {
  const absl::string_view labels[] = {"service", "method", "code"};
  requests_ = MustRegister(registry->RegisterCounter(
      "kvcellar_rpc_requests_total", "gRPC requests handled, by service, method and status code.",
      labels, kMaxRpcSeries));
  duration_ = MustRegister(registry->RegisterHistogram(
      "kvcellar_rpc_duration_seconds",
      "gRPC request latency in seconds, from the call reaching the server to its status being sent.",
      absl::MakeConstSpan(labels, 2), DefaultLatencyBuckets(), kMaxRpcSeries));
}

grpc::experimental::Interceptor* RpcMetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RpcMetricsInterceptor(info->method(), requests_, duration_);
}

}  // namespace kvcellar::server
