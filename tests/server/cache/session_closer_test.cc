// Tests server/cache/session_closer.h: a close returns at once, finishes on the closer's thread
// once the session's ops have ended or its drain is over, one engine's long drain does not hold
// up another's close, and Stop() cuts drains short. The OpTable is real; device work is a real
// gpu::DeviceOp the test finishes, as a backend would.
#include "server/cache/session_closer.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/metrics/cache_metrics.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(5);  // Only reached when a test fails.

class TestDeviceOp final : public gpu::DeviceOp {
 public:
  TestDeviceOp() : DeviceOp(Kind::kScatter, 1) {}

 private:
  void OnCancel() override { Finish(absl::CancelledError("cancelled")); }
};

class DoneCompletion final : public OpCompletion {
 public:
  OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                     absl::Span<uint8_t> statuses) override {
    for (uint8_t& s : statuses) s = v1::PAGE_STATUS_OK;
    if (cause != OpCancelCause::kNone) return {v1::OP_STATE_CANCELLED, ""};
    return {device.ok() ? v1::OP_STATE_DONE : v1::OP_STATE_FAILED, ""};
  }
};

// What each close's `finish` saw and its `done` got, by session id.
struct Finished {
  absl::Mutex mu;
  std::vector<uint64_t> order ABSL_GUARDED_BY(mu);
  std::vector<bool> idle_at_finish ABSL_GUARDED_BY(mu);
  std::vector<std::thread::id> threads ABSL_GUARDED_BY(mu);

  bool Has(uint64_t id) {
    absl::MutexLock lock(&mu);
    return std::find(order.begin(), order.end(), id) != order.end();
  }
  bool AwaitCount(size_t n, absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return order.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
};

class SessionCloserTest : public ::testing::Test {
 protected:
  SessionCloserTest()
      : metrics_(&registry_),
        ops_(&metrics_, absl::Seconds(60)),
        closer_(&ops_, [this](SessionEnd& end) {
          // As Cache::FinishEnd: what is still pending is cancelled here.
          const bool idle = ops_.SessionIdle(end.session->id());
          const auto cancelled = ops_.CancelSessionOps(end.session->id());
          SessionEndCounts counts;
          counts.ops_cancelled = static_cast<uint32_t>(cancelled.size());
          absl::MutexLock lock(&finished_.mu);
          finished_.order.push_back(end.session->id());
          finished_.idle_at_finish.push_back(idle);
          finished_.threads.push_back(std::this_thread::get_id());
          return counts;
        }) {}

  ~SessionCloserTest() override { closer_.Stop(); }

  std::shared_ptr<Session> MakeSession(uint64_t id) {
    SessionInfo info;
    info.id = id;
    info.instance_id = "inst-" + std::to_string(id);
    info.role = v1::SESSION_ROLE_SCHEDULER;
    return std::make_shared<Session>(std::move(info), nullptr, absl::InfiniteFuture());
  }

  std::shared_ptr<TestDeviceOp> AddOp(uint64_t session) {
    auto device = std::make_shared<TestDeviceOp>();
    auto op = std::make_unique<OpRecord>();
    op->id = ops_.NextId();
    op->kind = v1::OP_KIND_BACKUP;
    op->instance_id = "inst-" + std::to_string(session);
    op->session_id = session;
    op->submitted = absl::Now();
    op->seq_begin = {0, 1};
    op->statuses = {v1::PAGE_STATUS_PENDING};
    op->device = device;
    op->completion = std::make_unique<DoneCompletion>();
    ops_.Add(std::move(op));
    return device;
  }

  // Closes session `id` with `drain`; `*counts` gets what `done` is called with.
  void Close(uint64_t id, absl::Duration drain, SessionEndCounts* counts = nullptr,
             absl::Notification* done = nullptr) {
    auto end = std::make_unique<SessionEnd>();
    end->session = MakeSession(id);
    end->reason = "test";
    end->done = [counts, done](const SessionEndCounts& c) {
      if (counts != nullptr) *counts = c;
      if (done != nullptr) done->Notify();
    };
    closer_.Close(std::move(end), absl::Now() + drain);
  }

  MetricsRegistry registry_;
  CacheMetrics metrics_;
  OpTable ops_;
  Finished finished_;
  SessionCloser closer_;
};

TEST_F(SessionCloserTest, CloseReturnsAtOnceAndFinishesOnTheClosersThreadWhenOpsEnd) {
  std::shared_ptr<TestDeviceOp> op = AddOp(1);
  absl::Notification done;
  SessionEndCounts counts;
  const absl::Time start = absl::Now();
  Close(1, kPatience, &counts, &done);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "finished while its op was still pending";
  op->Finish(absl::OkStatus());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(counts.ops_cancelled, 0u);
  absl::MutexLock lock(&finished_.mu);
  ASSERT_EQ(finished_.order.size(), 1u);
  EXPECT_TRUE(finished_.idle_at_finish[0]);
  EXPECT_NE(finished_.threads[0], std::this_thread::get_id());
}

TEST_F(SessionCloserTest, OneLongDrainDoesNotHoldUpAnotherClose) {
  std::shared_ptr<TestDeviceOp> stuck = AddOp(1);  // Never ends by itself.
  std::shared_ptr<TestDeviceOp> quick = AddOp(2);
  absl::Notification stuck_done, quick_done;
  SessionEndCounts stuck_counts;
  Close(1, absl::Seconds(2), &stuck_counts, &stuck_done);
  Close(2, kPatience, nullptr, &quick_done);
  Close(3, kPatience);  // No ops: drained at once.
  quick->Finish(absl::OkStatus());
  ASSERT_TRUE(quick_done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  EXPECT_TRUE(finished_.AwaitCount(2, kPatience));
  EXPECT_FALSE(stuck_done.HasBeenNotified());
  // At its deadline the stuck one's op is cancelled.
  ASSERT_TRUE(stuck_done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(stuck_counts.ops_cancelled, 1u);
  EXPECT_TRUE(stuck->cancel_requested());
  absl::MutexLock lock(&finished_.mu);
  EXPECT_EQ(finished_.order.back(), 1u);
}

TEST_F(SessionCloserTest, StopCutsDrainsShortAndLaterClosesFinishOnTheCaller) {
  std::shared_ptr<TestDeviceOp> stuck = AddOp(1);
  absl::Notification done;
  SessionEndCounts counts;
  Close(1, absl::Hours(1), &counts, &done);
  const absl::Time start = absl::Now();
  closer_.Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_TRUE(done.HasBeenNotified());
  EXPECT_EQ(counts.ops_cancelled, 1u);

  std::shared_ptr<TestDeviceOp> late = AddOp(2);
  absl::Notification late_done;
  Close(2, absl::Hours(1), nullptr, &late_done);
  ASSERT_TRUE(late_done.HasBeenNotified());
  EXPECT_TRUE(late->cancel_requested());
  absl::MutexLock lock(&finished_.mu);
  EXPECT_EQ(finished_.threads.back(), std::this_thread::get_id());
}

}  // namespace
}  // namespace kvcellar::server
