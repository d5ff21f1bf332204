// SessionCloser: ends sessions after their drain without holding the thread that asked.
//
// UnregisterEngine may give a session's pending ops up to max_wait_ms to end, and how long they
// take is the engine's doing (a Backup's ready signal, a Load's size). Waiting for them on a gRPC
// thread let a few unregistering engines hold every callback thread and stall every other
// engine's RPCs (issue #24). So a close is two halves:
//   1. On the caller's thread, without blocking on any op: the session is closed to new ops
//      (Session::Close) and a SessionEnd is handed to Close(), which registers it with the
//      OpTable as a SessionDrainWaiter.
//   2. Once the session's ops are all terminal, or the drain deadline passed, or the daemon
//      drains (OpTable::FinishAllWaiters), the table moves the SessionEnd to this class's queue,
//      and the closer's own thread runs the rest (`finish`: cancel what is left, close the
//      mapping, drop pins) and then the SessionEnd's `done`, which finishes the RPC.
// Many closes drain at the same time; only their second halves run one after another, and those
// wait for nothing but device work already cancelled.
//
// Threads: Close() from any thread (gRPC handlers, the housekeeper); SessionEnd::Drained from
// the OpTable's threads; `finish` and `done` on the closer thread (owned), or on the thread
// calling Stop(). The closer's mutex is a leaf: never held while calling the OpTable, `finish`
// or `done`.
#ifndef KVCELLAR_SERVER_CACHE_SESSION_CLOSER_H_
#define KVCELLAR_SERVER_CACHE_SESSION_CLOSER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device_backend.h"
#include "server/session/op_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

// What ending a session did: UnregisterEngineResponse's counts.
struct SessionEndCounts {
  uint32_t ops_completed = 0;
  uint32_t ops_cancelled = 0;
  uint32_t pins_released = 0;
};

class SessionCloser;

// One session on its way out: what the first half of the close took from it.
struct SessionEnd final : SessionDrainWaiter {
  std::shared_ptr<Session> session;
  // The session's mapping, out of Session::Close(): still usable by the ops that run.
  std::unique_ptr<gpu::EngineMapping> mapping;
  uint32_t inflight_before = 0;  // The session's ops in flight when it was closed.
  bool last_of_instance = false;
  std::string reason;
  // Called once, on the closer thread, with the counts; may be empty.
  std::function<void(const SessionEndCounts&)> done;

  void Drained(bool idle) override;

 private:
  friend class SessionCloser;
  SessionCloser* closer_ = nullptr;
};

class SessionCloser {
 public:
  // Runs the second half of a close; `end.done` is called after it, with what it returns.
  using Finish = std::function<SessionEndCounts(SessionEnd& end)>;

  // `ops` outlives the closer. Starts the thread.
  SessionCloser(OpTable* ops, Finish finish);
  // Stop().
  ~SessionCloser();
  SessionCloser(const SessionCloser&) = delete;
  SessionCloser& operator=(const SessionCloser&) = delete;

  // Takes `end` (its session already closed to new ops), whose drain lasts until `deadline`.
  // Returns at once; the close finishes on the closer thread.
  void Close(std::unique_ptr<SessionEnd> end, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every close now, cutting drains short, and stops the thread; later Close() calls finish
  // on the calling thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend struct SessionEnd;
  // From SessionEnd::Drained: queues `end` for the thread.
  void Ready(SessionEnd* end) ABSL_LOCKS_EXCLUDED(mu_);
  void Run();
  void FinishOne(std::unique_ptr<SessionEnd> end);

  OpTable* const ops_;
  const Finish finish_;

  mutable absl::Mutex mu_;
  // Every close taken, by address, until the thread (or Stop) takes it to finish it.
  absl::flat_hash_map<SessionEnd*, std::unique_ptr<SessionEnd>> closing_ ABSL_GUARDED_BY(mu_);
  // Closes whose drain is over, oldest first; each is in closing_ too.
  std::deque<SessionEnd*> ready_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;     // Stop() was called.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // The thread has ended.
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CACHE_SESSION_CLOSER_H_
