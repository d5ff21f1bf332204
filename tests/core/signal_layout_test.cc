// The KVCSIG01 format's arithmetic (the region itself: tests/platform/signal_region_test.cc).
#include "core/signal_layout.h"

#include <cstring>

#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

TEST(SignalLayoutTest, BinaryLayoutIsTheDocumentedOne) {
  // A load slot is L layer words and the op word, rounded up to cache lines.
  EXPECT_EQ(SignalLayout::LoadSlotStride(1), 64u);
  EXPECT_EQ(SignalLayout::LoadSlotStride(7), 64u);
  EXPECT_EQ(SignalLayout::LoadSlotStride(8), 128u);
  EXPECT_EQ(SignalLayout::LoadSlotStride(80), 704u);
  EXPECT_EQ(SignalLayout::Bytes(2, 80, 3), 64u + 2 * 704 + 3 * 64);
  const SignalLayout l(2, 80, 3);
  EXPECT_EQ(l.Bytes(), SignalLayout::Bytes(2, 80, 3));
  EXPECT_EQ(l.LayerWordOffset(1, 3), 64u + 704 + 24);
  EXPECT_EQ(l.OpWordOffset(1), 64u + 704 + 80 * 8);
  EXPECT_EQ(l.ReadyWordOffset(2), 64u + 2 * 704 + 2 * 64);
  EXPECT_EQ(SignalLayout::OpWord(5, /*failed=*/false), 10u);
  EXPECT_EQ(SignalLayout::OpWord(5, /*failed=*/true), 11u);
}

TEST(SignalLayoutTest, HeaderRoundTrips) {
  uint8_t header[SignalLayout::kHeaderBytes] = {};
  EXPECT_FALSE(SignalLayout::HasMagic(header));
  SignalLayout::WriteHeader(header, 4, 61, 2);
  EXPECT_EQ(std::memcmp(header, "KVCSIG01", 8), 0);
  EXPECT_TRUE(SignalLayout::HasMagic(header));
  uint32_t words[4];
  std::memcpy(words, header + 8, sizeof(words));  // u32 version, load slots, layers, ready.
  EXPECT_EQ(words[0], 1u);
  EXPECT_EQ(words[1], 4u);
  EXPECT_EQ(words[2], 61u);
  EXPECT_EQ(words[3], 2u);
  const SignalLayout::Header h = SignalLayout::ReadHeader(header);
  EXPECT_EQ(h.version, SignalLayout::kVersion);
  EXPECT_EQ(h.num_load_slots, 4u);
  EXPECT_EQ(h.num_layers, 61u);
  EXPECT_EQ(h.num_ready_slots, 2u);
}

}  // namespace
}  // namespace kvcellar::core
