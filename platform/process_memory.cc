#include "platform/process_memory.h"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvcellar::platform {
namespace {

constexpr size_t kMaxIov = IOV_MAX;

// The engine's writable mappings, sorted: [begin, end) of each line of /proc/<pid>/maps with
// "rw" permissions. Empty when the file cannot be read.
std::vector<std::pair<uint64_t, uint64_t>> WritableMappings(int32_t pid) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  while (std::getline(maps, line)) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 2 || f[1].size() < 2 || f[1][0] != 'r' || f[1][1] != 'w') continue;
    std::pair<absl::string_view, absl::string_view> r = absl::StrSplit(f[0], '-');
    uint64_t begin = 0, end = 0;
    if (absl::SimpleHexAtoi(r.first, &begin) && absl::SimpleHexAtoi(r.second, &end)) {
      out.emplace_back(begin, end);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Whether [address, address + bytes) lies in consecutive writable mappings.
bool Covered(const std::vector<std::pair<uint64_t, uint64_t>>& maps, uint64_t address,
             uint64_t bytes) {
  uint64_t at = address;
  const uint64_t end = address + bytes;
  for (const auto& [b, e] : maps) {
    if (e <= at) continue;
    if (b > at) return false;
    at = e;
    if (at >= end) return true;
  }
  return false;
}

absl::Status AccessRefused(int32_t pid, int err) {
  return absl::FailedPreconditionError(absl::StrCat(
      "the daemon may not read process ", pid, "'s memory (", std::strerror(err),
      "): run kvcellard as the engine's uid where Yama's ptrace_scope is 0, have the engine "
      "call prctl(PR_SET_PTRACER, <kvcellard's pid>), or give kvcellard CAP_SYS_PTRACE "
      "(docs/security.md)"));
}

}  // namespace

std::optional<int32_t> ParseProcessMemoryName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "/proc/") || !absl::ConsumeSuffix(&name, "/mem")) {
    return std::nullopt;
  }
  if (name.empty() || name.size() > 10 || name[0] == '0') return std::nullopt;
  for (char c : name) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  int32_t pid = 0;
  if (!absl::SimpleAtoi(name, &pid) || pid <= 0) return std::nullopt;
  return pid;
}

absl::StatusOr<ProcessMemory> ProcessMemory::Open(absl::string_view name,
                                                  const EngineMemoryAccess& access,
                                                  absl::Span<const Range> ranges,
                                                  absl::string_view what,
                                                  absl::string_view process_what) {
  const std::string whole = process_what.empty() ? "" : absl::StrCat(process_what, ": ");
  std::optional<int32_t> pid = ParseProcessMemoryName(name);
  if (!pid) {
    return absl::InvalidArgumentError(absl::StrCat(whole, name, " is not /proc/<pid>/mem"));
  }
  if (absl::Status s = access.CheckProcessMemory(*pid, name); !s.ok()) {
    return WithPrefix(s, whole);
  }
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, *pid, 0));
  if (pidfd < 0) {
    if (errno == ESRCH) {
      return absl::NotFoundError(absl::StrCat(whole, name, ": no process ", *pid));
    }
    return absl::InternalError(absl::StrCat(whole, name, ": pidfd_open: ", std::strerror(errno)));
  }
  ProcessMemory mem(*pid, pidfd);
  const std::vector<std::pair<uint64_t, uint64_t>> maps = WritableMappings(*pid);
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    if (r.bytes == 0 || r.address + r.bytes < r.address) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: [", r.address, ", +", r.bytes, ") is empty or wraps"));
    }
    // One byte first: a kernel refusal says what to grant, before the maps say anything.
    uint8_t byte = 0;
    iovec local{&byte, 1};
    iovec remote{reinterpret_cast<void*>(r.address), 1};
    if (process_vm_readv(*pid, &local, 1, &remote, 1, 0) != 1) {
      const int err = errno;
      if (err == EPERM || err == EACCES) return WithPrefix(AccessRefused(*pid, err), whole);
      if (err == ESRCH) {
        return absl::NotFoundError(absl::StrCat(whole, name, ": process exited"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: address 0x", absl::Hex(r.address), " of process ", *pid,
                       " is not readable (", std::strerror(err), ")"));
    }
    if (!Covered(maps, r.address, r.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", i, "]: [0x", absl::Hex(r.address), ", 0x", absl::Hex(r.address + r.bytes),
          ") is not all writable memory of process ", *pid));
    }
  }
  return mem;
}

ProcessMemory& ProcessMemory::operator=(ProcessMemory&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) close(pidfd_);
    pid_ = std::exchange(other.pid_, 0);
    pidfd_ = std::exchange(other.pidfd_, -1);
  }
  return *this;
}

ProcessMemory::~ProcessMemory() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool ProcessMemory::alive() const {
  if (pidfd_ < 0) return false;
  pollfd p{pidfd_, POLLIN, 0};
  // A pidfd polls readable once its process has exited.
  return poll(&p, 1, 0) == 0;
}

bool ProcessMemory::Read(absl::Span<const iovec> local, absl::Span<const iovec> remote) const {
  return Transfer(local, remote, /*write=*/false);
}

bool ProcessMemory::Write(absl::Span<const iovec> local, absl::Span<const iovec> remote) const {
  return Transfer(local, remote, /*write=*/true);
}

bool ProcessMemory::Transfer(absl::Span<const iovec> local, absl::Span<const iovec> remote,
                             bool write) const {
  if (local.size() != remote.size()) {
    errno = EINVAL;
    return false;
  }
  if (!alive()) {
    errno = ESRCH;
    return false;
  }
  for (size_t at = 0; at < local.size(); at += kMaxIov) {
    const size_t n = std::min(kMaxIov, local.size() - at);
    size_t want = 0;
    for (size_t i = at; i < at + n; ++i) want += local[i].iov_len;
    const ssize_t got = write ? process_vm_writev(pid_, &local[at], n, &remote[at], n, 0)
                              : process_vm_readv(pid_, &local[at], n, &remote[at], n, 0);
    if (got < 0) return false;
    if (static_cast<size_t>(got) != want) {
      errno = EFAULT;  // A partial copy: a remote page went away under it.
      return false;
    }
  }
  return true;
}

}  // namespace kvcellar::platform
