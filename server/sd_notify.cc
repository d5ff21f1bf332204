#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcellar::server {

absl::Status SdNotify(absl::string_view state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || *path == '\0') return absl::OkStatus();
  size_t len = std::strlen(path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (len >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET '", path, "' is too long"));
  }
  std::memcpy(addr.sun_path, path, len);
  // A leading '@' names a socket in the abstract namespace.
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
  ssize_t sent = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                          reinterpret_cast<const sockaddr*>(&addr), addr_len);
  int err = errno;
  ::close(fd);
  if (sent != static_cast<ssize_t>(state.size())) {
    return absl::UnavailableError(
        absl::StrCat("sd_notify to '", path, "': ", sent < 0 ? std::strerror(err) : "short write"));
  }
  return absl::OkStatus();
}

}  // namespace kvcellar::server
