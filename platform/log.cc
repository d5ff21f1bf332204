#include "platform/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcellar::platform {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_fd{2};

bool NeedsQuoting(absl::string_view v) {
  if (v.empty()) return true;
  for (char c : v) {
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20) {
      return true;
    }
  }
  return false;
}

void AppendValue(std::string* out, absl::string_view v) {
  if (!NeedsQuoting(v)) {
    out->append(v.data(), v.size());
    return;
  }
  out->push_back('"');
  for (char c : v) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(out, "\\x", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (n == "debug") return LogLevel::kDebug;
  if (n == "info") return LogLevel::kInfo;
  if (n == "warn" || n == "warning") return LogLevel::kWarn;
  if (n == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log level '", name, "' (expected debug, info, warn or error)"));
}

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
  }
  return "unknown";
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }
void SetLogFd(int fd) { g_fd.store(fd); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

std::string FormatLogLine(LogLevel level, absl::string_view msg,
                          std::initializer_list<LogField> fields) {
  std::string line;
  line.reserve(128);
  absl::StrAppend(&line, "ts=", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()),
                  " level=", LogLevelName(level), " msg=");
  AppendValue(&line, msg);
  for (const LogField& f : fields) {
    line.push_back(' ');
    line.append(f.key.data(), f.key.size());
    line.push_back('=');
    AppendValue(&line, f.value);
  }
  line.push_back('\n');
  return line;
}

void Log(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  std::string line = FormatLogLine(level, msg, fields);
  // One write per line keeps lines whole across threads (O_APPEND or a pipe under PIPE_BUF, and
  // in practice a terminal or journald stream).
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(g_fd.load(), p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace kvcellar::platform
