#include "server/rpc/unix_socket.h"

#include <errno.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcellar::server {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// True when something accepts connections on PATH right now.
absl::StatusOr<bool> SocketIsLive(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("unix socket path '", path, "' is longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", ErrnoText(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(fd);
  if (rc == 0) return true;
  if (err == ECONNREFUSED || err == ENOENT) return false;
  return absl::FailedPreconditionError(
      absl::StrCat("cannot probe unix socket '", path, "': ", ErrnoText(err)));
}

// The socket's directory must be ours: anyone may pre-create /tmp/kvcellar-UID, and whoever owns
// the directory can swap the socket under us. Missing directories are created 0750 (owner and
// group may reach the socket; its own mode then decides who may connect).
absl::Status PrepareSocketDirectory(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create directory '", dir, "': ", ec.message()));
    }
    ::chmod(dir.c_str(), 0750);
    return absl::OkStatus();
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", dir, "' is not a directory"));
  }
  bool trusted_owner = st.st_uid == ::geteuid() || st.st_uid == 0;
  bool others_can_write = (st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_ISVTX) == 0;
  if (!trusted_owner || others_can_write) {
    return absl::PermissionDeniedError(absl::StrCat(
        "socket directory '", dir, "' is owned by uid ", st.st_uid,
        " or writable by others; refusing to listen there"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareUnixSocketPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("unix socket path is empty");
  std::filesystem::path p(path);
  if (p.has_parent_path()) {
    absl::Status dir = PrepareSocketDirectory(p.parent_path().string());
    if (!dir.ok()) return dir;
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("cannot stat '", path, "': ", ErrnoText(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' exists and is not a socket; refusing to replace it"));
  }
  absl::StatusOr<bool> live = SocketIsLive(path);
  if (!live.ok()) return live.status();
  if (*live) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another process (probably another kvcellard) is listening on '", path,
        "'; stop it or choose another listen.unix_socket"));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale socket '", path, "': ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::Status SecureUnixSocket(const std::string& path, mode_t mode, const std::string& group) {
  if (!group.empty()) {
    // A name from the group database, or a numeric gid: a Kubernetes fsGroup has no /etc/group
    // entry inside the container.
    gid_t gid = 0;
    uint32_t numeric = 0;
    if (absl::SimpleAtoi(group, &numeric)) {
      gid = static_cast<gid_t>(numeric);
    } else {
      std::vector<char> buf(16384);
      struct group grp {};
      struct group* result = nullptr;
      int rc = ::getgrnam_r(group.c_str(), &grp, buf.data(), buf.size(), &result);
      if (rc != 0 || result == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("'listen.unix_socket_group': no such group '", group, "'"));
      }
      gid = result->gr_gid;
    }
    if (::chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
      return absl::PermissionDeniedError(absl::StrCat("chown '", path, "' to group '", group,
                                                      "': ", ErrnoText(errno)));
    }
  }
  if (::chmod(path.c_str(), mode) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod '", path, "': ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

void RemoveUnixSocket(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path.c_str());
}

}  // namespace kvcellar::server
