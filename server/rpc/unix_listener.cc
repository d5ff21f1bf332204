#include "server/rpc/unix_listener.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/server_posix.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// The socket is owner-only from bind until SecureUnixSocket applies the configured mode.
constexpr mode_t kBindUmask = 0177;
// Out of fds: how long the accept thread pauses before trying the backlog again.
constexpr int kFdExhaustedPauseMs = 100;
// After a uid's first refused connection is logged, at most one line per uid this often (the
// count of its refusals is exported all along).
constexpr absl::Duration kRefusalLogInterval = absl::Minutes(1);

// The inode of the socket on `fd`, or 0 when fd is closed.
uint64_t InodeOf(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  return st.st_ino;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(const std::string& path,
                                                                  grpc::Server* server,
                                                                  PeerCredentials* credentials,
                                                                  size_t max_per_uid,
                                                                  MetricsRegistry* registry) {
  CounterFamily* refused_by_uid = nullptr;
  if (registry != nullptr) {
    const absl::string_view labels[] = {"uid"};
    absl::StatusOr<CounterFamily*> family =
        registry->RegisterCounter("kvcellar_unix_connections_refused_total",
                                  "Engine-socket connections refused because their user held "
                                  "listen.max_connections_per_uid, by uid.",
                                  labels, kMaxRefusedUidSeries);
    if (!family.ok()) return family.status();
    refused_by_uid = *family;
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("unix socket path '", path, "' is longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  const mode_t old_umask = ::umask(kBindUmask);
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  ::umask(old_umask);
  if (rc != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int err = rc != 0 ? bind_errno : errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(err)));
  }
  const int stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd < 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("eventfd(): ", std::strerror(errno)));
  }
  std::unique_ptr<UnixListener> listener(
      new UnixListener(fd, stop_fd, server, credentials, max_per_uid, refused_by_uid));
  listener->thread_ = std::thread([l = listener.get()] { l->AcceptLoop(); });
  return listener;
}

UnixListener::UnixListener(int listen_fd, int stop_fd, grpc::Server* server,
                           PeerCredentials* credentials, size_t max_per_uid,
                           CounterFamily* refused_by_uid)
    : listen_fd_(listen_fd),
      stop_fd_(stop_fd),
      server_(server),
      credentials_(credentials),
      max_per_uid_(max_per_uid),
      refused_by_uid_(refused_by_uid) {}

UnixListener::~UnixListener() {
  Stop();
  ::close(listen_fd_);
  ::close(stop_fd_);
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof(one)) < 0) {
    KVLOG(Error, "unix listener: cannot signal stop", {{"error", std::strerror(errno)}});
  }
  thread_.join();
}

void UnixListener::AcceptLoop() {
  bool exhausted = false;  // Logged once per episode of fd exhaustion.
  std::vector<pollfd> fds;
  for (;;) {
    // Out of fds, the listening socket stays readable: wait on the stop event (and the refused
    // connections) alone, then retry.
    fds.assign({{stop_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    if (exhausted) fds[1].fd = -1;  // poll ignores a negative fd.
    refusing_.AppendPollFds(&fds);
    int timeout = refusing_.TimeoutMs(absl::Now());
    if (exhausted && (timeout < 0 || timeout > kFdExhaustedPauseMs)) timeout = kFdExhaustedPauseMs;
    const int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0 && errno != EINTR) {
      KVLOG(Error, "unix listener: poll failed", {{"error", std::strerror(errno)}});
      return;
    }
    if (n > 0 && fds[0].revents != 0) return;
    refusing_.OnPoll(fds.data() + 2, n > 0 ? fds.size() - 2 : 0, absl::Now());
    if (!exhausted && (n <= 0 || fds[1].revents == 0)) continue;
    const bool ok = AcceptPending();
    if (!ok && !exhausted) {
      KVLOG(Warn, "unix listener: out of file descriptors; connections wait in the backlog",
            {{"accepted", accepted()}});
    }
    exhausted = !ok;
  }
}

bool UnixListener::AcceptPending() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) return false;
      return true;  // EAGAIN: nothing more pending.
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      // Without credentials the connection cannot be bound to anyone: refuse it.
      KVLOG(Warn, "unix listener: no peer credentials; connection closed",
            {{"error", std::strerror(errno)}});
      ::close(fd);
      continue;
    }
    if (!AdmitUid(cred.uid)) {
      Refuse(fd, cred);
      continue;
    }
    Track(fd, cred.uid);
    // Recorded before gRPC can read a byte, so the first call already finds it.
    credentials_->Record(fd, PeerIdentity::Unix(cred.uid, cred.gid, cred.pid));
    accepted_.fetch_add(1, std::memory_order_relaxed);
    grpc::AddInsecureChannelFromFd(server_, fd);
  }
}

void UnixListener::Refuse(int fd, const ucred& cred) {
  // Counted before the peer can see its answer.
  refused_.fetch_add(1, std::memory_order_relaxed);
  if (refused_by_uid_ != nullptr) {
    const std::string uid = absl::StrCat(cred.uid);
    refused_by_uid_->WithLabels({uid}).Increment();
  }
  const std::string why = absl::StrCat(
      "kvcellard refused the connection: uid ", cred.uid, " already holds ", max_per_uid_,
      " connections to this socket (listen.max_connections_per_uid); close idle channels, share "
      "one channel per process, or raise the bound");
  const absl::Time now = absl::Now();
  auto [last, first] = logged_.try_emplace(cred.uid, now);
  if (first || now - last->second >= kRefusalLogInterval) {
    last->second = now;
    KVLOG(Warn, "unix listener: connection refused, the user holds its maximum",
          {{"uid", cred.uid},
           {"pid", cred.pid},
           {"max_connections_per_uid", max_per_uid_},
           {"refused_total", refused()},
           {"why",
            "each user may hold listen.max_connections_per_uid connections; the client "
            "is told so (UNAVAILABLE) and counted in "
            "kvcellar_unix_connections_refused_total"}});
  }
  refusing_.Add(fd, why, now);
}

bool UnixListener::AdmitUid(uint32_t uid) {
  if (max_per_uid_ == 0) return true;
  auto count = per_uid_.find(uid);
  if (count == per_uid_.end() || count->second < max_per_uid_) return true;
  // At the bound: forget this uid's connections whose fd is no longer that socket.
  for (auto it = open_.begin(); it != open_.end();) {
    if (it->second.uid == uid && InodeOf(it->first) != it->second.inode) {
      --per_uid_[uid];
      open_.erase(it++);
    } else {
      ++it;
    }
  }
  return per_uid_[uid] < max_per_uid_;
}

void UnixListener::Track(int fd, uint32_t uid) {
  if (max_per_uid_ == 0) return;
  // A recorded fd that accept() returns again was closed by gRPC in between.
  if (auto old = open_.find(fd); old != open_.end()) --per_uid_[old->second.uid];
  open_[fd] = Open{InodeOf(fd), uid};
  ++per_uid_[uid];
}

}  // namespace kvcellar::server
