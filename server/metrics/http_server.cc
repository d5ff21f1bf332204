#include "server/metrics/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <unordered_map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

using Clock = std::chrono::steady_clock;

// After the response, the write side is shut and the connection is kept this long reading (and
// dropping) whatever the client still sends, until its EOF. Closing a socket with unread input
// sends a reset, which can destroy a response the client has not read yet (a POST's body that
// arrives after the 405, say). nginx's lingering_close does the same; 1 s covers a loopback or
// LAN client's round trip many times over.
constexpr std::chrono::milliseconds kLingerTimeout{1000};
// When accept(2) fails for want of file descriptors and no connection of ours can be closed to
// free one, the listener is ignored this long rather than retried in a busy loop.
constexpr std::chrono::milliseconds kAcceptPause{100};
// Bytes read per read(2): a probe's or scraper's request head fits in one.
constexpr size_t kReadChunkBytes = 4096;
// Work per epoll_wait, so that neither a burst of connections nor one fast sender can keep the
// loop from expiring deadlines and answering others (every descriptor is level-triggered, so
// what is left is reported again).
constexpr int kMaxEventsPerWait = 256;
constexpr int kMaxAcceptsPerWakeup = 64;
// Bytes written to one connection per turn of the loop. A large exposition (hundreds of KiB with
// many namespaces) sent to a burst of scrapers in one go kept a probe waiting for the whole
// burst: 200 scrapes delayed /healthz by up to 1.8 s (issue #24). With this bound a turn costs
// at most kMaxEventsPerWait * 64 KiB of copying (16 MiB, milliseconds), and a probe that arrives
// meanwhile is answered in the next turn. 64 KiB is a loopback socket's default send buffer
// (net.ipv4.tcp_wmem) several times over, so a scraper that keeps up is not slowed.
constexpr size_t kMaxWriteBytesPerTurn = 64 * 1024;

// epoll_event.data of the two descriptors that are not connections; connection ids start above.
constexpr uint64_t kListenerId = 0;
constexpr uint64_t kWakeId = 1;

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
  // Resolve here to report a bad host by name; a failed bind would only say that binding failed.
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

// A non-blocking listening socket on the first of the host's addresses that binds.
// SO_REUSEADDR only, never SO_REUSEPORT: the latter would let a second kvcellard bind the same
// metrics port and silently take half the scrapes; the former only lets a restart rebind while
// old connections sit in TIME_WAIT. An IPv6 socket also takes IPv4 ("[::]" is every interface).
absl::StatusOr<int> Listen(const HostPort& host_port, const std::string& address) {
  const std::string message = absl::StrCat("cannot listen for HTTP on '", address, "'");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const std::string port = std::to_string(host_port.port);
  if (const int rc = getaddrinfo(host_port.host.c_str(), port.c_str(), &hints, &result); rc != 0) {
    return absl::UnavailableError(absl::StrCat(message, ": ", gai_strerror(rc)));
  }
  int err = 0;
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    const int fd =
        socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    const int yes = 1;
    const int no = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof(no));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
      freeaddrinfo(result);
      return fd;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(result);
  if (err == 0) return absl::UnavailableError(message);
  return absl::ErrnoToStatus(err, message);
}

int BoundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

absl::string_view Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 503:
      return "Service Unavailable";
  }
  return "Unknown";
}

// The status line and headers of a response whose body has `body_bytes`. Content-Length is the
// body's even for HEAD, which sends no body (RFC 9110 9.3.2: the same header fields as GET).
std::string FormatHead(int status, absl::string_view content_type, size_t body_bytes) {
  std::string out = absl::StrCat("HTTP/1.1 ", status, " ", Reason(status),
                                 "\r\nConnection: close\r\nContent-Length: ", body_bytes,
                                 "\r\nContent-Type: ", content_type, "\r\n");
  if (status == 405) absl::StrAppend(&out, "Allow: GET, HEAD\r\n");
  absl::StrAppend(&out, "\r\n");
  return out;
}

// A whole small response (probes, errors).
std::string FormatResponse(int status, absl::string_view content_type, absl::string_view body,
                           bool head_only) {
  std::string out = FormatHead(status, content_type, body.size());
  if (!head_only) absl::StrAppend(&out, body);
  return out;
}

struct RequestLine {
  absl::string_view method;
  absl::string_view path;  // without the query
};

// "METHOD SP request-target SP HTTP/1.x"; the target in origin form ("/p?q") or absolute form
// ("http://host/p?q"). False when it is not that.
bool ParseRequestLine(absl::string_view head, RequestLine* out) {
  const absl::string_view line = head.substr(0, head.find("\r\n"));
  const size_t sp1 = line.find(' ');
  if (sp1 == absl::string_view::npos || sp1 == 0) return false;
  const size_t sp2 = line.find(' ', sp1 + 1);
  if (sp2 == absl::string_view::npos || line.find(' ', sp2 + 1) != absl::string_view::npos) {
    return false;
  }
  const absl::string_view version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return false;
  absl::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  for (absl::string_view scheme : {"http://", "https://"}) {
    if (absl::StartsWith(target, scheme)) {
      target.remove_prefix(scheme.size());
      const size_t slash = target.find('/');
      target = slash == absl::string_view::npos ? "/" : target.substr(slash);
    }
  }
  if (target.empty()) return false;
  out->method = line.substr(0, sp1);
  out->path = target.substr(0, target.find_first_of("?#"));
  return true;
}

// Each connection is in one phase, and in the list of that phase. A phase's timeout is the same
// for every connection, and a connection enters the list at its back when it enters the phase,
// so every list is in deadline order and its front is the next to expire (and the oldest).
enum class Phase {
  kReading,     // reading the request head; deadline: accept + request_head_timeout
  kResponding,  // awaiting a scrape, or writing; deadline: head read + response_timeout
  kLingering,   // response written, write side shut, awaiting EOF; deadline: + kLingerTimeout
};

struct Connection {
  uint64_t id = 0;
  int fd = -1;
  Phase phase = Phase::kReading;
  Clock::time_point deadline;
  bool head_only = false;  // a HEAD request: the response has no body
  std::string in;          // the request head so far
  std::string out;         // the response, or the head of a scrape's response
  // A scrape's body, after `out`: one text shared by every scraper it was rendered for, never
  // copied per connection. Null for other responses and for HEAD.
  std::shared_ptr<const std::string> body;
  size_t written = 0;  // bytes of `out` then `body` sent
};

}  // namespace

class HttpServer::EventLoop {
 public:
  EventLoop(HttpServer* server, int epoll_fd) : server_(server), epoll_fd_(epoll_fd) {}
  ~EventLoop() { close(epoll_fd_); }

  // Until Stop(): accepts, reads, answers, writes and expires. Closes every socket it owns
  // (the listener included) before it returns.
  void Run();

 private:
  using List = std::list<Connection>;

  List& ListOf(Phase phase);
  void Dispatch(const epoll_event& event);
  void Accept();
  void OnReadable(Connection& conn);
  void OnRequestHead(Connection& conn, size_t head_end);
  void Respond(Connection& conn, std::string response,
               std::shared_ptr<const std::string> body = nullptr);
  void Flush(Connection& conn);
  void WantWritable(Connection& conn);  // EPOLLOUT for `conn`
  void Drain(Connection& conn);
  void DeliverScrapes();
  void MoveTo(Connection& conn, Phase phase, Clock::time_point deadline, uint32_t events);
  void Close(Connection& conn);
  bool EvictOne();
  void ExpireDeadlines(Clock::time_point now);
  int WaitMillis(Clock::time_point now) const;
  void BeginStop();
  void CloseAll();

  HttpServer* const server_;
  const int epoll_fd_;
  List reading_, responding_, lingering_;
  std::unordered_map<uint64_t, List::iterator> by_id_;
  uint64_t next_id_ = kWakeId + 1;
  bool stopped_ = false;  // BeginStop ran: no listener, no new connections
  bool accept_paused_ = false;
  Clock::time_point accept_resume_;
};

HttpServer::EventLoop::List& HttpServer::EventLoop::ListOf(Phase phase) {
  switch (phase) {
    case Phase::kReading:
      return reading_;
    case Phase::kResponding:
      return responding_;
    case Phase::kLingering:
      return lingering_;
  }
  return reading_;
}

void HttpServer::EventLoop::Run() {
  std::array<epoll_event, kMaxEventsPerWait> events;
  while (true) {
    const int n = epoll_wait(epoll_fd_, events.data(), events.size(), WaitMillis(Clock::now()));
    if (n < 0 && errno != EINTR) {
      KVLOG(Error, "http listener epoll_wait failed",
            {{"address", server_->address_}, {"error", strerror(errno)}});
      break;
    }
    // Writes last: a turn answers the probes and reads the requests that arrived before it
    // spends its write budget on scrapers.
    for (int i = 0; i < n; ++i) {
      if ((events[i].events & EPOLLOUT) == 0) Dispatch(events[i]);
    }
    for (int i = 0; i < n; ++i) {
      if ((events[i].events & EPOLLOUT) != 0) Dispatch(events[i]);
    }
    if (server_->stopping_.load(std::memory_order_acquire) && !stopped_) BeginStop();
    ExpireDeadlines(Clock::now());
    if (stopped_ && responding_.empty()) break;
  }
  CloseAll();
}

void HttpServer::EventLoop::Dispatch(const epoll_event& event) {
  // epoll_event is packed on x86-64: its u64 sits at offset 4, so it is read by value, never bound
  // to a reference (a misaligned uint64_t&, which UBSan reports).
  const uint64_t id = event.data.u64;
  if (id == kListenerId) {
    if (!stopped_) Accept();
    return;
  }
  if (id == kWakeId) {
    uint64_t count;
    while (read(server_->wake_fd_, &count, sizeof(count)) > 0) {
    }
    DeliverScrapes();
    return;
  }
  const auto it = by_id_.find(id);
  if (it == by_id_.end()) return;  // closed earlier in this batch
  Connection& conn = *it->second;
  if (event.events & (EPOLLERR | EPOLLHUP)) {
    Close(conn);
    return;
  }
  switch (conn.phase) {
    case Phase::kReading:
      if (event.events & EPOLLIN) OnReadable(conn);
      return;
    case Phase::kResponding:
      if (event.events & EPOLLOUT) Flush(conn);
      return;
    case Phase::kLingering:
      if (event.events & EPOLLIN) Drain(conn);
      return;
  }
}

void HttpServer::EventLoop::Accept() {
  for (int i = 0; i < kMaxAcceptsPerWakeup; ++i) {
    const int fd = accept4(server_->listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (EvictOne()) continue;
        // Nothing of ours to give up: let the level-triggered listener rest a moment.
        epoll_event ev{};
        ev.data.u64 = kListenerId;
        epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, server_->listen_fd_, &ev);
        accept_paused_ = true;
        accept_resume_ = Clock::now() + kAcceptPause;
      }
      return;  // EAGAIN: none left
    }
    if (by_id_.size() >= server_->options_.max_connections) EvictOne();
    Connection conn;
    conn.id = next_id_++;
    conn.fd = fd;
    conn.phase = Phase::kReading;
    conn.deadline = Clock::now() + server_->options_.request_head_timeout;
    reading_.push_back(std::move(conn));
    by_id_.emplace(reading_.back().id, std::prev(reading_.end()));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = reading_.back().id;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) Close(reading_.back());
  }
}

void HttpServer::EventLoop::OnReadable(Connection& conn) {
  const size_t limit = server_->options_.max_request_head_bytes;
  char buf[kReadChunkBytes];
  const ssize_t n = read(conn.fd, buf, std::min(sizeof(buf), limit - conn.in.size()));
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {  // EOF before a whole head, or a reset
    Close(conn);
    return;
  }
  // The terminator may straddle the previous read.
  const size_t from = conn.in.size() < 3 ? 0 : conn.in.size() - 3;
  conn.in.append(buf, n);
  const size_t end = conn.in.find("\r\n\r\n", from);
  if (end != std::string::npos) {
    OnRequestHead(conn, end);
  } else if (conn.in.size() >= limit) {
    Respond(conn, FormatResponse(431, kPlainText, "request header fields too large\n", false));
  }
}

void HttpServer::EventLoop::OnRequestHead(Connection& conn, size_t head_end) {
  RequestLine request;
  if (!ParseRequestLine(absl::string_view(conn.in).substr(0, head_end), &request)) {
    Respond(conn, FormatResponse(400, kPlainText, "bad request\n", false));
    return;
  }
  conn.head_only = request.method == "HEAD";
  enum class Route { kMetrics, kHealthz, kReadyz };
  Route route;
  if (request.path == "/metrics") {
    route = Route::kMetrics;
  } else if (request.path == "/healthz") {
    route = Route::kHealthz;
  } else if (request.path == "/readyz") {
    route = Route::kReadyz;
  } else {
    Respond(conn, FormatResponse(404, kPlainText, "not found\n", conn.head_only));
    return;
  }
  if (request.method != "GET" && request.method != "HEAD") {
    Respond(conn, FormatResponse(405, kPlainText, "method not allowed\n", conn.head_only));
    return;
  }
  switch (route) {
    case Route::kMetrics:
      // Rendered on the scrape thread; DeliverScrapes writes it. No events are wanted meanwhile
      // (an error or hang-up is still reported, and closes the connection).
      MoveTo(conn, Phase::kResponding, Clock::now() + server_->options_.response_timeout, 0);
      server_->RequestScrape(conn.id);
      return;
    case Route::kHealthz: {
      const bool live = !server_->live_ || server_->live_();
      Respond(conn, FormatResponse(live ? 200 : 503, kPlainText, live ? "ok" : "not live",
                                   conn.head_only));
      return;
    }
    case Route::kReadyz: {
      const bool ready = !server_->ready_ || server_->ready_();
      Respond(conn, FormatResponse(ready ? 200 : 503, kPlainText, ready ? "ready" : "not ready",
                                   conn.head_only));
      return;
    }
  }
}

void HttpServer::EventLoop::Respond(Connection& conn, std::string response,
                                    std::shared_ptr<const std::string> body) {
  if (conn.phase != Phase::kResponding) {
    MoveTo(conn, Phase::kResponding, Clock::now() + server_->options_.response_timeout, 0);
  }
  std::string().swap(conn.in);
  conn.out = std::move(response);
  conn.body = std::move(body);
  conn.written = 0;
  Flush(conn);
}

void HttpServer::EventLoop::Flush(Connection& conn) {
  const size_t total = conn.out.size() + (conn.body ? conn.body->size() : 0);
  size_t budget = kMaxWriteBytesPerTurn;
  while (conn.written < total) {
    if (budget == 0) {
      // This turn's share is written; the rest in later turns, after the other connections'.
      WantWritable(conn);
      return;
    }
    // What is left of `out`, then of `body`, up to the budget.
    iovec iov[2];
    int iovcnt = 0;
    size_t room = budget;
    const auto add = [&](const char* data, size_t len) {
      len = std::min(len, room);
      if (len == 0) return;
      iov[iovcnt++] = {const_cast<char*>(data), len};
      room -= len;
    };
    if (conn.written < conn.out.size()) {
      add(conn.out.data() + conn.written, conn.out.size() - conn.written);
    }
    if (conn.body) {
      const size_t from = conn.written > conn.out.size() ? conn.written - conn.out.size() : 0;
      add(conn.body->data() + from, conn.body->size() - from);
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    const ssize_t n = sendmsg(conn.fd, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      WantWritable(conn);
      return;
    }
    if (n <= 0) {
      Close(conn);
      return;
    }
    conn.written += n;
    budget -= std::min(budget, static_cast<size_t>(n));
  }
  shutdown(conn.fd, SHUT_WR);
  if (stopped_) {  // no lingering once stopping: nothing else is served
    Close(conn);
    return;
  }
  std::string().swap(conn.out);
  conn.body.reset();
  MoveTo(conn, Phase::kLingering, Clock::now() + kLingerTimeout, EPOLLIN);
}

void HttpServer::EventLoop::WantWritable(Connection& conn) {
  epoll_event ev{};
  ev.events = EPOLLOUT;
  ev.data.u64 = conn.id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn.fd, &ev);
}

void HttpServer::EventLoop::Drain(Connection& conn) {
  char buf[kReadChunkBytes];
  const ssize_t n = read(conn.fd, buf, sizeof(buf));
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) Close(conn);  // the client's EOF: done
}

void HttpServer::EventLoop::DeliverScrapes() {
  for (auto& [id, text] : server_->TakeScrapes()) {
    const auto it = by_id_.find(id);
    // Gone (expired, evicted, reset) while its scrape rendered.
    if (it == by_id_.end() || it->second->phase != Phase::kResponding) continue;
    Connection& conn = *it->second;
    Respond(conn, FormatHead(200, kPrometheusTextContentType, text->size()),
            conn.head_only ? nullptr : text);
  }
}

void HttpServer::EventLoop::MoveTo(Connection& conn, Phase phase, Clock::time_point deadline,
                                   uint32_t events) {
  const auto it = by_id_.at(conn.id);
  List& to = ListOf(phase);
  to.splice(to.end(), ListOf(conn.phase), it);  // iterators stay valid across splice
  conn.phase = phase;
  conn.deadline = deadline;
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = conn.id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn.fd, &ev);
}

void HttpServer::EventLoop::Close(Connection& conn) {
  close(conn.fd);  // also removes it from the epoll set
  const auto it = by_id_.find(conn.id);
  const List::iterator node = it->second;
  by_id_.erase(it);
  ListOf(node->phase).erase(node);  // destroys `conn`
}

// Frees a connection slot for a newcomer: a connection already answered goes first, then the
// oldest still reading its request (an idle or slow client: a prompt one would be done), and
// only then one awaiting its response. False when there is none.
bool HttpServer::EventLoop::EvictOne() {
  for (List* list : {&lingering_, &reading_, &responding_}) {
    if (!list->empty()) {
      Close(list->front());
      return true;
    }
  }
  return false;
}

void HttpServer::EventLoop::ExpireDeadlines(Clock::time_point now) {
  for (List* list : {&reading_, &responding_, &lingering_}) {
    while (!list->empty() && list->front().deadline <= now) Close(list->front());
  }
  if (accept_paused_ && accept_resume_ <= now && !stopped_) {
    accept_paused_ = false;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenerId;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, server_->listen_fd_, &ev);
  }
}

int HttpServer::EventLoop::WaitMillis(Clock::time_point now) const {
  std::optional<Clock::time_point> next;
  for (const List* list : {&reading_, &responding_, &lingering_}) {
    if (!list->empty() && (!next || list->front().deadline < *next)) next = list->front().deadline;
  }
  if (accept_paused_ && (!next || accept_resume_ < *next)) next = accept_resume_;
  if (!next) return -1;
  if (*next <= now) return 0;
  // Rounded up: waking before the deadline would only spin until it.
  const auto wait = std::chrono::ceil<std::chrono::milliseconds>(*next - now).count();
  return static_cast<int>(std::min<int64_t>(wait, 60'000));
}

void HttpServer::EventLoop::BeginStop() {
  stopped_ = true;
  close(server_->listen_fd_);
  server_->listen_fd_ = -1;
  while (!reading_.empty()) Close(reading_.front());
  while (!lingering_.empty()) Close(lingering_.front());
}

void HttpServer::EventLoop::CloseAll() {
  if (server_->listen_fd_ >= 0) {
    close(server_->listen_fd_);
    server_->listen_fd_ = -1;
  }
  for (List* list : {&reading_, &responding_, &lingering_}) {
    while (!list->empty()) Close(list->front());
  }
}

HttpServer::HttpServer(std::string address, MetricsRegistry* registry, std::function<bool()> ready,
                       std::function<bool()> live, HttpServerOptions options)
    : address_(std::move(address)),
      registry_(registry),
      ready_(std::move(ready)),
      live_(std::move(live)),
      options_(options) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& address,
                                                              MetricsRegistry* registry,
                                                              std::function<bool()> ready,
                                                              std::function<bool()> live,
                                                              HttpServerOptions options) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP listener on '", address, "': no metrics registry"));
  }
  if (options.max_connections == 0 || options.max_request_head_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP listener on '", address, "': connection and header limits must be > 0"));
  }
  absl::StatusOr<HostPort> host_port = ParseAddress(address);
  if (!host_port.ok()) return host_port.status();

  std::unique_ptr<HttpServer> server(
      new HttpServer(address, registry, std::move(ready), std::move(live), options));
  const auto failed = [&address](int err) {
    const std::string message = absl::StrCat("cannot listen for HTTP on '", address, "'");
    return err == 0 ? absl::UnavailableError(message) : absl::ErrnoToStatus(err, message);
  };
  absl::StatusOr<int> listen_fd = Listen(*host_port, address);
  if (!listen_fd.ok()) return listen_fd.status();
  server->listen_fd_ = *listen_fd;  // from here on the destructor closes what Start opened
  server->port_ = BoundPort(*listen_fd);
  server->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (server->wake_fd_ < 0 || epoll_fd < 0 || server->port_ <= 0) {
    const int err = errno;
    if (epoll_fd >= 0) close(epoll_fd);
    return failed(err);
  }
  server->loop_ = std::make_unique<EventLoop>(server.get(), epoll_fd);
  for (const auto& [fd, id] :
       {std::pair{server->listen_fd_, kListenerId}, std::pair{server->wake_fd_, kWakeId}}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = id;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) return failed(errno);
  }

  HttpServer* self = server.get();
  server->scrape_thread_ = std::thread([self] { self->ScrapeLoop(); });
  server->loop_thread_ = std::thread([self] { self->loop_->Run(); });
  KVLOG(Info, "http listener started",
        {{"address", address},
         {"port", server->port_},
         {"max_connections", options.max_connections}});
  return server;
}

HttpServer::~HttpServer() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);  // only when Start failed before the loop ran
  if (wake_fd_ >= 0) close(wake_fd_);
}

void HttpServer::Stop() {
  absl::MutexLock lock(&stop_mu_);
  if (!loop_thread_.joinable()) return;
  // The loop sees stopping_ whenever it wakes, however early: the eventfd keeps its count until
  // read, so a Stop right after Start is not lost.
  stopping_.store(true, std::memory_order_release);
  Wake();
  loop_thread_.join();  // after the responses under way: they may still need the scrape thread
  {
    absl::MutexLock scrape_lock(&scrape_mu_);
    scrape_stop_ = true;
    scrape_cv_.SignalAll();
  }
  scrape_thread_.join();
  KVLOG(Info, "http listener stopped", {{"address", address_}, {"port", port_}});
}

void HttpServer::Wake() {
  const uint64_t one = 1;
  // Fails only when the counter would overflow, in which case the loop is woken anyway.
  [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void HttpServer::RequestScrape(uint64_t id) {
  absl::MutexLock lock(&scrape_mu_);
  scrape_wanted_.push_back(id);
  scrape_cv_.Signal();
}

std::vector<std::pair<uint64_t, std::shared_ptr<const std::string>>> HttpServer::TakeScrapes() {
  std::vector<std::pair<uint64_t, std::shared_ptr<const std::string>>> done;
  absl::MutexLock lock(&scrape_mu_);
  done.swap(scrape_done_);
  return done;
}

void HttpServer::ScrapeLoop() {
  while (true) {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&scrape_mu_);
      while (!scrape_stop_ && scrape_wanted_.empty()) scrape_cv_.Wait(&scrape_mu_);
      if (scrape_stop_) return;
      ids.swap(scrape_wanted_);
    }
    // One render for every request waiting: a burst of scrapers costs one Scrape.
    auto text = std::make_shared<const std::string>(registry_->Scrape());
    {
      absl::MutexLock lock(&scrape_mu_);
      for (uint64_t id : ids) scrape_done_.emplace_back(id, text);
    }
    Wake();
  }
}

}  // namespace kvcellar::server
