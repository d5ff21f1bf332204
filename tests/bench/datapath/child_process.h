// ChildProcess: a helper process the benchmark starts and stops itself (kvcellard, the no-op gRPC
// server), with its stdout and stderr in a log file.
//
// The child gets PR_SET_PDEATHSIG (SIGKILL), so a benchmark that crashes or is interrupted leaves
// no daemon behind. Spawn before the process starts gRPC threads where possible: fork() copies
// only the calling thread, and the child calls only async-signal-safe functions before exec.
//
// Threading: thread-compatible; one owner.
#ifndef KVCELLAR_TESTS_BENCH_DATAPATH_CHILD_PROCESS_H_
#define KVCELLAR_TESTS_BENCH_DATAPATH_CHILD_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvcellar::bench {

class ChildProcess {
 public:
  // Starts argv[0] (a path) with argv, stdout and stderr appended to `log_path`.
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                            std::string log_path);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) = delete;
  ChildProcess(const ChildProcess&) = delete;
  ~ChildProcess();  // Stop().

  // Waits until a line of the log contains `needle`. FAILED_PRECONDITION with the log's tail when
  // the child exits first, DEADLINE_EXCEEDED when the timeout passes.
  absl::Status WaitForLogLine(absl::string_view needle, absl::Duration timeout);
  // SIGTERM, then SIGKILL after `grace`; reaps the child. Returns its exit status (wait(2)
  // encoding), or -1 when it was not running. Idempotent.
  int Stop(absl::Duration grace = absl::Seconds(10));

  bool running() const { return pid_ > 0; }
  const std::string& log_path() const { return log_path_; }
  // The last `bytes` of the log.
  std::string LogTail(size_t bytes = 4000) const;

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_ = -1;
  std::string log_path_;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_DATAPATH_CHILD_PROCESS_H_
