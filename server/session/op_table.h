// OpTable: the asynchronous Load and Backup ops, from submission to their final result, and the
// WaitOps calls that watch them (docs/api.md, "Ops").
//
// Lifecycle of an op:
//   1. A handler creates an OpRecord with every page's submission status (PENDING for pages handed
//      to the device, MISS / ALREADY_PRESENT / ... for the rest), the DeviceOp it submitted (none
//      when nothing was copied) and an OpCompletion that knows how to finish it, and Add()s it.
//   2. The completion thread polls unfinished ops' DeviceOps (waiting on one at a time, so it
//      sleeps while copies run) and finalizes each one as soon as its device work is over: it
//      runs the OpCompletion (commit or abort the backed-up pages, drop copy pins, free slots,
//      return the session's blocks), then publishes the final page statuses and state. So an op
//      completes promptly whether or not the engine ever calls WaitOps.
//   3. The terminal result stays queryable for op_result_retention_ms, then the op is forgotten
//      (OP_STATE_UNKNOWN).
// Backups with a SIM ready signal have a ready deadline: past it the thread cancels the device
// op, and its pending pages end TIMEOUT. A session that ends cancels its ops (CANCELLED).
//
// WaitOps never blocks a gRPC thread: a call whose condition does not hold yet registers an
// OpWaiter; the thread that finalizes an op, or the completion thread at the waiter's deadline,
// fills its reply and finishes it. A session's drain (UnregisterEngine) waits the same way, as a
// SessionDrainWaiter: nothing in the table ever blocks a caller on ops that another thread, or an
// engine's ready signal, has yet to end.
//
// Op ids come from a daemon-wide sequence shared with pin ids: unique for the daemon's life, never
// 0, and starting at the start time in microseconds so that ids keep growing across daemon
// restarts (engines compare completion words with "word >= op id"; a restarted daemon must not
// reissue ids an engine's counters already passed).
//
// Threads: any gRPC handler, the completion thread (owned), the housekeeper, the session closer
// (cache/session_closer.h). One mutex guards the table, every record's mutable part and both
// kinds of waiters; it is never held while calling an OpCompletion, a DeviceOp wait, an index, or
// a waiter's Done() / Drained().
#ifndef KVCELLAR_SERVER_SESSION_OP_TABLE_H_
#define KVCELLAR_SERVER_SESSION_OP_TABLE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/metrics/cache_metrics.h"

namespace kvcellar::server {

// Why an op's device work ended early.
enum class OpCancelCause : uint8_t {
  kNone,
  kReadyTimeout,  // The SIM ready signal did not fire in time.
  kSessionEnded,  // Unregister, lease expiry, replacement or daemon shutdown.
  kReleased,      // Release(cancel_op_ids): the engine gave up on a prefetch.
};

struct OpOutcome {
  v1::OpState state = v1::OP_STATE_DONE;
  std::string error;
};

// Finishes one op once its device work is over. Implemented per op kind (device_mover.cc).
class OpCompletion {
 public:
  virtual ~OpCompletion() = default;
  // Called exactly once, without any OpTable lock. `device` is the DeviceOp's status (OK when
  // there was none); `statuses` holds the submission statuses, flat, to be turned into final ones
  // (every PENDING page must leave PENDING). Returns the op's terminal state.
  virtual OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                             absl::Span<uint8_t> statuses) = 0;
};

struct OpRecord {
  uint64_t id = 0;
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  std::string instance_id;
  uint64_t session_id = 0;
  absl::Time submitted;
  // Per sequence: where its pages start in `statuses`; one more entry than sequences.
  std::vector<uint32_t> seq_begin;
  // Set before Add(), then read-only.
  gpu::OpHandle device;
  absl::Time ready_deadline = absl::InfiniteFuture();
  std::unique_ptr<OpCompletion> completion;

  // Guarded by the table's mutex once added.
  std::vector<uint8_t> statuses;  // v1::PageStatus values.
  v1::OpState state = v1::OP_STATE_PENDING;
  absl::Time finished;
  std::string error;
  bool claimed = false;  // A thread is finalizing it.
  OpCancelCause cancel = OpCancelCause::kNone;
};

// A WaitOps call waiting for its condition. Finished exactly once: by Done() from the table, or by
// its owner after RemoveWaiter() returned true.
class OpWaiter {
 public:
  virtual ~OpWaiter() = default;
  // The reply has been filled; finish the RPC. Called without the table's lock.
  virtual void Done() = 0;

  std::vector<uint64_t> ids;
  std::string instance_id;
  bool any = false;
  bool omit_page_status = false;
  absl::Time deadline;
  v1::WaitOpsResponse* response = nullptr;
  bool registered = false;  // Guarded by the table's mutex.
};

// A closing session waiting for its ops to end (UnregisterEngine's drain). Finished exactly once:
// by Drained() from the table, or by its owner after RemoveDrainWaiter() returned true.
class SessionDrainWaiter {
 public:
  virtual ~SessionDrainWaiter() = default;
  // Every op of the session is terminal (`idle`), or the deadline passed or the waiters were
  // finished early (FinishAllWaiters: the daemon is draining) with some still pending. Called
  // without the table's lock, on the thread that made it so (a finalizing thread, the completion
  // thread, or the caller of WatchDrain / FinishAllWaiters); it must not block.
  virtual void Drained(bool idle) = 0;

  uint64_t session_id = 0;
  absl::Time deadline;
  bool registered = false;  // Guarded by the table's mutex.
};

class OpTable {
 public:
  // `metrics` outlives the table. Starts the completion thread.
  OpTable(CacheMetrics* metrics, absl::Duration retention);
  // Stops the completion thread and finishes every waiter. Unfinished ops must have been ended
  // (their sessions closed) before.
  ~OpTable();
  OpTable(const OpTable&) = delete;
  OpTable& operator=(const OpTable&) = delete;

  // The next id of the daemon-wide sequence (ops and pins).
  uint64_t NextId() { return next_id_.fetch_add(1, std::memory_order_relaxed); }

  // Takes the op (PENDING), wakes the completion thread, and finalizes it at once when its
  // device work is already over. Returns it, for the submission snapshot.
  std::shared_ptr<OpRecord> Add(std::unique_ptr<OpRecord> op) ABSL_LOCKS_EXCLUDED(mu_);

  // The op's current result. `submission`: the reply of the RPC that created it (a Load's
  // PENDING pages then count in leading_ok_pages).
  void Fill(const OpRecord& op, bool omit_page_status, bool submission, v1::OpResult* out) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Answers a WaitOps: fills `waiter->response` and returns true when the condition holds now or
  // the deadline has passed (then the caller finishes the RPC); otherwise registers the waiter,
  // which the table finishes later through Done(), and returns false.
  bool Wait(OpWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters a waiter (its RPC was cancelled). True when it was still registered: the caller
  // then finishes it; false when the table already has (or is about to).
  bool RemoveWaiter(OpWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // Finishes every waiter now with the states as they are, session drain waiters included
  // (daemon draining).
  void FinishAllWaiters() ABSL_LOCKS_EXCLUDED(mu_);

  // Release(cancel_op_ids): a prefetch op ends at once (CANCELLED: its unlanded pages too; reads
  // already issued finish in the background and still commit or free their slots). Load and
  // Backup cannot be cancelled once submitted (NOT_CANCELLABLE).
  v1::ReleaseOutcome Cancel(uint64_t id, const std::string& instance_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Session end, without blocking: calls `waiter->Drained` once every op of
  // `waiter->session_id` is terminal or `waiter->deadline` has passed; at once, on the calling
  // thread, when that holds already (or the table is stopping).
  void WatchDrain(SessionDrainWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters a drain waiter. True when it was still registered: the caller then owns its
  // ending; false when the table already has called (or is about to call) Drained.
  bool RemoveDrainWaiter(SessionDrainWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether every op of the session is terminal.
  bool SessionIdle(uint64_t session_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the session's unfinished ops cancelled and cancels their device work; returns them.
  std::vector<std::shared_ptr<OpRecord>> CancelSessionOps(uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Finalizes `op` when its device work is over. Returns whether the op is terminal.
  bool TryFinalize(OpRecord& op) ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets terminal ops older than the retention. Returns how many.
  size_t Prune(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  size_t unfinished() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();
  // Whether `waiter`'s condition holds.
  bool SatisfiedLocked(const OpWaiter& waiter) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FillResponseLocked(OpWaiter& waiter, bool timed_out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FillLocked(const OpRecord& op, bool omit_page_status, bool submission, absl::Time now,
                  v1::OpResult* out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool SessionIdleLocked(uint64_t session_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes satisfied (or, with `now`, expired) waiters and fills their replies; the caller calls
  // Done() on them after unlocking. Drain waiters likewise: the caller calls Drained(idle).
  struct Drained {
    SessionDrainWaiter* waiter;
    bool idle;
  };
  void CollectWaitersLocked(absl::Time now, std::vector<OpWaiter*>* done,
                            std::vector<Drained>* drained) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls Done() and Drained() on what CollectWaitersLocked collected, and clears both.
  static void Notify(std::vector<OpWaiter*>* done, std::vector<Drained>* drained);

  CacheMetrics* const metrics_;
  const absl::Duration retention_;
  std::atomic<uint64_t> next_id_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<OpRecord>> ops_ ABSL_GUARDED_BY(mu_);
  // Unfinished ops, oldest first.
  std::vector<std::shared_ptr<OpRecord>> pending_ ABSL_GUARDED_BY(mu_);
  // Terminal ops in finishing order, for Prune.
  std::deque<std::pair<absl::Time, uint64_t>> finished_ ABSL_GUARDED_BY(mu_);
  std::vector<OpWaiter*> waiters_ ABSL_GUARDED_BY(mu_);
  std::vector<SessionDrainWaiter*> drain_waiters_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_OP_TABLE_H_
