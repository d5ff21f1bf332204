// Tests server/http_server.h with a real HTTP client against a listener on an ephemeral port.
#include "server/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

// As in server/http_server.cc: Debian's compiled cpp-httplib was built with these, and its
// header's class layouts depend on them.
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

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

int CountThreads() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_.RegisterCounter("kvcellar_test_requests_total", "Requests.", {"method"})
        .value()
        ->WithLabels({"Match"})
        .Add(5);
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(
        "127.0.0.1:0", &registry_, [this] { return ready_.load(); },
        [this] { return live_.load(); });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_connection_timeout(5, 0);
    client_->set_read_timeout(5, 0);
  }

  MetricsRegistry registry_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> live_{true};
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpServerTest, ServesMetrics) {
  httplib::Result res = client_->Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(res->body,
            "# HELP kvcellar_test_requests_total Requests.\n"
            "# TYPE kvcellar_test_requests_total counter\n"
            "kvcellar_test_requests_total{method=\"Match\"} 5\n");
  // Scrapes see live values.
  registry_.RegisterCounter("kvcellar_test_requests_total", "Requests.", {"method"})
      .value()
      ->WithLabels({"Match"})
      .Increment();
  res = client_->Get("/metrics?name[]=ignored");
  ASSERT_TRUE(res);
  EXPECT_THAT(res->body, HasSubstr("kvcellar_test_requests_total{method=\"Match\"} 6\n"));
  // HEAD: same status and headers, no body.
  res = client_->Head("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "");
}

TEST_F(HttpServerTest, BodyPassesPromtool) {
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  httplib::Result res = client_->Get("/metrics");
  ASSERT_TRUE(res);
  const std::string path = absl::StrCat(::testing::TempDir(), "/http_metrics_", getpid(), ".prom");
  FILE* f = fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fwrite(res->body.data(), 1, res->body.size(), f);
  fclose(f);
  const int rc = std::system(absl::StrCat("promtool check metrics < '", path, "'").c_str());
  unlink(path.c_str());
  EXPECT_EQ(rc, 0);
}

TEST_F(HttpServerTest, HealthAndReadinessFollowCallbacks) {
  httplib::Result res = client_->Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok");
  res = client_->Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
  EXPECT_EQ(res->body, "not ready");

  ready_ = true;
  res = client_->Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ready");

  live_ = false;
  res = client_->Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
  ready_ = false;
  res = client_->Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
}

TEST_F(HttpServerTest, UnknownPathsAndMethods) {
  for (const char* path : {"/", "/metricsx", "/metrics/", "/healthz/x", "/debug"}) {
    httplib::Result res = client_->Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 404) << path;
  }
  for (const char* path : {"/metrics", "/healthz", "/readyz"}) {
    httplib::Result res = client_->Post(path, "x=1", "application/x-www-form-urlencoded");
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 405) << path;
    EXPECT_EQ(res->get_header_value("Allow"), "GET, HEAD") << path;
    res = client_->Delete(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 405) << path;
  }
  httplib::Result res = client_->Post("/nowhere", "", "text/plain");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST(HttpServerStartTest, UsesFewThreadsAndStopsIdempotently) {
  const int before_start = CountThreads();
  {
    MetricsRegistry registry;
    std::unique_ptr<HttpServer> server =
        HttpServer::Start("127.0.0.1:0", &registry, nullptr, nullptr).value();
    httplib::Client client("127.0.0.1", server->port());
    // Served once, so the worker pool (started by the accept thread) exists.
    httplib::Result res = client.Get("/readyz");  // null callbacks: always ready
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_EQ(CountThreads() - before_start, 1 + kHttpWorkerThreads);
    server->Stop();
    server->Stop();
    EXPECT_EQ(CountThreads(), before_start);
    EXPECT_FALSE(client.Get("/readyz"));  // nothing listens any more
  }                                       // the destructor stops again
}

TEST(HttpServerStartTest, StartStopRacesAreSafe) {
  MetricsRegistry registry;
  for (int i = 0; i < 50; ++i) {
    std::unique_ptr<HttpServer> server =
        HttpServer::Start("127.0.0.1:0", &registry, nullptr, nullptr).value();
    if (i % 2 == 0) server->Stop();  // else only the destructor
  }
}

TEST(HttpServerStartTest, OccupiedPortIsAClearError) {
  // A port held by someone else.
  const int sock = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(sock, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));

  MetricsRegistry registry;
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(address, &registry, nullptr, nullptr);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr(address));
  EXPECT_THAT(server.status().message(), HasSubstr("in use"));
  close(sock);

  // Another kvcellard's listener counts as occupied too (no SO_REUSEPORT sharing).
  std::unique_ptr<HttpServer> first =
      HttpServer::Start("127.0.0.1:0", &registry, nullptr, nullptr).value();
  const std::string taken = absl::StrCat("127.0.0.1:", first->port());
  absl::StatusOr<std::unique_ptr<HttpServer>> second =
      HttpServer::Start(taken, &registry, nullptr, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr(taken));
}

TEST(HttpServerStartTest, MalformedAddressesAreInvalidArguments) {
  MetricsRegistry registry;
  for (const char* address : {"", "no-port", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:-1",
                              "127.0.0.1:65536", "::1:9400", "[::1:9400", "127.0.0.1:9400x"}) {
    absl::StatusOr<std::unique_ptr<HttpServer>> server =
        HttpServer::Start(address, &registry, nullptr, nullptr);
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_THAT(server.status().message(), HasSubstr(absl::StrCat("'", address, "'")));
  }
  EXPECT_EQ(HttpServer::Start("127.0.0.1:0", nullptr, nullptr, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpServerStartTest, AllInterfacesWhenHostIsEmpty) {
  MetricsRegistry registry;
  std::unique_ptr<HttpServer> server = HttpServer::Start(":0", &registry, nullptr, nullptr).value();
  httplib::Client client("127.0.0.1", server->port());
  httplib::Result res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

}  // namespace
}  // namespace kvcellar::server
