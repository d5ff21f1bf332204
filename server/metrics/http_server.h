// The operators' HTTP listener: Prometheus metrics at /metrics, and the liveness and readiness
// probes /healthz and /readyz (Kubernetes-style). A small event-driven HTTP/1.1 server of its
// own, apart from gRPC, so a scrape or a probe never competes with engine RPCs for a completion
// queue, and no number of idle, slow or abusive clients can delay a probe past a bound.
//
// Routes (GET and HEAD; any other method on them is 405, any other path 404):
//   /metrics  200, the registry's text exposition, Content-Type kPrometheusTextContentType
//   /healthz  200 "ok" when live() is true, else 503 "not live"
//   /readyz   200 "ready" when ready() is true, else 503 "not ready"
// A request head that is not HTTP is 400; one over max_request_head_bytes is 431.
//
// Why a server of its own: a thread per connection (cpp-httplib's model, used before) lets a few
// idle keep-alive or slow-header clients hold every worker, and the kubelet's liveness probe then
// restarts a healthy daemon. Here one event-loop thread (epoll, non-blocking sockets) owns every
// connection and bounds what each may cost:
// - every connection serves one request and is closed after its response ("Connection: close");
// - the request head must arrive within request_head_timeout of the accept, however the client
//   trickles it, and within max_request_head_bytes;
// - the response must be rendered and taken by the client within response_timeout;
// - at most max_connections are open; accepting one more closes the oldest connection that is
//   finishing a close, else the oldest still reading its request, else the oldest awaiting its
//   response, so a flood of sockets cannot lock the listener out of new probes;
// - /healthz and /readyz are answered inside the loop; /metrics is rendered on a separate scrape
//   thread (requests arriving during a render share the next one), so a slow scrape delays only
//   scrapes. The loop writes every response non-blocking;
// - a rendered exposition is shared by every scraper it was rendered for, never copied per
//   connection, and each turn of the loop reads requests and answers probes before it writes,
//   at most 64 KiB per connection: a burst of scrapers of a large exposition costs a probe at
//   most one bounded turn (200 scrapes of a few MB delayed /healthz by up to 1.8 s before).
//
// Threading: Start, Stop and the destructor are called from the owner's thread. The event-loop
// thread runs ready() and live(), which must be cheap and thread-safe; the scrape thread runs the
// registry's Scrape. kHttpServerThreads threads in all, started by Start and joined by Stop. No
// lock is held while calling ready(), live() or Scrape().
#ifndef KVCELLAR_SERVER_METRICS_HTTP_SERVER_H_
#define KVCELLAR_SERVER_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

// The event loop and the scrape thread.
inline constexpr int kHttpServerThreads = 2;

// Bounds on what a client may cost. The defaults are what kvcellard uses; tests shorten them.
struct HttpServerOptions {
  // From the accept to the end of the request head ("\r\n\r\n"). Probes and scrapers send their
  // few hundred bytes at once; 5 s is the read timeout the cpp-httplib listener used before.
  std::chrono::milliseconds request_head_timeout{5000};
  // From the end of the request head to the last byte of the response taken by the client,
  // rendering included. Prometheus gives up on a scrape after 10 s (its default scrape_timeout).
  std::chrono::milliseconds response_timeout{10000};
  // Open connections at most. A kubelet and a Prometheus server need a handful; 1024 leaves room
  // for many scrapers and is far below the unit's LimitNOFILE=65536 (deploy/systemd). Should
  // descriptors run out first, accept(2)'s EMFILE closes our oldest connection the same way.
  size_t max_connections = 1024;
  // Request line plus headers. Ours are a few hundred bytes; 16 KiB is more than any real
  // client sends to these routes (nginx's default large_client_header_buffers is 4 x 8 KiB).
  size_t max_request_head_bytes = 16 * 1024;
};

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
                                                           std::function<bool()> live,
                                                           HttpServerOptions options = {});

  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port: the one asked for, or the ephemeral one when it was 0.
  int port() const { return port_; }

  // Closes the listening socket and every connection that has not sent a whole request, lets
  // responses under way finish (within response_timeout), and joins both threads. Idempotent.
  void Stop();

 private:
  class EventLoop;  // the event loop's state; touched by the loop thread only

  HttpServer(std::string address, MetricsRegistry* registry, std::function<bool()> ready,
             std::function<bool()> live, HttpServerOptions options);

  // The scrape thread: renders the registry for every pending /metrics request and hands the
  // text back to the loop through done_ and wake_fd_.
  void ScrapeLoop();
  // Called by the loop: queues a render for connection `id`.
  void RequestScrape(uint64_t id);
  // Called by the loop: the renders finished since the last call.
  std::vector<std::pair<uint64_t, std::shared_ptr<const std::string>>> TakeScrapes();
  void Wake();  // makes the loop's epoll_wait return

  const std::string address_;
  MetricsRegistry* const registry_;
  const std::function<bool()> ready_;
  const std::function<bool()> live_;
  const HttpServerOptions options_;
  int port_ = 0;
  int listen_fd_ = -1;  // owned by the loop once it runs
  int wake_fd_ = -1;    // an eventfd: Stop and finished scrapes wake the loop with it
  std::unique_ptr<EventLoop> loop_;
  std::atomic<bool> stopping_{false};

  absl::Mutex scrape_mu_;
  absl::CondVar scrape_cv_;
  std::vector<uint64_t> scrape_wanted_ ABSL_GUARDED_BY(scrape_mu_);  // connection ids
  std::vector<std::pair<uint64_t, std::shared_ptr<const std::string>>> scrape_done_
      ABSL_GUARDED_BY(scrape_mu_);
  bool scrape_stop_ ABSL_GUARDED_BY(scrape_mu_) = false;

  std::thread loop_thread_;
  std::thread scrape_thread_;
  absl::Mutex stop_mu_;  // serializes Stop()
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_METRICS_HTTP_SERVER_H_
