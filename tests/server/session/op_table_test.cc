// Tests server/session/op_table.h: an op's lifecycle from Add to its terminal result and its
// retention, the completion thread finishing ops without any WaitOps, WaitOps waiters, cancels,
// and the daemon-wide id sequence. Device work is a real gpu::DeviceOp the test finishes, as a
// backend would.
#include "server/session/op_table.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/cache_metrics.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {
namespace {

using ::testing::ElementsAre;

constexpr absl::Duration kRetention = absl::Seconds(60);
constexpr absl::Duration kPatience = absl::Seconds(5);  // Only reached when a test fails.

// A device op as the backends make them: Cancel() skips what has not started, and the op
// finishes CANCELLED.
class TestDeviceOp final : public gpu::DeviceOp {
 public:
  TestDeviceOp() : DeviceOp(Kind::kScatter, 2) {}

 private:
  void OnCancel() override { Finish(absl::CancelledError("cancelled")); }
};

// What the op's OpCompletion saw.
struct CompletionLog {
  absl::Mutex mu;
  int calls = 0;
  absl::Status device;
  OpCancelCause cause = OpCancelCause::kNone;
  size_t unfinished_seen = 0;
};

// Finishes an op as the movers do: PENDING pages become OK, or CANCELLED / DEVICE_ERROR; the state
// follows. Calls back into the table to prove it runs without the table's lock.
class TestCompletion final : public OpCompletion {
 public:
  TestCompletion(std::shared_ptr<CompletionLog> log, OpTable* table) : log_(log), table_(table) {}
  OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                     absl::Span<uint8_t> statuses) override {
    const size_t unfinished = table_->unfinished();
    {
      absl::MutexLock lock(&log_->mu);
      ++log_->calls;
      log_->device = device;
      log_->cause = cause;
      log_->unfinished_seen = unfinished;
    }
    const v1::PageStatus landed = cause != OpCancelCause::kNone ? v1::PAGE_STATUS_CANCELLED
                                  : device.ok()                 ? v1::PAGE_STATUS_OK
                                                                : v1::PAGE_STATUS_DEVICE_ERROR;
    for (uint8_t& s : statuses) {
      if (s == v1::PAGE_STATUS_PENDING) s = landed;
    }
    if (cause != OpCancelCause::kNone) return {v1::OP_STATE_CANCELLED, ""};
    if (!device.ok()) return {v1::OP_STATE_FAILED, std::string(device.message())};
    return {v1::OP_STATE_DONE, ""};
  }

 private:
  std::shared_ptr<CompletionLog> log_;
  OpTable* const table_;
};

class TestWaiter final : public OpWaiter {
 public:
  TestWaiter(std::vector<uint64_t> op_ids, const std::string& instance, absl::Duration timeout,
             bool wait_any = false) {
    ids = std::move(op_ids);
    instance_id = instance;
    any = wait_any;
    deadline = absl::Now() + timeout;
    response = &reply;
  }
  void Done() override { done.Notify(); }  // A second call would abort: exactly once.

  absl::Notification done;
  v1::WaitOpsResponse reply;
};

// A closing session's drain: records how it ended, and on which thread.
class TestDrainWaiter final : public SessionDrainWaiter {
 public:
  TestDrainWaiter(uint64_t session, absl::Duration timeout) {
    session_id = session;
    deadline = absl::Now() + timeout;
  }
  void Drained(bool was_idle) override {  // A second call would abort: exactly once.
    idle = was_idle;
    thread = std::this_thread::get_id();
    done.Notify();
  }

  absl::Notification done;
  bool idle = false;
  std::thread::id thread;
};

class OpTableTest : public ::testing::Test {
 protected:
  OpTableTest() : metrics_(&registry_), table_(std::make_unique<OpTable>(&metrics_, kRetention)) {}

  // An op of `kind` for `session` of instance "inst" with `statuses` (two sequences: the first
  // page alone, then the rest). Device work: `device` (nullptr: none).
  std::unique_ptr<OpRecord> MakeOp(v1::OpKind kind, std::vector<uint8_t> statuses,
                                   gpu::OpHandle device, uint64_t session = 1) {
    auto op = std::make_unique<OpRecord>();
    op->id = table_->NextId();
    op->kind = kind;
    op->instance_id = "inst";
    op->session_id = session;
    op->submitted = absl::Now();
    op->seq_begin = {0, 1, static_cast<uint32_t>(statuses.size())};
    op->statuses = std::move(statuses);
    op->device = std::move(device);
    op->completion = std::make_unique<TestCompletion>(log_, table_.get());
    return op;
  }

  v1::OpResult Result(const OpRecord& op, bool submission = false) {
    v1::OpResult out;
    table_->Fill(op, /*omit_page_status=*/false, submission, &out);
    return out;
  }

  // Waits (bounded) until `op` is terminal, through WaitOps as an engine would.
  v1::OpResult AwaitTerminal(uint64_t id) {
    TestWaiter w({id}, "inst", kPatience);
    if (!table_->Wait(&w)) w.done.WaitForNotificationWithTimeout(kPatience);
    return w.reply.ops_size() == 1 ? w.reply.ops(0) : v1::OpResult();
  }

  // Adds an op without device work; it is terminal on return (finalized by Add, or by the
  // completion thread when that claimed it first).
  std::shared_ptr<OpRecord> AddDone(v1::OpKind kind, std::vector<uint8_t> statuses) {
    std::shared_ptr<OpRecord> op = table_->Add(MakeOp(kind, std::move(statuses), nullptr));
    EXPECT_NE(AwaitTerminal(op->id).state(), v1::OP_STATE_PENDING);
    return op;
  }

  int Calls() {
    absl::MutexLock lock(&log_->mu);
    return log_->calls;
  }

  MetricsRegistry registry_;
  CacheMetrics metrics_;
  std::unique_ptr<OpTable> table_;
  std::shared_ptr<CompletionLog> log_ = std::make_shared<CompletionLog>();
};

std::vector<int> PageStatuses(const v1::SequenceResult& r) {
  return std::vector<int>(r.page_status().begin(), r.page_status().end());
}

constexpr uint8_t kPending = v1::PAGE_STATUS_PENDING;
constexpr uint8_t kMiss = v1::PAGE_STATUS_MISS;
constexpr uint8_t kSkipped = v1::PAGE_STATUS_SKIPPED;

TEST_F(OpTableTest, IdsAreNeverZeroAndGrowAcrossRestarts) {
  const uint64_t before = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  OpTable first(&metrics_, kRetention);
  const uint64_t a = first.NextId();
  const uint64_t b = first.NextId();
  EXPECT_GE(a, before) << "ids start at the start time in microseconds";
  EXPECT_EQ(b, a + 1);
  absl::SleepFor(absl::Milliseconds(1));
  OpTable restarted(&metrics_, kRetention);  // A restarted daemon.
  EXPECT_GT(restarted.NextId(), b) << "a restarted daemon must not reissue ids";
}

TEST_F(OpTableTest, OpWithoutDeviceWorkIsFinalizedAtOnce) {
  std::shared_ptr<OpRecord> op = AddDone(v1::OP_KIND_LOAD, {kMiss, kMiss, kSkipped});
  EXPECT_EQ(Calls(), 1);
  EXPECT_EQ(table_->unfinished(), 0u);
  v1::OpResult r = Result(*op);
  EXPECT_EQ(r.op_id(), op->id);
  EXPECT_EQ(r.kind(), v1::OP_KIND_LOAD);
  EXPECT_EQ(r.state(), v1::OP_STATE_DONE);
  ASSERT_EQ(r.sequences_size(), 2);
  EXPECT_THAT(PageStatuses(r.sequences(0)), ElementsAre(v1::PAGE_STATUS_MISS));
  EXPECT_THAT(PageStatuses(r.sequences(1)),
              ElementsAre(v1::PAGE_STATUS_MISS, v1::PAGE_STATUS_SKIPPED));
  const CacheCountersSnapshot m = metrics_.Snapshot();
  EXPECT_EQ(m.ops[0][0], 1u) << "one load done";
  EXPECT_EQ(m.pages[0][v1::PAGE_STATUS_MISS], 2u);
  EXPECT_EQ(m.pages[0][v1::PAGE_STATUS_SKIPPED], 1u);
}

TEST_F(OpTableTest, CompletionThreadFinishesAnOpWhenItsDeviceWorkEnds) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op =
      table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending, kPending, kMiss}, device));
  EXPECT_EQ(table_->unfinished(), 1u);
  v1::OpResult submitted = Result(*op, /*submission=*/true);
  EXPECT_EQ(submitted.state(), v1::OP_STATE_PENDING);
  EXPECT_EQ(submitted.sequences(0).leading_ok_pages(), 1u) << "a Load's reply counts PENDING";
  EXPECT_EQ(submitted.sequences(1).leading_ok_pages(), 1u);
  EXPECT_EQ(Result(*op).sequences(0).leading_ok_pages(), 0u) << "later results do not";

  device->Finish(absl::OkStatus());
  // Nobody waits: the completion thread alone must finish it.
  const absl::Time give_up = absl::Now() + kPatience;
  while (table_->unfinished() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(table_->unfinished(), 0u);
  EXPECT_EQ(Calls(), 1);
  v1::OpResult r = Result(*op);
  EXPECT_EQ(r.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(PageStatuses(r.sequences(1)), ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_MISS));
  EXPECT_EQ(r.sequences(1).leading_ok_pages(), 1u);
  absl::MutexLock lock(&log_->mu);
  EXPECT_TRUE(log_->device.ok());
  EXPECT_EQ(log_->cause, OpCancelCause::kNone);
  EXPECT_EQ(log_->unfinished_seen, 1u) << "the completion ran without the table's lock";
}

TEST_F(OpTableTest, DeviceFailureReachesTheCompletion) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, device));
  device->Finish(absl::DataLossError("bus fault"));
  v1::OpResult r = AwaitTerminal(op->id);
  EXPECT_EQ(r.state(), v1::OP_STATE_FAILED);
  EXPECT_EQ(r.error_message(), "bus fault");
  EXPECT_THAT(PageStatuses(r.sequences(0)), ElementsAre(v1::PAGE_STATUS_DEVICE_ERROR));
  EXPECT_EQ(metrics_.Snapshot().ops[1][1], 1u) << "one backup failed";
}

TEST_F(OpTableTest, WaiterIsFinishedOnceWhenItsOpEnds) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, device));
  TestWaiter w({op->id}, "inst", kPatience);
  ASSERT_FALSE(table_->Wait(&w)) << "not satisfied yet: registered";
  EXPECT_FALSE(w.done.HasBeenNotified());
  device->Finish(absl::OkStatus());
  ASSERT_TRUE(w.done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_FALSE(w.reply.timed_out());
  ASSERT_EQ(w.reply.ops_size(), 1);
  EXPECT_EQ(w.reply.ops(0).state(), v1::OP_STATE_DONE);
  EXPECT_FALSE(table_->RemoveWaiter(&w)) << "the table has finished it";
}

TEST_F(OpTableTest, WaitAnswersAtOnceForTerminalAndUnknownIds) {
  std::shared_ptr<OpRecord> done = AddDone(v1::OP_KIND_LOAD, {kMiss});
  TestWaiter w({done->id, 424242}, "inst", kPatience);
  ASSERT_TRUE(table_->Wait(&w)) << "unknown ids never change: they count as terminal";
  ASSERT_EQ(w.reply.ops_size(), 2);
  EXPECT_EQ(w.reply.ops(0).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(w.reply.ops(1).op_id(), 424242u);
  EXPECT_EQ(w.reply.ops(1).state(), v1::OP_STATE_UNKNOWN);

  TestWaiter other({done->id}, "another-instance", kPatience);
  ASSERT_TRUE(table_->Wait(&other));
  EXPECT_EQ(other.reply.ops(0).state(), v1::OP_STATE_UNKNOWN) << "another instance's op";
}

TEST_F(OpTableTest, WaitForAnyIsSatisfiedByOneTerminalOp) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> pending = table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, device));
  std::shared_ptr<OpRecord> done = AddDone(v1::OP_KIND_LOAD, {kMiss});
  TestWaiter all({pending->id, done->id}, "inst", kPatience);
  EXPECT_FALSE(table_->Wait(&all));
  TestWaiter any({pending->id, done->id}, "inst", kPatience, /*wait_any=*/true);
  ASSERT_TRUE(table_->Wait(&any));
  EXPECT_EQ(any.reply.ops(0).state(), v1::OP_STATE_PENDING);
  EXPECT_EQ(any.reply.ops(1).state(), v1::OP_STATE_DONE);
  EXPECT_TRUE(table_->RemoveWaiter(&all)) << "still registered: the caller finishes it";
  EXPECT_FALSE(table_->RemoveWaiter(&all));
  device->Finish(absl::OkStatus());
  AwaitTerminal(pending->id);
  EXPECT_FALSE(all.done.HasBeenNotified()) << "a removed waiter is never finished by the table";
}

TEST_F(OpTableTest, WaiterPastItsDeadlineTimesOut) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, device));
  TestWaiter expired({op->id}, "inst", -absl::Seconds(1));
  ASSERT_TRUE(table_->Wait(&expired)) << "deadline already passed: answered at once";
  EXPECT_TRUE(expired.reply.timed_out());
  EXPECT_EQ(expired.reply.ops(0).state(), v1::OP_STATE_PENDING);

  TestWaiter w({op->id}, "inst", absl::Milliseconds(20));
  ASSERT_FALSE(table_->Wait(&w));
  ASSERT_TRUE(w.done.WaitForNotificationWithTimeout(kPatience)) << "the completion thread";
  EXPECT_TRUE(w.reply.timed_out());
  EXPECT_EQ(w.reply.ops(0).state(), v1::OP_STATE_PENDING);
  device->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, FinishAllWaitersAnswersWithTheStatesAsTheyAre) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, device));
  TestWaiter w({op->id}, "inst", kPatience);
  ASSERT_FALSE(table_->Wait(&w));
  table_->FinishAllWaiters();
  ASSERT_TRUE(w.done.HasBeenNotified());
  EXPECT_TRUE(w.reply.timed_out());
  EXPECT_EQ(w.reply.ops(0).state(), v1::OP_STATE_PENDING);
  device->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, OnlyPrefetchOpsCanBeCancelled) {
  auto load_device = std::make_shared<TestDeviceOp>();
  auto prefetch_device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> load = table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, load_device));
  std::shared_ptr<OpRecord> prefetch =
      table_->Add(MakeOp(v1::OP_KIND_PREFETCH, {kPending, kPending}, prefetch_device));
  std::shared_ptr<OpRecord> done = AddDone(v1::OP_KIND_PREFETCH, {kMiss});

  EXPECT_EQ(table_->Cancel(424242, "inst"), v1::RELEASE_OUTCOME_UNKNOWN);
  EXPECT_EQ(table_->Cancel(prefetch->id, "another-instance"), v1::RELEASE_OUTCOME_UNKNOWN);
  EXPECT_EQ(table_->Cancel(done->id, "inst"), v1::RELEASE_OUTCOME_ALREADY_DONE);
  EXPECT_EQ(table_->Cancel(load->id, "inst"), v1::RELEASE_OUTCOME_NOT_CANCELLABLE);
  EXPECT_FALSE(load_device->cancel_requested()) << "a Load's copies run to the end";

  EXPECT_EQ(table_->Cancel(prefetch->id, "inst"), v1::RELEASE_OUTCOME_CANCELLED);
  EXPECT_TRUE(prefetch_device->cancel_requested());
  v1::OpResult r = Result(*prefetch);
  EXPECT_EQ(r.state(), v1::OP_STATE_CANCELLED);
  EXPECT_THAT(PageStatuses(r.sequences(1)), ElementsAre(v1::PAGE_STATUS_CANCELLED));
  {
    absl::MutexLock lock(&log_->mu);
    EXPECT_EQ(log_->cause, OpCancelCause::kReleased);
  }
  EXPECT_EQ(table_->Cancel(prefetch->id, "inst"), v1::RELEASE_OUTCOME_ALREADY_DONE);
  load_device->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, SessionEndCancelsItsOpsOnly) {
  auto mine = std::make_shared<TestDeviceOp>();
  auto theirs = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> a = table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, mine, 1));
  std::shared_ptr<OpRecord> b = table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, theirs, 2));

  EXPECT_FALSE(table_->SessionIdle(1));
  std::vector<std::shared_ptr<OpRecord>> cancelled = table_->CancelSessionOps(1);
  ASSERT_EQ(cancelled.size(), 1u);
  EXPECT_EQ(cancelled[0], a);
  EXPECT_TRUE(mine->cancel_requested());
  EXPECT_FALSE(theirs->cancel_requested());
  EXPECT_EQ(AwaitTerminal(a->id).state(), v1::OP_STATE_CANCELLED);
  EXPECT_TRUE(table_->SessionIdle(1));
  EXPECT_EQ(Result(*b).state(), v1::OP_STATE_PENDING);
  {
    absl::MutexLock lock(&log_->mu);
    EXPECT_EQ(log_->cause, OpCancelCause::kSessionEnded);
  }
  theirs->Finish(absl::OkStatus());
  EXPECT_EQ(AwaitTerminal(b->id).state(), v1::OP_STATE_DONE);
  EXPECT_TRUE(table_->SessionIdle(2));
}

TEST_F(OpTableTest, DrainOfAnIdleSessionEndsAtOnceOnTheCallersThread) {
  auto theirs = std::make_shared<TestDeviceOp>();
  table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, theirs, 2));
  TestDrainWaiter w(1, kPatience);
  table_->WatchDrain(&w);
  ASSERT_TRUE(w.done.HasBeenNotified());
  EXPECT_TRUE(w.idle);
  EXPECT_EQ(w.thread, std::this_thread::get_id());
  EXPECT_FALSE(table_->RemoveDrainWaiter(&w));
  theirs->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, DrainEndsWhenTheSessionsLastOpEndsWithoutBlockingTheCaller) {
  auto first = std::make_shared<TestDeviceOp>();
  auto second = std::make_shared<TestDeviceOp>();
  auto theirs = std::make_shared<TestDeviceOp>();
  table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, first, 1));
  table_->Add(MakeOp(v1::OP_KIND_LOAD, {kPending}, second, 1));
  table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, theirs, 2));
  TestDrainWaiter w(1, kPatience);
  const absl::Time start = absl::Now();
  table_->WatchDrain(&w);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "WatchDrain must not wait for the ops";
  EXPECT_FALSE(w.done.HasBeenNotified());

  first->Finish(absl::OkStatus());
  // One op of the session is still pending: not drained yet.
  EXPECT_FALSE(w.done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  second->Finish(absl::OkStatus());
  ASSERT_TRUE(w.done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_TRUE(w.idle);
  EXPECT_NE(w.thread, std::this_thread::get_id());
  EXPECT_FALSE(table_->RemoveDrainWaiter(&w));
  theirs->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, DrainEndsAtItsDeadlineWithOpsStillPending) {
  auto device = std::make_shared<TestDeviceOp>();
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, device, 1));
  TestDrainWaiter w(1, absl::Milliseconds(30));
  const absl::Time start = absl::Now();
  table_->WatchDrain(&w);
  ASSERT_TRUE(w.done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  EXPECT_FALSE(w.idle);
  EXPECT_NE(w.thread, std::this_thread::get_id()) << "the completion thread ends it";
  EXPECT_EQ(Result(*op).state(), v1::OP_STATE_PENDING) << "ending a drain cancels nothing";
  device->Finish(absl::OkStatus());
}

TEST_F(OpTableTest, FinishAllWaitersEndsDrainsAndRemovedOnesAreLeftAlone) {
  auto device = std::make_shared<TestDeviceOp>();
  table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, device, 1));
  TestDrainWaiter removed(1, kPatience);
  TestDrainWaiter cut(1, kPatience);
  table_->WatchDrain(&removed);
  table_->WatchDrain(&cut);
  EXPECT_TRUE(table_->RemoveDrainWaiter(&removed));
  EXPECT_FALSE(table_->RemoveDrainWaiter(&removed));
  table_->FinishAllWaiters();
  ASSERT_TRUE(cut.done.HasBeenNotified());
  EXPECT_FALSE(cut.idle);
  EXPECT_EQ(cut.thread, std::this_thread::get_id());
  device->Finish(absl::OkStatus());
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(removed.done.HasBeenNotified());
}

TEST_F(OpTableTest, ReadySignalThatNeverComesCancelsTheOpAtItsDeadline) {
  auto device = std::make_shared<TestDeviceOp>();
  std::unique_ptr<OpRecord> record = MakeOp(v1::OP_KIND_BACKUP, {kPending}, device);
  record->ready_deadline = absl::Now() + absl::Milliseconds(20);
  std::shared_ptr<OpRecord> op = table_->Add(std::move(record));
  v1::OpResult r = AwaitTerminal(op->id);
  EXPECT_EQ(r.state(), v1::OP_STATE_CANCELLED);
  EXPECT_TRUE(device->cancel_requested());
  absl::MutexLock lock(&log_->mu);
  EXPECT_EQ(log_->cause, OpCancelCause::kReadyTimeout);
}

TEST_F(OpTableTest, TerminalResultsAreForgottenAfterTheRetention) {
  std::shared_ptr<OpRecord> op = AddDone(v1::OP_KIND_LOAD, {kMiss});
  EXPECT_EQ(table_->Prune(absl::Now()), 0u) << "kept for the retention";
  EXPECT_EQ(AwaitTerminal(op->id).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(table_->Prune(absl::Now() + kRetention), 1u);
  EXPECT_EQ(AwaitTerminal(op->id).state(), v1::OP_STATE_UNKNOWN);
}

TEST_F(OpTableTest, DestructionFinishesRegisteredWaiters) {
  // A copy the device cannot recall (as on CUDA): cancelled with its session, still running.
  auto device = std::make_shared<gpu::DeviceOp>(gpu::DeviceOp::Kind::kGather, 2);
  std::shared_ptr<OpRecord> op = table_->Add(MakeOp(v1::OP_KIND_BACKUP, {kPending}, device));
  table_->CancelSessionOps(1);
  TestWaiter w({op->id}, "inst", kPatience);
  ASSERT_FALSE(table_->Wait(&w));
  table_.reset();
  ASSERT_TRUE(w.done.HasBeenNotified());
  EXPECT_TRUE(w.reply.timed_out());
  EXPECT_EQ(w.reply.ops(0).state(), v1::OP_STATE_PENDING);
  EXPECT_EQ(Calls(), 0) << "the op never ended: its completion never ran";
}

}  // namespace
}  // namespace kvcellar::server
