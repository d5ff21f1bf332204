// ScopedSigpipeBlock: a write to a socket whose peer has gone raises SIGPIPE, whose default action
// kills the process. Sends the project makes itself pass MSG_NOSIGNAL; hiredis's blocking calls
// (redisCommand, redisGetReply: AUTH, CLUSTER SLOTS, the L3 index readback) write with write(2),
// which has no such flag. kvcellard ignores SIGPIPE process-wide (server/main.cc), but the storage
// library also runs inside processes that do not (its tests, benchmarks, tools), where a Redis
// server dying mid-command killed the whole process instead of failing the command.
//
// For its lifetime this blocks SIGPIPE on the calling thread (SIGPIPE from a write goes to the
// writing thread), so the write fails with EPIPE; at the end a SIGPIPE the scope raised is taken
// off the thread's pending set and the thread's mask restored. Signal handlers and other threads
// are left alone. Scopes may nest.
#ifndef KVCELLAR_PLATFORM_SIGPIPE_GUARD_H_
#define KVCELLAR_PLATFORM_SIGPIPE_GUARD_H_

#include <signal.h>

namespace kvcellar::platform {

class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock();
  ~ScopedSigpipeBlock();
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t old_mask_;
  bool was_pending_ = false;  // A SIGPIPE was pending before the scope: not ours to take.
  bool was_blocked_ = false;  // Blocked already (an outer scope): nothing to undo.
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_SIGPIPE_GUARD_H_
