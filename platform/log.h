// Structured one-line logging: `ts=... level=info msg="..." key=value ...`.
//
// One line per event, key=value fields, written with a single write(2) so that lines from
// different threads never interleave. The level threshold is process-wide (set once from config
// at startup); it is the only global here besides the metrics registry.
//
// Usage:
//   KVLOG(Info, "listening", {{"socket", path}, {"mode", "0660"}});
#ifndef KVCELLAR_PLATFORM_LOG_H_
#define KVCELLAR_PLATFORM_LOG_H_

#include <initializer_list>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvcellar::platform {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
absl::string_view LogLevelName(LogLevel level);

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Redirects log lines to a file descriptor (default 2, stderr).
void SetLogFd(int fd);

struct LogField {
  LogField(absl::string_view k, absl::string_view v) : key(k), value(v) {}
  LogField(absl::string_view k, const std::string& v) : key(k), value(v) {}
  LogField(absl::string_view k, const char* v) : key(k), value(v) {}
  template <typename T>
    requires std::is_arithmetic_v<T>
  LogField(absl::string_view k, T v) : key(k), value(absl::StrCat(v)) {}
  absl::string_view key;
  std::string value;
};

bool LogEnabled(LogLevel level);
void Log(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields = {});
// Formats a line without writing it (used by tests).
std::string FormatLogLine(LogLevel level, absl::string_view msg,
                          std::initializer_list<LogField> fields);

}  // namespace kvcellar::platform

#define KVLOG(level, msg, ...)                                                   \
  do {                                                                           \
    if (::kvcellar::platform::LogEnabled(::kvcellar::platform::LogLevel::k##level)) {    \
      ::kvcellar::platform::Log(::kvcellar::platform::LogLevel::k##level, msg, ##__VA_ARGS__); \
    }                                                                            \
  } while (0)

#endif  // KVCELLAR_PLATFORM_LOG_H_
