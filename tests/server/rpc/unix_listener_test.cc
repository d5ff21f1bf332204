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
  MetricsRegistry registry;
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
        UnixListener::Start(path, server.get(), &credentials, max_per_uid, &registry);
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

// True when the daemon side closed `fd` within `timeout` (the client reads end of file); what
// the daemon wrote before is appended to `said`.
bool ClosedByDaemon(int fd, int timeout_ms = 3000, std::string* said = nullptr) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  for (;;) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
    if (said != nullptr) said->append(buf, static_cast<size_t>(n));
  }
}

TEST(UnixListenerTest, OneUserHoldsAtMostItsConnections) {
  Served s(/*max_per_uid=*/3);
  ASSERT_NE(s.listener, nullptr);
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(RawConnect(s.path));
    ASSERT_GE(held.back(), 0);
  }
  // The fourth is accepted by the kernel, answered with the server preface (it sends no call to
  // be told why) and closed by the daemon within RefusedConnections::kLinger.
  const int fourth = RawConnect(s.path);
  ASSERT_GE(fourth, 0);
  std::string said;
  EXPECT_TRUE(ClosedByDaemon(fourth, 3000, &said));
  EXPECT_EQ(said, http2::ServerPreface());
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

// A refused gRPC client learns why (it saw only "Broken pipe" before issue #24), and the
// refusal is counted under its uid.
TEST(UnixListenerTest, ARefusedGrpcClientIsToldWhyAndCountedByUid) {
  Served s(/*max_per_uid=*/1);
  ASSERT_NE(s.listener, nullptr);
  const int held = RawConnect(s.path);
  ASSERT_GE(held, 0);
  absl::SleepFor(absl::Milliseconds(100));  // Accepted before the next.
  const absl::Time start = absl::Now();
  const grpc::Status refused = CallHeartbeat(s.path);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "answered, not left to its deadline";
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(),
              HasSubstr(absl::StrCat("kvcellard refused the connection: uid ", ::getuid(),
                                     " already holds 1 connections to this socket "
                                     "(listen.max_connections_per_uid)")));
  EXPECT_GE(s.listener->refused(), 1u);
  EXPECT_THAT(s.registry.Scrape(),
              HasSubstr(absl::StrCat("kvcellar_unix_connections_refused_total{uid=\"", ::getuid(),
                                     "\"} ", s.listener->refused(), "\n")));
  ::close(held);
}

// Bytes that are not HTTP/2 end a refused connection at once.
TEST(UnixListenerTest, ARefusedConnectionThatIsNotHttp2IsClosed) {
  Served s(/*max_per_uid=*/1);
  ASSERT_NE(s.listener, nullptr);
  const int held = RawConnect(s.path);
  ASSERT_GE(held, 0);
  absl::SleepFor(absl::Milliseconds(100));
  const int other = RawConnect(s.path);
  ASSERT_GE(other, 0);
  ASSERT_EQ(::send(other, "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL), 18);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(ClosedByDaemon(other, 3000));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900)) << "not kept for the linger";
  ::close(other);
  ::close(held);
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
