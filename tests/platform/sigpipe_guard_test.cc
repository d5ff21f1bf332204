// Tests for platform/sigpipe_guard.h: a write to a socket whose peer has gone fails with EPIPE
// inside a scope instead of killing the process (this binary does not ignore SIGPIPE), and
// leaves no pending SIGPIPE and the thread's mask as it was.
#include "platform/sigpipe_guard.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "gtest/gtest.h"

namespace kvcellar::platform {
namespace {

bool PipePending() {
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  return sigismember(&pending, SIGPIPE) == 1;
}

bool PipeBlocked() {
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  return sigismember(&mask, SIGPIPE) == 1;
}

// A write(2) to a stream socket whose other end is closed: EPIPE, and SIGPIPE to this thread.
int WriteToClosedPeer() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return -1;
  close(fds[1]);
  const char byte = 1;
  errno = 0;
  const ssize_t n = write(fds[0], &byte, 1);
  const int err = n < 0 ? errno : 0;
  close(fds[0]);
  return err;
}

TEST(SigpipeGuardTest, AWriteToAGonePeerFailsWithEpipeAndLeavesNothingPending) {
  ASSERT_EQ(signal(SIGPIPE, SIG_DFL), SIG_DFL);  // The default action: death, without the guard.
  std::thread([] {
    ASSERT_FALSE(PipeBlocked());
    {
      ScopedSigpipeBlock guard;
      EXPECT_EQ(WriteToClosedPeer(), EPIPE);
      EXPECT_TRUE(PipePending());
    }
    EXPECT_FALSE(PipePending());
    EXPECT_FALSE(PipeBlocked());
  }).join();
}

TEST(SigpipeGuardTest, NestedScopesAndAnAlreadyBlockedThreadKeepTheirMask) {
  std::thread([] {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    {
      ScopedSigpipeBlock outer;
      {
        ScopedSigpipeBlock inner;
        EXPECT_EQ(WriteToClosedPeer(), EPIPE);
      }
      // The inner scope left the outer scope's block in place, and its signal to the outer.
      EXPECT_TRUE(PipeBlocked());
      EXPECT_TRUE(PipePending());
    }
    EXPECT_FALSE(PipeBlocked());
    EXPECT_FALSE(PipePending());
    // A thread that blocks SIGPIPE itself keeps it blocked (and its pending signal) after a scope.
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    {
      ScopedSigpipeBlock guard;
      EXPECT_EQ(WriteToClosedPeer(), EPIPE);
    }
    EXPECT_TRUE(PipeBlocked());
    EXPECT_TRUE(PipePending());
  }).join();
}

}  // namespace
}  // namespace kvcellar::platform
