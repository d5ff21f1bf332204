// Per-RPC request counters and latency histograms for every gRPC method the daemon serves,
// recorded by a server interceptor so that no handler can forget them (health and reflection
// included).
//
//   kvcellar_rpc_requests_total{service,method,code}
//   kvcellar_rpc_duration_seconds{service,method}   (histogram, handler start to status sent)
//
// Threads: interceptors are created and run on gRPC's threads; the metric series they update are
// lock-free (server/metrics/metrics.h).
#ifndef KVCELLAR_SERVER_RPC_RPC_METRICS_H_
#define KVCELLAR_SERVER_RPC_RPC_METRICS_H_

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

class RpcMetricsInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // Registers (or finds) the two families in `registry`, which must outlive the factory.
  explicit RpcMetricsInterceptorFactory(MetricsRegistry* registry);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  CounterFamily* requests_;
  HistogramFamily* duration_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_RPC_METRICS_H_
