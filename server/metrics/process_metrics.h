// Process metrics under the standard names every Prometheus client library exports
// (process_cpu_seconds_total, process_resident_memory_bytes, ...), read from /proc/self at scrape
// time, and the build-identity gauge kvcellar_build_info.
//
// The process_* names do not start with kvcellar_ on purpose: dashboards and alerts written for
// any Prometheus-instrumented process (and the `job` label) find them under these names.
#ifndef KVCELLAR_SERVER_METRICS_PROCESS_METRICS_H_
#define KVCELLAR_SERVER_METRICS_PROCESS_METRICS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

// The fields of /proc/<pid>/stat that the process metrics use, in the kernel's units.
struct ProcStat {
  uint64_t utime_ticks = 0;  // field 14, clock ticks
  uint64_t stime_ticks = 0;  // field 15, clock ticks
  uint64_t start_ticks = 0;  // field 22, clock ticks after boot
  uint64_t vsize_bytes = 0;  // field 23
  uint64_t rss_pages = 0;    // field 24
};

// Parses the text of /proc/<pid>/stat. The command name (field 2) may hold spaces and
// parentheses; the fields are counted from its last ')'.
absl::StatusOr<ProcStat> ParseProcStat(absl::string_view text);
// The `btime` line of /proc/stat: the boot time in seconds since the Unix epoch.
absl::StatusOr<uint64_t> ParseBootTime(absl::string_view proc_stat);

// A reading of this process's statistics, in the exported units.
struct ProcessStats {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double start_time_seconds = 0;  // since the Unix epoch
  double open_fds = 0;
  double max_fds = 0;  // soft RLIMIT_NOFILE
};

// Reads /proc/self/stat, /proc/stat, /proc/self/fd and RLIMIT_NOFILE. Fails when any is missing.
absl::StatusOr<ProcessStats> ReadProcessStats();

// Adds a collector that writes the process_* metrics at each scrape. Whatever cannot be read is
// left out of that scrape (and logged at debug level) rather than failing it.
CollectorId RegisterProcessCollector(MetricsRegistry& registry);

// Registers the gauge kvcellar_build_info{version=...,commit=...,build_type=...,cuda="true"} = 1,
// the usual Prometheus "info" metric: join on it to break other series down by build.
absl::Status RegisterBuildInfo(MetricsRegistry& registry, absl::string_view version,
                               absl::string_view git_commit, absl::string_view build_type,
                               bool cuda);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_METRICS_PROCESS_METRICS_H_
