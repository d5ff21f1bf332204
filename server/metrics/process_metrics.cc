#include "server/metrics/process_metrics.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// /proc/<pid>/stat fields are numbered from 1 (proc(5)); field 3 is the first after the ')'
// that closes the command name.
constexpr size_t kFirstFieldAfterComm = 3;
constexpr size_t kUtimeField = 14;
constexpr size_t kStimeField = 15;
constexpr size_t kStartTimeField = 22;
constexpr size_t kVsizeField = 23;
constexpr size_t kRssField = 24;

// procfs files report size 0, so read until EOF.
absl::StatusOr<std::string> ReadProcFile(const char* path) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

absl::StatusOr<int> CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return absl::ErrnoToStatus(errno, "opendir /proc/self/fd");
  const int own_fd = dirfd(dir);  // open only while we count: not one of the process's fds
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    int fd;
    if (absl::SimpleAtoi(entry->d_name, &fd) && fd == own_fd) continue;
    ++count;
  }
  closedir(dir);
  return count;
}

double TicksPerSecond() { return static_cast<double>(sysconf(_SC_CLK_TCK)); }

}  // namespace

absl::StatusOr<ProcStat> ParseProcStat(absl::string_view text) {
  const size_t close_paren = text.rfind(')');
  if (close_paren == absl::string_view::npos) {
    return absl::InvalidArgumentError("/proc stat: no ')' after the command name");
  }
  const std::vector<absl::string_view> fields =
      absl::StrSplit(text.substr(close_paren + 1), ' ', absl::SkipWhitespace());
  const auto field = [&](size_t number, uint64_t* out) -> absl::Status {
    const size_t i = number - kFirstFieldAfterComm;
    if (i >= fields.size() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(fields[i]), out)) {
      return absl::InvalidArgumentError(
          absl::StrCat("/proc stat: field ", number, " missing or not a number"));
    }
    return absl::OkStatus();
  };
  ProcStat stat;
  for (auto [number, out] :
       {std::pair{kUtimeField, &stat.utime_ticks}, std::pair{kStimeField, &stat.stime_ticks},
        std::pair{kStartTimeField, &stat.start_ticks}, std::pair{kVsizeField, &stat.vsize_bytes},
        std::pair{kRssField, &stat.rss_pages}}) {
    if (absl::Status s = field(number, out); !s.ok()) return s;
  }
  return stat;
}

absl::StatusOr<uint64_t> ParseBootTime(absl::string_view proc_stat) {
  for (absl::string_view line : absl::StrSplit(proc_stat, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      uint64_t btime;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &btime)) return btime;
      break;
    }
  }
  return absl::InvalidArgumentError("/proc/stat: no valid btime line");
}

absl::StatusOr<ProcessStats> ReadProcessStats() {
  absl::StatusOr<std::string> stat_text = ReadProcFile("/proc/self/stat");
  if (!stat_text.ok()) return stat_text.status();
  absl::StatusOr<ProcStat> stat = ParseProcStat(*stat_text);
  if (!stat.ok()) return stat.status();
  absl::StatusOr<std::string> system_text = ReadProcFile("/proc/stat");
  if (!system_text.ok()) return system_text.status();
  absl::StatusOr<uint64_t> boot = ParseBootTime(*system_text);
  if (!boot.ok()) return boot.status();
  absl::StatusOr<int> fds = CountOpenFds();
  if (!fds.ok()) return fds.status();
  rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return absl::ErrnoToStatus(errno, "getrlimit");

  const double ticks = TicksPerSecond();
  ProcessStats out;
  out.cpu_seconds = static_cast<double>(stat->utime_ticks + stat->stime_ticks) / ticks;
  out.resident_bytes = static_cast<double>(stat->rss_pages) * sysconf(_SC_PAGESIZE);
  out.virtual_bytes = static_cast<double>(stat->vsize_bytes);
  out.start_time_seconds = static_cast<double>(*boot) + stat->start_ticks / ticks;
  out.open_fds = *fds;
  out.max_fds = static_cast<double>(limit.rlim_cur);
  return out;
}

CollectorId RegisterProcessCollector(MetricsRegistry& registry) {
  return registry.AddCollector([](MetricWriter& w) {
    absl::StatusOr<ProcessStats> stats = ReadProcessStats();
    if (!stats.ok()) {
      // Any /proc file missing means a sandbox without procfs: nothing here is worth failing
      // the scrape for.
      KVLOG(Debug, "process metrics unavailable", {{"error", stats.status().ToString()}});
      return;
    }
    w.AddCounter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                 stats->cpu_seconds);
    w.AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.",
               stats->resident_bytes);
    w.AddGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.",
               stats->virtual_bytes);
    w.AddGauge("process_start_time_seconds",
               "Start time of the process since unix epoch in seconds.", stats->start_time_seconds);
    w.AddGauge("process_open_fds", "Number of open file descriptors.", stats->open_fds);
    w.AddGauge("process_max_fds", "Maximum number of open file descriptors.", stats->max_fds);
  });
}

absl::Status RegisterBuildInfo(MetricsRegistry& registry, absl::string_view version,
                               absl::string_view git_commit, absl::string_view build_type,
                               bool cuda) {
  absl::StatusOr<GaugeFamily*> info = registry.RegisterGauge(
      "kvcellar_build_info",
      "A metric with a constant '1' value labeled by the version, commit, build type and CUDA "
      "support of this kvcellard build.",
      {"version", "commit", "build_type", "cuda"});
  if (!info.ok()) return info.status();
  (*info)->WithLabels({version, git_commit, build_type, cuda ? "true" : "false"}).Set(1);
  return absl::OkStatus();
}

}  // namespace kvcellar::server
