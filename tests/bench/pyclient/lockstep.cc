#include "tests/bench/pyclient/lockstep.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcellar::bench {
namespace {

// Longest wait for the other side's turn: its slowest call plus its setup (registering, caching
// a prompt) on a loaded 2-core machine, with a wide margin. Only there so a stuck peer fails.
constexpr int kTurnTimeoutMs = 120 * 1000;

}  // namespace

bool Lockstep::Await(std::string* error) {
  if (!enabled()) return true;
  if (closed_) {
    *error = "lockstep closed";
    return false;
  }
  pollfd p{in_fd_, POLLIN, 0};
  int n;
  do {
    n = ::poll(&p, 1, kTurnTimeoutMs);
  } while (n < 0 && errno == EINTR);
  char byte;
  ssize_t got = 0;
  if (n > 0) {
    do {
      got = ::read(in_fd_, &byte, 1);
    } while (got < 0 && errno == EINTR);
  }
  if (got == 1) return true;
  if (n == 0) {
    *error = "lockstep: the other side did not pass its turn in time";
  } else if (n > 0 && got == 0) {
    *error = "lockstep: the other side closed its end";
  } else {
    *error = absl::StrCat("lockstep: ", std::strerror(errno));
  }
  Close();
  return false;
}

bool Lockstep::Pass(std::string* error) {
  if (!enabled()) return true;
  if (closed_) {
    *error = "lockstep closed";
    return false;
  }
  const char byte = 't';
  ssize_t put;
  do {
    put = ::write(out_fd_, &byte, 1);
  } while (put < 0 && errno == EINTR);
  if (put == 1) return true;
  *error = absl::StrCat("lockstep: ", std::strerror(errno));
  Close();
  return false;
}

void Lockstep::Close() {
  if (closed_ || !enabled()) return;
  closed_ = true;
  if (in_fd_ >= 0) ::close(in_fd_);
  if (out_fd_ >= 0) ::close(out_fd_);
}

}  // namespace kvcellar::bench
