// Tests server/rpc/unix_listener.h and peer_credentials.h: connections accepted by the daemon
// itself, each call carrying the kernel's credentials of the process that connected.
#include "server/rpc/unix_listener.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

// Answers Heartbeat, remembering who called.
class WhoCalls final : public v1::CacheService::CallbackService {
 public:
  explicit WhoCalls(const PeerCredentials* credentials) : credentials_(credentials) {}
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest*,
                                      v1::HeartbeatResponse*) override {
    {
      absl::MutexLock lock(&mu_);
      last_ = credentials_->Identify(context);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  PeerIdentity last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }

 private:
  const PeerCredentials* const credentials_;
  absl::Mutex mu_;
  PeerIdentity last_;
};

std::string TempSocket() {
  static std::atomic<int> n{0};
  std::string path = absl::StrCat("/tmp/kvc-listener-test-", getpid(), "-", n++, ".sock");
  ::unlink(path.c_str());
  return path;
}

grpc::Status CallHeartbeat(const std::string& path) {
  auto stub = v1::CacheService::NewStub(
      grpc::CreateChannel(absl::StrCat("unix:", path), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::HeartbeatResponse resp;
  return stub->Heartbeat(&ctx, v1::HeartbeatRequest(), &resp);
}

int RawConnect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return -err;
  }
  return fd;
}

struct Served {
  PeerCredentials credentials;
  WhoCalls service{&credentials};
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<UnixListener> listener;
  std::string path = TempSocket();

  explicit Served(size_t max_per_uid = 0) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    absl::StatusOr<std::unique_ptr<UnixListener>> l =
        UnixListener::Start(path, server.get(), &credentials, max_per_uid);
    EXPECT_TRUE(l.ok()) << l.status();
    if (l.ok()) listener = *std::move(l);
  }
  ~Served() {
    listener.reset();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ::unlink(path.c_str());
  }
};

TEST(UnixListenerTest, EveryCallCarriesTheKernelsCredentialsOfTheCaller) {
  Served s;
  ASSERT_NE(s.listener, nullptr);
  for (int i = 0; i < 3; ++i) {  // Three channels, three connections.
    ASSERT_TRUE(CallHeartbeat(s.path).ok());
    const PeerIdentity who = s.service.last();
    EXPECT_EQ(who.kind, PeerIdentity::Kind::kUnix);
    EXPECT_EQ(who.uid, ::getuid());
    EXPECT_EQ(who.gid, ::getgid());
    EXPECT_EQ(who.pid, ::getpid());
    EXPECT_EQ(who.Describe(),
              absl::StrCat("uid ", ::getuid(), " gid ", ::getgid(), " pid ", ::getpid()));
  }
  EXPECT_EQ(s.listener->accepted(), 3u);
}

// True when the daemon side closed `fd` within `timeout` (the client reads end of file).
bool ClosedByDaemon(int fd, int timeout_ms = 3000) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) == 0;
}

TEST(UnixListenerTest, OneUserHoldsAtMostItsConnections) {
  Served s(/*max_per_uid=*/3);
  ASSERT_NE(s.listener, nullptr);
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(RawConnect(s.path));
    ASSERT_GE(held.back(), 0);
  }
  // The fourth is accepted by the kernel and closed by the daemon at once.
  const int fourth = RawConnect(s.path);
  ASSERT_GE(fourth, 0);
  EXPECT_TRUE(ClosedByDaemon(fourth));
  ::close(fourth);
  EXPECT_FALSE(ClosedByDaemon(held[0], 100)) << "the held ones stay open";
  EXPECT_EQ(s.listener->refused(), 1u);
  EXPECT_FALSE(CallHeartbeat(s.path).ok()) << "a gRPC client of the same user is refused too";

  // Once the user closes one, gRPC closes its end, and the next connection is admitted.
  ::close(held[0]);
  held.erase(held.begin());
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {
    served = CallHeartbeat(s.path).ok();
    if (!served) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(served);
  for (int fd : held) ::close(fd);
}

TEST(UnixListenerTest, StopRefusesNewConnections) {
  Served s;
  ASSERT_NE(s.listener, nullptr);
  ASSERT_TRUE(CallHeartbeat(s.path).ok());
  s.listener.reset();  // Stops and closes the listening socket.
  EXPECT_EQ(RawConnect(s.path), -ECONNREFUSED);
}

TEST(UnixListenerTest, BindErrorsNameThePath) {
  PeerCredentials credentials;
  WhoCalls service(&credentials);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  absl::StatusOr<std::unique_ptr<UnixListener>> l =
      UnixListener::Start("/nonexistent-kvc-dir/x.sock", server.get(), &credentials);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(l.status().message(), HasSubstr("cannot listen on unix:/nonexistent-kvc-dir/x.sock"));
  l = UnixListener::Start(std::string(200, 'x'), server.get(), &credentials);
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr("longer than 107 bytes"));
  server->Shutdown();
}

TEST(PeerCredentialsTest, CallsWithoutAContextAreInProcess) {
  PeerCredentials credentials;
  EXPECT_EQ(credentials.Identify(nullptr).kind, PeerIdentity::Kind::kInProcess);
}

}  // namespace
}  // namespace kvcellar::server
