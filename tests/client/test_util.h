// Helpers shared by the client tests: temp directories, a registration for a sim engine, and a
// real kvcellard child process on a temp socket (KVCELLAR_BIN_DIR).
#ifndef KVCELLAR_TESTS_CLIENT_TEST_UTIL_H_
#define KVCELLAR_TESTS_CLIENT_TEST_UTIL_H_

#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_types.h"
#include "client/sim_engine.h"

namespace kvcellar::client::testing {

class TempDir {
 public:
  TempDir() {
    // Unix socket paths are limited to 108 bytes: stay short, under /tmp.
    char tmpl[] = "/tmp/kvc-client-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline core::NamespaceSpec TestNamespace(bool mla = false, uint32_t tp = 1) {
  core::NamespaceSpec ns;
  ns.tenant = "acme";
  ns.model_id = "tiny-llm";
  ns.model_revision = "rev1";
  ns.kv_dtype = "bf16";
  ns.page_size = 4;
  ns.layout = mla ? core::LayoutKind::kMla : core::LayoutKind::kMha;
  ns.tp_size = tp;
  return ns;
}

inline EngineRegistration WorkerRegistration(const SimEngine& sim, const std::string& instance,
                                             uint32_t rank = 0, uint32_t tp = 1) {
  EngineRegistration reg;
  reg.instance_id = instance;
  reg.rank = rank;
  reg.ns = TestNamespace(sim.options().mla, tp);
  sim.Describe(&reg);
  return reg;
}

inline EngineRegistration SchedulerRegistration(const std::string& instance) {
  EngineRegistration reg;
  reg.instance_id = instance;
  reg.scheduler = true;
  reg.ns = TestNamespace();
  return reg;
}

inline bool SocketAccepts(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// A kvcellard child on `dir`/d.sock with the sim device and short leases.
class DaemonProcess {
 public:
  explicit DaemonProcess(std::string dir, std::vector<std::string> extra = {})
      : dir_(std::move(dir)), extra_(std::move(extra)) {}
  ~DaemonProcess() { Kill(SIGKILL); }

  static std::string Binary() { return std::string(KVCELLAR_BIN_DIR) + "/kvcellard"; }
  std::string socket() const { return dir_ + "/d.sock"; }

  bool Start(absl::Duration timeout = absl::Seconds(20)) {
    // clang-format off
    std::vector<std::string> args = {Binary(),
                                     "--set", "listen.unix_socket=" + socket(),
                                     "--set", "listen.admin_socket=" + dir_ + "/a.sock",
                                     "--set", "http.address=127.0.0.1:0",
                                     "--set", "pool.capacity=64MiB",
                                     "--set", "device.kind=sim",
                                     "--set", "sessions.lease_ms=1000"};
    // clang-format on
    args.insert(args.end(), extra_.begin(), extra_.end());
    const std::string log = dir_ + "/kvcellard.log";
    pid_ = fork();
    if (pid_ == 0) {
      FILE* f = std::fopen(log.c_str(), "a");
      if (f != nullptr) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (SocketAccepts(socket())) return true;
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // Sends `sig` without waiting (SIGSTOP, SIGCONT).
  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }

  // SIGSTOP, and returns once the daemon is stopped: kill() returns before a busy process on a
  // loaded machine has stopped, and it may answer a few more calls meanwhile.
  void StopAndWait() {
    if (pid_ <= 0) return;
    kill(pid_, SIGSTOP);
    int status;
    waitpid(pid_, &status, WUNTRACED);
  }

  // Sends `sig` and reaps the process.
  void Kill(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  std::string dir_;
  std::vector<std::string> extra_;
  pid_t pid_ = -1;
};

// Scheduling noise on a loaded 2-core CI machine (ctest -j runs the 16-engine stress test
// alongside); the deadlines under test are 100-300 ms.
inline constexpr absl::Duration kSlack = absl::Milliseconds(250);

// Client options with short timeouts and backoffs, for tests of failure and reconnection.
inline ClientOptions FastOptions(const std::string& addr,
                                 absl::Duration register_timeout = absl::Milliseconds(300)) {
  ClientOptions o;
  o.addr = addr;
  o.rpc_timeout = absl::Milliseconds(200);
  o.register_timeout = register_timeout;
  o.reconnect_backoff_min = absl::Milliseconds(20);
  o.reconnect_backoff_max = absl::Milliseconds(200);
  return o;
}

}  // namespace kvcellar::client::testing

#endif  // KVCELLAR_TESTS_CLIENT_TEST_UTIL_H_
