// Real redis-server processes for the Redis backend tests: started by the test in a temp
// directory (unix socket or a free loopback port), killed in the destructor. Hermetic: no shared
// server, no fixed port.
#ifndef KVCELLAR_TESTS_STORAGE_REDIS_TEST_UTIL_H_
#define KVCELLAR_TESTS_STORAGE_REDIS_TEST_UTIL_H_

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "storage_test_util.h"

namespace kvcellar::storage::testing {

inline constexpr char kRedisServer[] = "/usr/bin/redis-server";

inline bool HaveRedis() { return ::access(kRedisServer, X_OK) == 0; }

// True when `port` can be bound on 127.0.0.1 right now.
inline bool PortFree(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A port whose cluster bus port (+10000) is free too, both below the kernel's ephemeral range
// (32768 and up on Linux): an outgoing connection of a test running beside this one cannot take
// either between the check here and redis-server's bind. Another test may still pick the same
// port; ClusterNode then starts the node again on another one.
inline int PickPort() {
  static std::mt19937 rng(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(::time(nullptr)));
  for (int i = 0; i < 200; ++i) {
    const int port = 10000 + static_cast<int>(rng() % 12768);
    if (PortFree(port) && PortFree(port + 10000)) return port;
  }
  return 0;
}

struct RedisReplyFree {
  void operator()(redisReply* r) const { if (r != nullptr) freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, RedisReplyFree>;

class RedisServer {
 public:
  // Unix socket server (port 0), or a TCP server on a free loopback port (cluster node).
  static std::unique_ptr<RedisServer> Unix(const std::string& dir) {
    auto s = std::unique_ptr<RedisServer>(new RedisServer(dir, 0, false));
    return s->Start() ? std::move(s) : nullptr;
  }
  // A node whose port was taken between PickPort and its bind exits; it is started again on
  // another port (a few tries).
  static std::unique_ptr<RedisServer> ClusterNode(const std::string& dir) {
    for (int attempt = 0; attempt < 5; ++attempt) {
      const int port = PickPort();
      if (port == 0) return nullptr;
      auto s = std::unique_ptr<RedisServer>(new RedisServer(dir, port, true));
      if (s->Start()) return s;
    }
    return nullptr;
  }

  ~RedisServer() { Kill(); }

  bool Start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<std::string> args = {kRedisServer, "--port", std::to_string(port_),
                                       "--save", "", "--appendonly", "no", "--dir", dir_,
                                       "--daemonize", "no", "--loglevel", "warning",
                                       "--logfile", dir_ + "/redis.log"};
      std::vector<std::string> more;
      if (port_ == 0) {
        more = {"--unixsocket", socket_, "--unixsocketperm", "700"};
      } else {
        more = {"--bind", "127.0.0.1", "--protected-mode", "no"};
      }
      args.insert(args.end(), more.begin(), more.end());
      if (cluster_) {
        more = {"--cluster-enabled", "yes", "--cluster-config-file",
                dir_ + "/nodes-" + std::to_string(port_) + ".conf", "--cluster-node-timeout",
                "2000"};
        args.insert(args.end(), more.begin(), more.end());
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(kRedisServer, argv.data());
      ::_exit(127);
    }
    if (pid_ < 0) return false;
    // Ready when it answers PING (bounded). A server that exited (its port taken) has not
    // started, whoever else answers on that port.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      ReplyPtr r = Command({"PING"});
      if (r != nullptr && r->type == REDIS_REPLY_STATUS) return true;
      ::usleep(5000);
    }
    return false;
  }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  void Pause() { ::kill(pid_, SIGSTOP); }
  void Resume() { ::kill(pid_, SIGCONT); }

  std::string address() const {
    return port_ == 0 ? "unix:" + socket_ : "127.0.0.1:" + std::to_string(port_);
  }
  int port() const { return port_; }

  // One command on a fresh blocking connection (tests only; bounded by a 2 s timeout).
  ReplyPtr Command(const std::vector<std::string>& args) const {
    const timeval tv{2, 0};
    redisContext* c = port_ == 0 ? redisConnectUnixWithTimeout(socket_.c_str(), tv)
                                 : redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c == nullptr) return nullptr;
    if (c->err != 0) {
      redisFree(c);
      return nullptr;
    }
    redisSetTimeout(c, tv);
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    ReplyPtr r(static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
    redisFree(c);
    return r;
  }
  std::string CommandString(const std::vector<std::string>& args) const {
    ReplyPtr r = Command(args);
    if (r == nullptr || r->str == nullptr) return "";
    return std::string(r->str, r->len);
  }
  long long CommandInt(const std::vector<std::string>& args) const {
    ReplyPtr r = Command(args);
    return r != nullptr && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
  }

 private:
  RedisServer(const std::string& dir, int port, bool cluster)
      : dir_(dir), socket_(dir + "/redis.sock"), port_(port), cluster_(cluster) {}

  std::string dir_;
  std::string socket_;
  int port_;
  bool cluster_;
  pid_t pid_ = -1;
};

// A fixture with a standalone redis-server on a Unix socket in a temp directory; the test is
// skipped where redis-server is not installed.
class RedisServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveRedis()) GTEST_SKIP() << "redis-server not installed";
    server_ = RedisServer::Unix(dir_.path());
    ASSERT_NE(server_, nullptr) << "redis-server did not start";
  }

  TempDir dir_;
  std::unique_ptr<RedisServer> server_;
};

// Three primaries sharing the slots evenly, built with CLUSTER ADDSLOTSRANGE and MEET.
class RedisCluster {
 public:
  static constexpr int kNodes = 3;

  bool Start(const std::string& dir) {
    for (int i = 0; i < kNodes; ++i) {
      const std::string d = absl::StrCat(dir, "/node", i);
      ::mkdir(d.c_str(), 0755);
      auto n = RedisServer::ClusterNode(d);
      if (n == nullptr) return false;
      nodes.push_back(std::move(n));
    }
    for (int i = 0; i < kNodes; ++i) {
      ids.push_back(nodes[i]->CommandString({"CLUSTER", "MYID"}));
      nodes[i]->Command({"CLUSTER", "SET-CONFIG-EPOCH", std::to_string(i + 1)});
      const int first = First(i), last = First(i + 1) - 1;
      nodes[i]->Command({"CLUSTER", "ADDSLOTSRANGE", std::to_string(first), std::to_string(last)});
    }
    for (int i = 1; i < kNodes; ++i) {
      nodes[0]->Command({"CLUSTER", "MEET", "127.0.0.1", std::to_string(nodes[i]->port())});
    }
    // Converged when every node says ok and knows every node's slots.
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      bool all = true;
      for (auto& n : nodes) {
        const std::string info = n->CommandString({"CLUSTER", "INFO"});
        all = all && info.find("cluster_state:ok") != std::string::npos &&
              info.find("cluster_slots_assigned:16384") != std::string::npos &&
              info.find("cluster_known_nodes:3") != std::string::npos;
        ReplyPtr slots = n->Command({"CLUSTER", "SLOTS"});
        all = all && slots != nullptr && slots->type == REDIS_REPLY_ARRAY && slots->elements == 3;
      }
      if (all) return true;
      ::usleep(20000);
    }
    return false;
  }

  static int First(int i) { return 16384 * i / kNodes; }
  int OwnerOf(int slot) const {
    for (int i = kNodes - 1; i >= 0; --i) {
      if (slot >= First(i)) return i;
    }
    return 0;
  }
  std::vector<std::string> Addresses() const {
    std::vector<std::string> out;
    for (auto& n : nodes) out.push_back(n->address());
    return out;
  }

  std::vector<std::unique_ptr<RedisServer>> nodes;
  std::vector<std::string> ids;
};

}  // namespace kvcellar::storage::testing

#endif  // KVCELLAR_TESTS_STORAGE_REDIS_TEST_UTIL_H_
