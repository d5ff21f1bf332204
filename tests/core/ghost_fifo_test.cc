// Tests for core/ghost_fifo.h.
#include "core/ghost_fifo.h"

#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

TEST(GhostFifoTest, TakeReturnsThePayloadAndTheAddsSince) {
  GhostFifo g;
  g.Add(10, 2, 100);
  g.Add(11, 1, 100);
  g.Add(12, 3, 100);
  std::optional<GhostFifo::Taken> t = g.Take(10);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->payload, 2);
  EXPECT_EQ(t->age, 2u);
  EXPECT_FALSE(g.Take(10).has_value());  // Taken once.
  EXPECT_EQ(g.Take(12)->age, 0u);
  EXPECT_EQ(g.Take(11)->payload, 1);
  EXPECT_FALSE(g.Take(99).has_value());
  EXPECT_TRUE(g.Check().ok());
}

TEST(GhostFifoTest, EntriesLeaveAfterCapacityAddsAndAgainMovesToTheHead) {
  GhostFifo g;
  constexpr size_t kCapacity = 50;
  for (uint64_t i = 0; i < 200; ++i) g.Add(i, 0, kCapacity);
  EXPECT_EQ(g.Size(), kCapacity);
  EXPECT_FALSE(g.Take(149).has_value());  // 50 adds came after it.
  EXPECT_TRUE(g.Take(150).has_value());
  g.Add(151, 1, kCapacity);  // Again: young, with the new payload.
  for (uint64_t i = 1000; i < 1040; ++i) g.Add(i, 0, kCapacity);
  std::optional<GhostFifo::Taken> t = g.Take(151);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->payload, 1);
  EXPECT_EQ(t->age, 40u);
  EXPECT_TRUE(g.Check().ok());
  EXPECT_GT(g.MemoryBytes(), 0u);
}

}  // namespace
}  // namespace kvcellar::core
