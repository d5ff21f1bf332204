#include "platform/runtime_paths.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace kvcellar::platform {

std::string DefaultRuntimeDir() {
  if (const char* dir = std::getenv("RUNTIME_DIRECTORY"); dir != nullptr && *dir != '\0') {
    // systemd lists one directory per RuntimeDirectory= entry, separated by ':'; ours is first.
    std::string first(dir);
    return first.substr(0, first.find(':'));
  }
  if (const char* dir = std::getenv("XDG_RUNTIME_DIR"); dir != nullptr && *dir != '\0') {
    return absl::StrCat(dir, "/kvcellar");
  }
  return absl::StrCat("/tmp/kvcellar-", ::getuid());
}

std::string DefaultSocketPath(absl::string_view file_name) {
  return absl::StrCat(DefaultRuntimeDir(), "/", file_name);
}

}  // namespace kvcellar::platform
