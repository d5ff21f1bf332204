// SimEngine's pattern and blocks, the KVCSIG01 signal region, and Backoff.
#include "client/sim_engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "client/backoff.h"
#include "client/sim_signals.h"

namespace kvcellar::client {
namespace {

core::PageKey Key(uint8_t b) {
  core::PageKey k;
  k.bytes.fill(b);
  return k;
}

TEST(PatternTest, IsAPureFunctionOfItsInputs) {
  const core::PageKey k = Key(7);
  uint8_t a[100], b[100];
  FillPattern(a, sizeof(a), 1, k, 0, 0, 0);
  FillPattern(b, sizeof(b), 1, k, 0, 0, 0);
  EXPECT_EQ(std::memcmp(a, b, sizeof(a)), 0);
  for (uint64_t i = 0; i < sizeof(a); ++i) EXPECT_EQ(a[i], PatternByte(1, k, 0, 0, i)) << i;
  // Any unaligned window of the same sequence agrees with it.
  uint8_t c[50];
  FillPattern(c, sizeof(c), 1, k, 0, 0, 13);
  EXPECT_EQ(std::memcmp(c, a + 13, sizeof(c)), 0);
  // Every input changes the bytes.
  FillPattern(b, sizeof(b), 2, k, 0, 0, 0);
  EXPECT_NE(std::memcmp(a, b, sizeof(a)), 0);
  FillPattern(b, sizeof(b), 1, Key(8), 0, 0, 0);
  EXPECT_NE(std::memcmp(a, b, sizeof(a)), 0);
  FillPattern(b, sizeof(b), 1, k, 1, 0, 0);
  EXPECT_NE(std::memcmp(a, b, sizeof(a)), 0);
  FillPattern(b, sizeof(b), 1, k, 0, 1, 0);
  EXPECT_NE(std::memcmp(a, b, sizeof(a)), 0);
}

TEST(SimEngineTest, FillThenVerifyAndDetectCorruption) {
  for (auto arrangement : {platform::SimKvShape::Arrangement::kLayerFirst,
                           platform::SimKvShape::Arrangement::kBlockFirst}) {
    for (bool mla : {false, true}) {
      auto e = SimEngine::Create({.num_layers = 3,
                                  .mla = mla,
                                  .bytes_per_block = 100,
                                  .num_blocks = 6,
                                  .arrangement = arrangement});
      ASSERT_TRUE(e.ok()) << e.status();
      EXPECT_EQ((*e)->page_bytes(), 3u * (mla ? 1 : 2) * 100);
      EXPECT_EQ((*e)->layout().PageObjectBytes(), (*e)->page_bytes());
      for (uint32_t b = 0; b < 6; ++b) (*e)->FillBlock(b, 5, Key(b), 1);
      for (uint32_t b = 0; b < 6; ++b) EXPECT_EQ((*e)->CountMismatches(b, 5, Key(b), 1), 0u);
      EXPECT_GT((*e)->CountMismatches(2, 5, Key(3), 1), 0u);  // Another page's bytes.
      EXPECT_GT((*e)->CountMismatches(2, 5, Key(2), 0), 0u);  // Another shard's bytes.
      (*e)->Block(2, 0, 4)[17] ^= 1;
      std::string first;
      EXPECT_EQ((*e)->CountMismatches(4, 5, Key(4), 1, &first), 1u);
      EXPECT_NE(first.find("layer 2"), std::string::npos) << first;
      // Neighbours untouched: blocks do not overlap.
      EXPECT_EQ((*e)->CountMismatches(3, 5, Key(3), 1), 0u);
      EXPECT_EQ((*e)->CountMismatches(5, 5, Key(5), 1), 0u);
    }
  }
}

TEST(SimEngineTest, DescribesARegistrableEngine) {
  auto e = SimEngine::Create({.num_layers = 2, .bytes_per_block = 64, .num_blocks = 4});
  ASSERT_TRUE(e.ok());
  EngineRegistration reg;
  (*e)->Describe(&reg);
  EXPECT_EQ(reg.device_kind, DeviceKind::kSim);
  EXPECT_TRUE(reg.layout.Validate().ok());
  EXPECT_EQ(reg.completion.num_load_slots, 4u);
  EXPECT_EQ(reg.completion.num_ready_slots, 4u);
  EXPECT_EQ(reg.completion.sim_size_bytes, SimSignalRegion::Bytes(4, 2, 4));
  const uint64_t t1 = (*e)->NextReadyToken();
  EXPECT_EQ((*e)->NextReadyToken(), t1 + 1);
}

TEST(SimSignalsTest, HeaderFollowsTheProto) {
  auto r = SimSignalRegion::Create(platform::UniqueShmName("sig"), 3, 5, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  // S = roundup((5 + 1) * 8, 64) = 64; 64 + 3 * 64 + 2 * 64.
  EXPECT_EQ(SimSignalRegion::LoadSlotStride(5), 64u);
  EXPECT_EQ(SimSignalRegion::LoadSlotStride(8), 128u);  // 9 words: two lines.
  EXPECT_EQ(r->size(), 64u + 3 * 64 + 2 * 64);
  EXPECT_EQ(r->LayerWordOffset(1, 2), 64u + 64 + 16);
  EXPECT_EQ(r->OpWordOffset(2), 64u + 128 + 40);
  EXPECT_EQ(r->ReadyWordOffset(1), 64u + 192 + 64);
  auto opened = SimSignalRegion::Open(r->name());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->num_load_slots(), 3u);
  EXPECT_EQ(opened->num_layers(), 5u);
  EXPECT_EQ(opened->num_ready_slots(), 2u);
  // Engine writes the ready word; the other mapping sees it.
  r->PublishReady(1, 77);
  EXPECT_EQ(opened->ready_word(1), 77u);
}

TEST(SimSignalsTest, WaitsFollowTheOpWordRules) {
  auto r = SimSignalRegion::Create(platform::UniqueShmName("sig"), 2, 2, 1);
  ASSERT_TRUE(r.ok());
  const absl::Time soon = absl::Now() + absl::Milliseconds(20);
  EXPECT_EQ(r->WaitLayer(0, 0, 5, soon).code(), absl::StatusCode::kDeadlineExceeded);
  std::thread daemon([&] {
    absl::SleepFor(absl::Milliseconds(10));
    r->SignalLayer(0, 0, 5);
    r->SignalLayer(0, 1, 5);
    r->SignalOp(0, 5, /*failed=*/false);
  });
  const absl::Time later = absl::Now() + absl::Seconds(5);
  EXPECT_TRUE(r->WaitLayer(0, 0, 5, later).ok());
  EXPECT_TRUE(r->WaitLayer(0, 1, 5, later).ok());
  EXPECT_TRUE(r->WaitOp(0, 5, later).ok());
  daemon.join();
  // A stale (smaller) id never satisfies a newer op; a larger one satisfies an older wait.
  EXPECT_TRUE(r->WaitLayer(0, 0, 4, soon).ok());
  EXPECT_FALSE(r->WaitLayer(0, 0, 6, absl::Now() + absl::Milliseconds(5)).ok());
  r->SignalOp(1, 9, /*failed=*/true);
  EXPECT_EQ(r->WaitOp(1, 9, later).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(r->WaitOp(1, 8, later).code(), absl::StatusCode::kFailedPrecondition);
  r->ResetCounters();
  EXPECT_EQ(r->layer_word(0, 0), 0u);
  EXPECT_EQ(r->op_word(1), 0u);
  auto again = SimSignalRegion::Open(r->name());
  EXPECT_TRUE(again.ok()) << "header survives ResetCounters";
}

TEST(BackoffTest, DoublesWithinBoundsWithJitter) {
  Backoff b(absl::Milliseconds(100), absl::Milliseconds(1000), /*seed=*/42);
  absl::Duration prev_base = b.current();
  for (int i = 0; i < 10; ++i) {
    const absl::Duration base = b.current();
    const absl::Duration d = b.Next();
    EXPECT_GE(d, absl::Milliseconds(100));
    EXPECT_LE(d, absl::Milliseconds(1000));
    EXPECT_GE(d, base * 0.79);
    EXPECT_LE(d, base * 1.21);
    EXPECT_GE(b.current(), prev_base);
    prev_base = b.current();
  }
  EXPECT_EQ(b.current(), absl::Milliseconds(1000));
  b.Reset();
  EXPECT_EQ(b.current(), absl::Milliseconds(100));
  Backoff odd(absl::ZeroDuration(), absl::ZeroDuration());
  EXPECT_GE(odd.Next(), absl::Milliseconds(1));
}

}  // namespace
}  // namespace kvcellar::client
