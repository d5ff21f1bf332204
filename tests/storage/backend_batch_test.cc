#include "storage/backend_batch.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using P = Presence;

TEST(BackendBatchTest, ChecksNameTheFieldBuffersFirst) {
  const core::PageKey ns = testing::TestNamespace();
  uint8_t byte = 0;
  const GetItem gets[] = {{testing::TestKey(1), 0, &byte, 1}, {testing::TestKey(2), 0, &byte, 0}};
  absl::Status s = CheckRequest(GetRequest{ns, gets}, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "items[1]: no destination buffer");
  s = CheckRequest(GetRequest{ns, gets}, 1);  // Both wrong: the buffer is named first.
  EXPECT_EQ(s.message(), "items[1]: no destination buffer");
  EXPECT_TRUE(CheckRequest(GetRequest{ns, absl::MakeConstSpan(gets, 1)}, 1).ok());
  s = CheckRequest(GetRequest{ns, absl::MakeConstSpan(gets, 1)}, 0);
  EXPECT_EQ(s.message(), "items: 1 exceeds max_batch_items 0");

  const PutItem puts[] = {{testing::TestKey(1), 0, nullptr, 1, {}}};
  s = CheckRequest(PutRequest{ns, puts}, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "items[0]: empty source buffer");

  const ObjectRef refs[] = {{testing::TestKey(1), 0}, {testing::TestKey(2), 0}};
  EXPECT_TRUE(CheckRequest(DeleteRequest{ns, refs}, 2).ok());
  EXPECT_EQ(CheckRequest(DeleteRequest{ns, refs}, 1).message(),
            "items: 2 exceeds max_batch_items 1");

  const core::PageKey keys[] = {testing::TestKey(1)};
  const uint32_t shards[] = {0, 1};
  ExistsRequest exists{ns, keys, {}};
  EXPECT_EQ(CheckRequest(exists, 8).message(), "shards: empty");
  exists.keys = {};
  EXPECT_TRUE(CheckRequest(exists, 8).ok());  // Nothing asked, nothing needed.
  exists.keys = keys;
  exists.shards = shards;
  EXPECT_TRUE(CheckRequest(exists, 2).ok());
  EXPECT_EQ(ExistsObjectCount(exists), 2u);
  EXPECT_EQ(CheckRequest(exists, 1).message(), "items: 2 exceeds max_batch_items 1");
}

TEST(BackendBatchTest, InFlightBatchesRefusesOnceClosedAndWaitsForTheRest) {
  InFlightBatches in_flight("test backend");
  EXPECT_TRUE(in_flight.CheckOpen().ok());
  in_flight.Add();
  in_flight.Close();
  absl::Status s = in_flight.CheckOpen();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "test backend is shutting down");
  std::atomic<bool> idle{false};
  std::thread waiter([&] {
    in_flight.WaitIdle();
    idle.store(true);
  });
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(idle.load());
  in_flight.Remove();
  waiter.join();
  EXPECT_TRUE(idle.load());
}

TEST(BackendBatchTest, DeadlineIsTheTimeoutOrTheDefault) {
  absl::Time before = absl::Now();
  absl::Time d = BatchDeadline(absl::ZeroDuration(), absl::Seconds(10));
  absl::Time after = absl::Now();
  EXPECT_GE(d, before + absl::Seconds(10));
  EXPECT_LE(d, after + absl::Seconds(10));
  before = absl::Now();
  d = BatchDeadline(absl::Milliseconds(5), absl::Seconds(10));
  after = absl::Now();
  EXPECT_GE(d, before + absl::Milliseconds(5));
  EXPECT_LE(d, after + absl::Milliseconds(5));
}

TEST(BackendBatchTest, ExistsAnswerIsTheLongestPresentPrefix) {
  // Two shards per key.
  std::vector<P> all = {P::kPresent, P::kPresent, P::kPresent, P::kPresent};
  ExistsResult r = ExistsAnswer(all, 2, 2);
  EXPECT_EQ(r.present_prefix, 2u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);

  std::vector<P> gap = {P::kPresent, P::kPresent, P::kPresent,
                        P::kAbsent,  P::kPresent, P::kPresent};
  r = ExistsAnswer(gap, 3, 2);
  EXPECT_EQ(r.present_prefix, 1u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);  // Exact: key 1 is absent.

  std::vector<P> transient = {P::kPresent, P::kUnknownTransient, P::kAbsent, P::kAbsent};
  r = ExistsAnswer(transient, 2, 2);
  EXPECT_EQ(r.present_prefix, 0u);
  EXPECT_EQ(r.status, ObjectStatus::kRetry);

  // An absent shard first, then an unknown one of the same key: the unknown decides.
  std::vector<P> mixed = {P::kAbsent, P::kUnknownError};
  r = ExistsAnswer(mixed, 1, 2);
  EXPECT_EQ(r.present_prefix, 0u);
  EXPECT_EQ(r.status, ObjectStatus::kDeviceError);

  // Unknowns past the first missing key do not matter.
  std::vector<P> later = {P::kAbsent, P::kUnknownError};
  r = ExistsAnswer(later, 2, 1);
  EXPECT_EQ(r.present_prefix, 0u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);

  r = ExistsAnswer({}, 0, 2);
  EXPECT_EQ(r.present_prefix, 0u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);
}

TEST(BackendBatchTest, DeliverRunsTheCallbackAndCounts) {
  StatsCounters stats;
  BatchState b;
  b.kind = OpKind::kGet;
  b.results = {ItemResult{ObjectStatus::kOk, 100}, ItemResult{ObjectStatus::kNotFound, 0}};
  b.deadline_exceeded.store(true);
  BatchResult got;
  b.done = [&](BatchResult r) { got = std::move(r); };
  b.Deliver(stats);
  ASSERT_EQ(got.items.size(), 2u);
  EXPECT_EQ(got.items[0].bytes, 100u);
  EXPECT_TRUE(got.deadline_exceeded);
  BackendStats s;
  stats.Snapshot(&s);
  EXPECT_EQ(s.op(OpKind::kGet).batches, 1u);
  EXPECT_EQ(s.op(OpKind::kGet).bytes, 100u);
  EXPECT_EQ(s.op(OpKind::kGet).deadline_exceeded, 1u);

  BatchState e;
  e.kind = OpKind::kExists;
  e.nkeys = 2;
  e.nshards = 1;
  e.presence = {P::kPresent, P::kAbsent};
  ExistsResult answer;
  e.exists_done = [&](ExistsResult r) { answer = r; };
  e.Deliver(stats);
  EXPECT_EQ(answer.present_prefix, 1u);
  stats.Snapshot(&s);
  EXPECT_EQ(s.op(OpKind::kExists).objects, 2u);
}

}  // namespace
}  // namespace kvcellar::storage
