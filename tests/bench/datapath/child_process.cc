#include "tests/bench/datapath/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::bench {

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                 std::string log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("argv: empty");
  // Everything the child needs is prepared here: between fork and exec it may only make
  // async-signal-safe calls.
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("open ", log_path, ": ", std::strerror(errno)));
  }
  const std::string exec_failed = absl::StrCat("cannot execute ", argv[0], "\n");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // The parent died before prctl.
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    ::execv(args[0], args.data());
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    ::_exit(127);
  }
  ::close(log_fd);
  return ChildProcess(pid, std::move(log_path));
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), log_path_(std::move(other.log_path_)) {
  other.pid_ = -1;
}

ChildProcess::~ChildProcess() { Stop(); }

std::string ChildProcess::LogTail(size_t bytes) const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string all = ss.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

absl::Status ChildProcess::WaitForLogLine(absl::string_view needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    {
      std::ifstream in(log_path_);
      std::string line;
      while (std::getline(in, line)) {
        if (absl::StrContains(line, needle)) return absl::OkStatus();
      }
    }
    int status = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::FailedPreconditionError(
          absl::StrCat("child exited before logging '", needle, "':\n", LogTail()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no log line '", needle, "' in ", absl::FormatDuration(timeout), ":\n", LogTail()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

int ChildProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  while (::waitpid(pid_, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  pid_ = -1;
  return status;
}

}  // namespace kvcellar::bench
