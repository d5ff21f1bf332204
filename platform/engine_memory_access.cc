#include "platform/engine_memory_access.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace kvcellar::platform {

absl::Status MemoryRefusal(std::string message) {
  absl::Status s = absl::PermissionDeniedError(message);
  s.SetPayload(kMemoryRefusalPayload, absl::Cord("1"));
  return s;
}

bool IsMemoryRefusal(const absl::Status& status) {
  return status.GetPayload(kMemoryRefusalPayload).has_value();
}

absl::Status WithPrefix(const absl::Status& status, absl::string_view prefix) {
  absl::Status out(status.code(), absl::StrCat(prefix, status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

absl::StatusOr<FileId> FileId::OfFd(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat(", fd, "): ", strerror(errno)));
  }
  return Of(st);
}

EngineMemoryAccess EngineMemoryAccess::ForPeer(uint32_t uid, int32_t pid) {
  EngineMemoryAccess a;
  a.check_owner_ = true;
  a.uid_ = uid;
  a.pid_ = pid;
  return a;
}

absl::Status EngineMemoryAccess::CheckProcPid(int32_t pid, absl::string_view name) const {
  if (!check_owner_) return absl::OkStatus();
  if (pid_ == 0 || pid != pid_) {
    return MemoryRefusal(
        absl::StrCat(name, ": a /proc fd path must name the registering engine's own process (pid ",
                     pid_ == 0 ? std::string("not visible to the daemon") : absl::StrCat(pid_),
                     "): the daemon maps only memory the engine itself holds"));
  }
  return absl::OkStatus();
}

absl::Status EngineMemoryAccess::CheckProcessMemory(int32_t pid, absl::string_view name) const {
  if (pid == getpid()) {
    return MemoryRefusal(
        absl::StrCat(name,
                     " is the daemon's own memory: engines register their own memory, never the "
                     "daemon's"));
  }
  if (!check_owner_ || pid_ == 0) {
    return MemoryRefusal(absl::StrCat(
        name,
        ": process memory is served only to an engine on the daemon's Unix socket whose "
        "pid the daemon sees (SO_PEERCRED), and only its own"));
  }
  if (pid != pid_) {
    return MemoryRefusal(absl::StrCat(name, " is not the registering engine's own process (pid ",
                                      pid_, "): the daemon reaches only the engine's own memory"));
  }
  return absl::OkStatus();
}

absl::Status EngineMemoryAccess::CheckOpened(const struct stat& st, absl::string_view name) const {
  const FileId id = FileId::Of(st);
  for (const DaemonObject& o : forbidden_) {
    if (o.id == id) {
      return MemoryRefusal(absl::StrCat(name, " is ", o.what,
                                        ": engines register their own memory, never the daemon's"));
    }
  }
  if (check_owner_ && st.st_uid != uid_) {
    return MemoryRefusal(
        absl::StrCat(name, " is owned by uid ", st.st_uid, ", not by the registering engine (uid ",
                     uid_, "): the daemon maps only memory the engine's own user created"));
  }
  return absl::OkStatus();
}

}  // namespace kvcellar::platform
