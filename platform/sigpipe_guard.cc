#include "platform/sigpipe_guard.h"

#include <pthread.h>

#include <cerrno>
#include <ctime>

namespace kvcellar::platform {
namespace {

sigset_t PipeSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  return set;
}

bool Pending() {
  sigset_t pending;
  sigemptyset(&pending);
  return sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
}

}  // namespace

ScopedSigpipeBlock::ScopedSigpipeBlock() {
  const sigset_t pipe = PipeSet();
  pthread_sigmask(SIG_BLOCK, &pipe, &old_mask_);
  was_blocked_ = sigismember(&old_mask_, SIGPIPE) == 1;
  was_pending_ = Pending();
}

ScopedSigpipeBlock::~ScopedSigpipeBlock() {
  if (was_blocked_) return;
  if (!was_pending_ && Pending()) {
    const sigset_t pipe = PipeSet();
    const timespec now{0, 0};
    // Takes the pending SIGPIPE (thread-directed, or a process-wide one nobody else waits for).
    while (sigtimedwait(&pipe, nullptr, &now) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

}  // namespace kvcellar::platform
