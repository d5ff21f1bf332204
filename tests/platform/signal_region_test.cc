// SignalRegion: an engine's KVCSIG01 region mapped on both sides, its words and its waits (the
// format's arithmetic: tests/core/signal_layout_test.cc).
#include "platform/signal_region.h"

#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "platform/shm_mapping.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::platform {
namespace {

uint64_t WordAt(const SignalRegion& r, uint64_t offset) {
  uint64_t w;
  std::memcpy(&w, r.base() + offset, sizeof(w));
  return w;
}

TEST(SignalRegionTest, CreateWritesTheDocumentedBytes) {
  absl::StatusOr<SignalRegion> r = SignalRegion::Create(UniqueShmName("sig"), 2, 80, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->size(), 64u + 2 * 704 + 3 * 64);
  EXPECT_EQ(std::memcmp(r->base(), "KVCSIG01", 8), 0);
  uint32_t header[4];
  std::memcpy(header, r->base() + 8, sizeof(header));
  EXPECT_EQ(header[0], 1u);   // version
  EXPECT_EQ(header[1], 2u);   // load slots
  EXPECT_EQ(header[2], 80u);  // layers
  EXPECT_EQ(header[3], 3u);   // ready slots
  r->PublishReady(1, 9);
  EXPECT_EQ(WordAt(*r, 64 + 2 * 704 + 64), 9u);
  r->SignalLayer(1, 3, 5);
  EXPECT_EQ(WordAt(*r, 64 + 704 + 24), 5u);
  r->SignalOp(1, 5, /*failed=*/true);
  EXPECT_EQ(WordAt(*r, 64 + 704 + 80 * 8), 11u);
}

TEST(SignalRegionTest, OpenSeesTheEnginesWords) {
  const std::string name = UniqueShmName("sig");
  absl::StatusOr<SignalRegion> engine = SignalRegion::Create(name, 4, 3, 2);
  ASSERT_TRUE(engine.ok());
  absl::StatusOr<SignalRegion> daemon = SignalRegion::Open(name);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(daemon->num_load_slots(), 4u);
  EXPECT_EQ(daemon->num_layers(), 3u);
  EXPECT_EQ(daemon->num_ready_slots(), 2u);
  engine->PublishReady(1, 3);
  EXPECT_EQ(daemon->ready_word(1), 3u);
  daemon->SignalLayer(2, 0, 8);
  EXPECT_TRUE(engine->WaitLayer(2, 0, 8, absl::Now()).ok());
  EXPECT_EQ(engine->WaitLayer(2, 1, 8, absl::Now() + absl::Milliseconds(5)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(engine->WaitLayer(4, 0, 8, absl::Now()).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SignalRegionTest, OpenRejectsWhatIsNotARegion) {
  absl::StatusOr<ShmMapping> junk = ShmMapping::Create(UniqueShmName("junk"), 4096);
  ASSERT_TRUE(junk.ok());
  absl::StatusOr<SignalRegion> r = SignalRegion::Open(junk->name());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("magic"), absl::string_view::npos) << r.status();

  core::SignalLayout::WriteHeader(junk->data(), 1, 0, 1);  // No layers.
  EXPECT_EQ(SignalRegion::Open(junk->name()).status().code(), absl::StatusCode::kInvalidArgument);
  core::SignalLayout::WriteHeader(junk->data(), 1, 2, 1);
  junk->data()[8] = 2;  // Version 2.
  EXPECT_EQ(SignalRegion::Open(junk->name()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SignalRegion::Open(UniqueShmName("missing")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(
      SignalRegion::Create(UniqueShmName("big"), SignalRegion::kMaxSlots + 1, 2, 1).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// A failed op still signals every layer (so no layer waiter blocks), then says it failed in its
// op word.
TEST(SignalRegionTest, FailureReleasesEveryWaiter) {
  const std::string name = UniqueShmName("sig");
  absl::StatusOr<SignalRegion> engine = SignalRegion::Create(name, 1, 4, 0);
  absl::StatusOr<SignalRegion> daemon = SignalRegion::Open(name);
  ASSERT_TRUE(engine.ok() && daemon.ok());
  daemon->SignalLayer(0, 0, 3);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(10));
    daemon->EndOp(0, 3, /*failed=*/true, /*first_layer=*/1);
  });
  EXPECT_TRUE(engine->WaitLayer(0, 0, 3, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_TRUE(engine->WaitLayer(0, 3, 3, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(engine->WaitOp(0, 3, absl::Now() + absl::Seconds(30)).code(),
            absl::StatusCode::kAborted);
  t.join();
  for (uint32_t l = 0; l < 4; ++l) EXPECT_EQ(engine->layer_word(0, l), 3u);
  EXPECT_EQ(engine->op_word(0), core::SignalLayout::OpWord(3, /*failed=*/true));
}

}  // namespace
}  // namespace kvcellar::platform
