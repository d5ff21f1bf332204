// Tests server/sd_notify.h against a datagram socket standing in for systemd's: the state is sent
// as one datagram to $NOTIFY_SOCKET (a path or an abstract '@' name), nothing happens outside
// systemd, and an unreachable socket is an error.
#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvcellar::server {
namespace {

// Sets NOTIFY_SOCKET for one test and unsets it after.
class NotifySocketEnv {
 public:
  explicit NotifySocketEnv(const std::string& value) {
    ::setenv("NOTIFY_SOCKET", value.c_str(), 1);
  }
  ~NotifySocketEnv() { ::unsetenv("NOTIFY_SOCKET"); }
};

// systemd's end: a datagram socket bound to `name` ('@' first: the abstract namespace).
class Listener {
 public:
  explicit Listener(const std::string& name) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, name.data(), name.size());
    if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  }
  ~Listener() { ::close(fd_); }

  // The next datagram ("" when none arrives).
  std::string Receive() {
    char buf[256];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

 private:
  int fd_ = -1;
};

TEST(SdNotifyTest, OutsideSystemdDoesNothing) {
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_TRUE(SdNotify("READY=1").ok());
  NotifySocketEnv empty("");
  EXPECT_TRUE(SdNotify("READY=1").ok());
}

TEST(SdNotifyTest, StateGoesToTheSocketAsOneDatagram) {
  storage::testing::TempDir dir;
  const std::string path = dir.path() + "/notify";
  Listener systemd(path);
  NotifySocketEnv env(path);
  ASSERT_TRUE(SdNotify("READY=1").ok());
  ASSERT_TRUE(SdNotify("STOPPING=1\nSTATUS=draining").ok());
  EXPECT_EQ(systemd.Receive(), "READY=1");
  EXPECT_EQ(systemd.Receive(), "STOPPING=1\nSTATUS=draining");
  EXPECT_EQ(systemd.Receive(), "");
}

TEST(SdNotifyTest, AbstractSocketName) {
  const std::string name = absl::StrCat("@kvcellar-sd-notify-test-", ::getpid());
  Listener systemd(name);
  NotifySocketEnv env(name);
  ASSERT_TRUE(SdNotify("READY=1").ok());
  EXPECT_EQ(systemd.Receive(), "READY=1");
}

TEST(SdNotifyTest, UnreachableOrInvalidSocketIsAnError) {
  storage::testing::TempDir dir;
  {
    NotifySocketEnv env(dir.path() + "/nobody-listens");
    EXPECT_EQ(SdNotify("READY=1").code(), absl::StatusCode::kUnavailable);
  }
  NotifySocketEnv env("/" + std::string(200, 'x'));
  EXPECT_EQ(SdNotify("READY=1").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcellar::server
