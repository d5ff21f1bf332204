#include "core/crc32c.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 B.4 and the common check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32cTest, HardwareMatchesSoftwareAtEveryLengthAndAlignment) {
  std::mt19937_64 rng(42);
  std::vector<uint8_t> buf(3 * 8192 * 2 + 4096);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  // Lengths around every block boundary of the three-way loops, at odd offsets.
  std::vector<size_t> lengths = {0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 4096, 24575, 24576, 24577,
                                 49152 + 13};
  for (int i = 0; i < 50; ++i) lengths.push_back(rng() % (buf.size() - 8));
  for (size_t len : lengths) {
    for (size_t off : {0, 1, 3, 7}) {
      ASSERT_EQ(Crc32c(buf.data() + off, len), Crc32cSoftware(buf.data() + off, len))
          << "len " << len << " off " << off;
    }
  }
}

TEST(Crc32cTest, Extends) {
  const std::string a = "hello, ", b = "kv cache";
  const std::string ab = a + b;
  EXPECT_EQ(Crc32c(b.data(), b.size(), Crc32c(a.data(), a.size())), Crc32c(ab.data(), ab.size()));
  EXPECT_EQ(Crc32cSoftware(b.data(), b.size(), Crc32cSoftware(a.data(), a.size())),
            Crc32c(ab.data(), ab.size()));
}

}  // namespace
}  // namespace kvcellar::core
