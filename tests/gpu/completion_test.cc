#include "gpu/completion.h"

#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gpu/sim_engine_memory.h"
#include "gtest/gtest.h"

namespace kvcellar::gpu {
namespace {

TEST(CompletionRegionTest, BinaryLayoutIsTheDocumentedOne) {
  EXPECT_EQ(CompletionRegion::SlotStride(1), 64u);
  EXPECT_EQ(CompletionRegion::SlotStride(6), 64u);
  EXPECT_EQ(CompletionRegion::SlotStride(7), 128u);
  EXPECT_EQ(CompletionRegion::Bytes(2, 80), 128u + 2 * 704);
  EXPECT_EQ(CompletionRegion::LayerOffset(80, 1, 3), 128u + 704 + 16 + 24);

  absl::StatusOr<CompletionRegion> r = CompletionRegion::Create(UniqueShmName("cmpl"), 2, 80);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t* w = reinterpret_cast<const uint64_t*>(r->base());
  EXPECT_EQ(w[0], CompletionRegion::kMagic);
  EXPECT_EQ(w[1], 1u);
  EXPECT_EQ(w[2], 2u);
  EXPECT_EQ(w[3], 80u);
  r->PublishFence(9);
  EXPECT_EQ(w[8], 9u);
  r->SignalLayer(1, 3, 5);
  EXPECT_EQ(w[(128 + 704 + 16 + 24) / 8], 5u);
}

TEST(CompletionRegionTest, AttachSeesTheEnginesWords) {
  const std::string name = UniqueShmName("cmpl");
  absl::StatusOr<CompletionRegion> engine = CompletionRegion::Create(name, 4, 3);
  ASSERT_TRUE(engine.ok());
  absl::StatusOr<CompletionRegion> daemon = CompletionRegion::Attach(name, 3);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(daemon->num_slots(), 4u);
  engine->PublishFence(3);
  EXPECT_EQ(daemon->fence(), 3u);
  daemon->SignalLayer(2, 0, 8);
  EXPECT_TRUE(engine->WaitLayer(2, 0, 8, absl::Now()).ok());
  EXPECT_EQ(engine->WaitLayer(2, 1, 8, absl::Now() + absl::Milliseconds(5)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(CompletionRegion::Attach(name, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CompletionRegionTest, FailureReleasesEveryWaiter) {
  const std::string name = UniqueShmName("cmpl");
  absl::StatusOr<CompletionRegion> engine = CompletionRegion::Create(name, 1, 4);
  absl::StatusOr<CompletionRegion> daemon = CompletionRegion::Attach(name, 4);
  ASSERT_TRUE(engine.ok() && daemon.ok());
  daemon->SignalLayer(0, 0, 3);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(10));
    daemon->SignalFailed(0, 3);
  });
  EXPECT_TRUE(engine->WaitLayer(0, 0, 3, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(engine->WaitLayer(0, 3, 3, absl::Now() + absl::Seconds(30)).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(engine->WaitDone(0, 3, absl::Now() + absl::Seconds(30)).code(),
            absl::StatusCode::kAborted);
  t.join();
}

}  // namespace
}  // namespace kvcellar::gpu
