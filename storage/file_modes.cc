#include "storage/file_modes.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstdio>

namespace kvcellar::storage {

std::optional<mode_t> ReadProcessUmask() {
  FILE* f = std::fopen("/proc/self/status", "re");
  if (f == nullptr) return std::nullopt;
  std::optional<mode_t> mask;
  char line[256];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned int m = 0;
    if (std::sscanf(line, "Umask: %o", &m) == 1) {
      mask = static_cast<mode_t>(m);
      break;
    }
  }
  std::fclose(f);
  return mask;
}

FileModes FileModes::ForProcessUmask() { return ForUmask(ReadProcessUmask()); }

FileModes FileModes::ForUmask(std::optional<mode_t> umask) {
  return FileModes(!umask.has_value() || (*umask & (kDirMode | kObjectMode)) != 0);
}

int FileModes::MakeDir(int dirfd, const char* path) const {
  if (::mkdirat(dirfd, path, kDirMode) != 0) return -1;
  if (chmod_after_create_) ::fchmodat(dirfd, path, kDirMode, 0);
  return 0;
}

void FileModes::FixObject(int fd) const {
  // Only where the umask took the owner's bits (never by default): a synchronous fchmod.
  if (chmod_after_create_) ::fchmod(fd, kObjectMode);
}

}  // namespace kvcellar::storage
