// Tests server/rpc/unix_socket.h with real sockets in a temp directory: a path made ready for a
// bind (parents created, stale socket replaced, a live daemon or a regular file refused, an
// untrusted directory refused), the mode and group applied after the bind, and removal.
#include "server/rpc/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvcellar::server {
namespace {

using storage::testing::TempDir;
using ::testing::HasSubstr;

// A socket bound to `path`; listening when `listen`. Closed (leaving the file) on destruction.
class BoundSocket {
 public:
  BoundSocket(const std::string& path, bool listen) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
    if (listen) {
      EXPECT_EQ(::listen(fd_, 1), 0);
    }
  }
  ~BoundSocket() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

bool IsSocket(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
  return st.st_mode & 07777;
}

TEST(UnixSocketTest, MissingParentDirectoriesAreCreatedForOwnerAndGroup) {
  TempDir dir;
  const std::string path = dir.path() + "/run/kvcellar/kvc.sock";
  ASSERT_TRUE(PrepareUnixSocketPath(path).ok());
  EXPECT_EQ(ModeOf(dir.path() + "/run/kvcellar"), 0750u);
  EXPECT_FALSE(IsSocket(path));
  BoundSocket bound(path, true);  // The path can be bound.
  EXPECT_TRUE(IsSocket(path));
}

TEST(UnixSocketTest, StaleSocketOfACrashedDaemonIsReplaced) {
  TempDir dir;
  const std::string path = dir.path() + "/kvc.sock";
  BoundSocket crashed(path, true);
  crashed.Close();  // The file stays; nobody accepts on it.
  ASSERT_TRUE(IsSocket(path));
  EXPECT_TRUE(PrepareUnixSocketPath(path).ok());
  EXPECT_FALSE(IsSocket(path));
}

TEST(UnixSocketTest, LiveListenerIsRefused) {
  TempDir dir;
  const std::string path = dir.path() + "/kvc.sock";
  BoundSocket live(path, true);
  absl::Status s = PrepareUnixSocketPath(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("another process"));
  EXPECT_TRUE(IsSocket(path)) << "the live daemon's socket stays";
}

TEST(UnixSocketTest, RegularFileIsNeverReplaced) {
  TempDir dir;
  const std::string path = dir.path() + "/kvc.sock";
  std::ofstream(path) << "precious";
  absl::Status s = PrepareUnixSocketPath(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is not a socket"));
  std::string content;
  std::ifstream(path) >> content;
  EXPECT_EQ(content, "precious");
  RemoveUnixSocket(path);
  std::ifstream still(path);
  EXPECT_TRUE(still.good()) << "RemoveUnixSocket removes sockets only";
}

TEST(UnixSocketTest, DirectoryOthersMayWriteIsRefused) {
  TempDir dir;
  const std::string open_dir = dir.path() + "/open";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  EXPECT_EQ(PrepareUnixSocketPath(open_dir + "/kvc.sock").code(),
            absl::StatusCode::kPermissionDenied);
  // The sticky bit (as on /tmp) keeps others from swapping our socket: accepted.
  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);
  EXPECT_TRUE(PrepareUnixSocketPath(open_dir + "/kvc.sock").ok());
}

TEST(UnixSocketTest, EmptyPathIsInvalid) {
  EXPECT_EQ(PrepareUnixSocketPath("").code(), absl::StatusCode::kInvalidArgument);
}

TEST(UnixSocketTest, SecureAppliesModeAndGroup) {
  TempDir dir;
  const std::string path = dir.path() + "/kvc.sock";
  BoundSocket bound(path, true);
  ASSERT_TRUE(SecureUnixSocket(path, 0660, "").ok());
  EXPECT_EQ(ModeOf(path), 0660u);
  // A numeric gid (a Kubernetes fsGroup has no /etc/group entry): our own group is allowed.
  ASSERT_TRUE(SecureUnixSocket(path, 0600, absl::StrCat(::getegid())).ok());
  EXPECT_EQ(ModeOf(path), 0600u);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, ::getegid());

  absl::Status s = SecureUnixSocket(path, 0660, "no-such-group-kvcellar");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'listen.unix_socket_group'"));
  EXPECT_EQ(ModeOf(path), 0600u) << "nothing applied on error";
}

TEST(UnixSocketTest, RemoveDeletesTheSocket) {
  TempDir dir;
  const std::string path = dir.path() + "/kvc.sock";
  BoundSocket bound(path, true);
  RemoveUnixSocket(path);
  EXPECT_FALSE(IsSocket(path));
  RemoveUnixSocket(path);  // Already gone: nothing happens.
}

}  // namespace
}  // namespace kvcellar::server
