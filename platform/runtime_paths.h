// Where a kvcellard on its embedded defaults puts its sockets, so the daemon, the client library
// and kvcellarctl agree without configuration.
#ifndef KVCELLAR_PLATFORM_RUNTIME_PATHS_H_
#define KVCELLAR_PLATFORM_RUNTIME_PATHS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvcellar::platform {

inline constexpr char kDefaultSocketName[] = "kvcellard.sock";
inline constexpr char kDefaultAdminSocketName[] = "kvcellard-admin.sock";

// $RUNTIME_DIRECTORY (set by systemd's RuntimeDirectory=) if present, else
// $XDG_RUNTIME_DIR/kvcellar, else /tmp/kvcellar-UID. Reads the environment on each call.
std::string DefaultRuntimeDir();

// DefaultRuntimeDir()/file_name.
std::string DefaultSocketPath(absl::string_view file_name = kDefaultSocketName);

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_RUNTIME_PATHS_H_
