#include "server/http_server.h"

#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

// Debian's libcpp-httplib-dev is cpp-httplib's compiled ("split") build, made with OpenSSL, zlib
// and Brotli support. Its header changes the layout of Request and the client classes with these
// macros, so every file that includes it must define them as the library was built
// (`pkg-config --cflags cpp-httplib`), and the binary must link -lcpp-httplib.
#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT 1
#endif
#ifndef CPPHTTPLIB_ZLIB_SUPPORT
#define CPPHTTPLIB_ZLIB_SUPPORT 1
#endif
#ifndef CPPHTTPLIB_BROTLI_SUPPORT
#define CPPHTTPLIB_BROTLI_SUPPORT 1
#endif
#include <httplib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace kvcellar::server {
namespace {

// Seconds a connected client may wait before it starts its request. Scrapers and probes send at
// once; this bounds how long a silent client holds a worker (and delays Stop()).
constexpr time_t kIdleConnectionTimeoutSeconds = 2;
// Seconds a client may take to send the rest of its request, and to take the response.
constexpr time_t kReadTimeoutSeconds = 5;
constexpr time_t kWriteTimeoutSeconds = 5;
// Requests here have no body; anything larger than this is not for us.
constexpr size_t kMaxPayloadBytes = 64 * 1024;

constexpr char kPlainText[] = "text/plain; charset=utf-8";

struct HostPort {
  std::string host;
  int port = 0;
};

absl::StatusOr<HostPort> ParseAddress(const std::string& address) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP listen address '", address, "': ", why,
                     " (expected host:port, [v6-host]:port or :port)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  HostPort out;
  out.host = address.substr(0, colon);
  if (!out.host.empty() && out.host.front() == '[') {
    if (out.host.size() < 2 || out.host.back() != ']') return bad("unbalanced brackets");
    out.host = out.host.substr(1, out.host.size() - 2);
  } else if (out.host.find(':') != std::string::npos) {
    return bad("an IPv6 host must be in brackets");
  }
  if (out.host.empty()) out.host = "0.0.0.0";
  const std::string port = address.substr(colon + 1);
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port, &out.port) || out.port > 65535) {
    return bad("port must be a number from 0 to 65535");
  }
  // Resolve here to report a bad host by name; httplib would only say that binding failed.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  if (const int rc = getaddrinfo(out.host.c_str(), nullptr, &hints, &result); rc != 0) {
    return bad(absl::StrCat("host '", out.host, "' does not resolve: ", gai_strerror(rc)));
  }
  freeaddrinfo(result);
  return out;
}

// httplib's default sets SO_REUSEPORT alone, which would let a second kvcellard bind the same
// metrics port and silently take half the scrapes. SO_REUSEADDR only allows a restart to rebind
// while old connections sit in TIME_WAIT.
void SetSocketOptions(int sock) {
  const int yes = 1;
  setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

}  // namespace

HttpServer::HttpServer(std::string address, MetricsRegistry* registry, std::function<bool()> ready,
                       std::function<bool()> live)
    : address_(std::move(address)),
      registry_(registry),
      ready_(std::move(ready)),
      live_(std::move(live)),
      server_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& address,
                                                              MetricsRegistry* registry,
                                                              std::function<bool()> ready,
                                                              std::function<bool()> live) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP listener on '", address, "': no metrics registry"));
  }
  absl::StatusOr<HostPort> host_port = ParseAddress(address);
  if (!host_port.ok()) return host_port.status();

  std::unique_ptr<HttpServer> server(
      new HttpServer(address, registry, std::move(ready), std::move(live)));
  httplib::Server& http = *server->server_;
  http.new_task_queue = [] { return new httplib::ThreadPool(kHttpWorkerThreads); };
  http.set_socket_options(SetSocketOptions);
  http.set_keep_alive_max_count(1);
  http.set_keep_alive_timeout(kIdleConnectionTimeoutSeconds);
  http.set_read_timeout(kReadTimeoutSeconds, 0);
  http.set_write_timeout(kWriteTimeoutSeconds, 0);
  http.set_payload_max_length(kMaxPayloadBytes);
  HttpServer* self = server.get();
  http.set_pre_routing_handler([self](const httplib::Request& req, httplib::Response& res) {
    self->Handle(req, res);
    return httplib::Server::HandlerResponse::Handled;
  });

  // httplib reports a failed bind as false; the errno of the failing bind(2) or listen(2) is
  // still set, as only a successful close(2) follows it.
  errno = 0;
  int port = host_port->port;
  if (port == 0) {
    port = http.bind_to_any_port(host_port->host);
  } else if (!http.bind_to_port(host_port->host, port)) {
    port = -1;
  }
  if (port < 0) {
    const int err = errno;
    const std::string message = absl::StrCat("cannot listen for HTTP on '", address, "'");
    if (err == 0) return absl::UnavailableError(message);
    return absl::ErrnoToStatus(err, message);
  }
  server->port_ = port;
  server->listener_ = std::thread([self] {
    self->server_->listen_after_bind();
    self->listen_returned_.store(true, std::memory_order_release);
  });
  KVLOG(Info, "http listener started", {{"address", address}, {"port", port}});
  return server;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  absl::MutexLock lock(&stop_mu_);
  if (!listener_.joinable()) return;
  // httplib's stop() does nothing until the accept loop has started (it checks is_running()),
  // and must be called once only (a second call on a closing server trips an assert). So: wait
  // for the loop to start, or to have ended on its own, then stop it once.
  while (!server_->is_running() && !listen_returned_.load(std::memory_order_acquire)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!listen_returned_.load(std::memory_order_acquire)) server_->stop();
  listener_.join();  // the accept loop joins its workers before it returns
  KVLOG(Info, "http listener stopped", {{"address", address_}, {"port", port_}});
}

void HttpServer::Handle(const httplib::Request& req, httplib::Response& res) const {
  enum class Route { kMetrics, kHealthz, kReadyz };
  Route route;
  if (req.path == "/metrics") {
    route = Route::kMetrics;
  } else if (req.path == "/healthz") {
    route = Route::kHealthz;
  } else if (req.path == "/readyz") {
    route = Route::kReadyz;
  } else {
    res.status = 404;
    res.set_content("not found\n", kPlainText);
    return;
  }
  if (req.method != "GET" && req.method != "HEAD") {
    res.status = 405;
    res.set_header("Allow", "GET, HEAD");
    res.set_content("method not allowed\n", kPlainText);
    return;
  }
  switch (route) {
    case Route::kMetrics:
      res.status = 200;
      res.set_content(registry_->Scrape(), kPrometheusTextContentType);
      return;
    case Route::kHealthz: {
      const bool live = !live_ || live_();
      res.status = live ? 200 : 503;
      res.set_content(live ? "ok" : "not live", kPlainText);
      return;
    }
    case Route::kReadyz: {
      const bool ready = !ready_ || ready_();
      res.status = ready ? 200 : 503;
      res.set_content(ready ? "ready" : "not ready", kPlainText);
      return;
    }
  }
}

}  // namespace kvcellar::server
