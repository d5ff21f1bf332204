// The operators' HTTP listener: Prometheus metrics at /metrics, and the liveness and readiness
// probes /healthz and /readyz (Kubernetes-style). A cpp-httplib server on its own threads, apart
// from gRPC, so a scrape or a probe never competes with engine RPCs for a completion queue.
//
// Routes (GET and HEAD; any other method on them is 405, any other path 404):
//   /metrics  200, the registry's text exposition, Content-Type kPrometheusTextContentType
//   /healthz  200 "ok" when live() is true, else 503 "not live"
//   /readyz   200 "ready" when ready() is true, else 503 "not ready"
//
// Threading: Start, Stop and the destructor are called from the owner's thread. Requests are
// served by kHttpWorkerThreads worker threads plus one accepting thread; the registry's Scrape,
// ready() and live() run on the workers, so they must be thread-safe. Connections are not kept
// alive: each serves one request, so an idle client holds a worker for a few seconds at most
// (kIdleConnectionTimeoutSeconds in the .cc), and probes are not starved by a lingering scraper.
#ifndef KVCELLAR_SERVER_HTTP_SERVER_H_
#define KVCELLAR_SERVER_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kvcellar::server {

// Workers that serve requests. Two cover a Prometheus server scraping while a kubelet probes;
// a third absorbs one slow or idle client. Small on purpose: this listener is for operators.
inline constexpr int kHttpWorkerThreads = 3;

class HttpServer {
 public:
  // Binds `address` ("host:port", "[v6-host]:port", ":port" for every IPv4 interface or
  // "[::]:port" for every interface; port 0 picks an ephemeral port, see port()) and serves.
  // `registry` must outlive the server. A null `ready` or `live` counts as always true.
  // InvalidArgument for a malformed address or a host that does not resolve; for a failed bind
  // (address in use, not local, no permission) the status of the bind's errno. Every error
  // message names the address.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& address,
                                                           MetricsRegistry* registry,
                                                           std::function<bool()> ready,
                                                           std::function<bool()> live);

  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port: the one asked for, or the ephemeral one when it was 0.
  int port() const { return port_; }

  // Closes the listening socket, lets in-flight requests finish and joins every thread.
  // Idempotent.
  void Stop();

 private:
  HttpServer(std::string address, MetricsRegistry* registry, std::function<bool()> ready,
             std::function<bool()> live);
  void Handle(const httplib::Request& req, httplib::Response& res) const;

  const std::string address_;
  MetricsRegistry* const registry_;
  const std::function<bool()> ready_;
  const std::function<bool()> live_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread listener_;
  std::atomic<bool> listen_returned_{false};  // set by listener_ when the accept loop exits
  absl::Mutex stop_mu_;                       // serializes Stop()
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_HTTP_SERVER_H_
