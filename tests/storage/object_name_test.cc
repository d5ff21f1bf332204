#include "storage/object_name.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

TEST(ObjectNameTest, HexIsLowercaseTwoDigitsPerByte) {
  const uint8_t bytes[] = {0x00, 0x0f, 0xa5, 0xff};
  char out[16] = {};
  char* end = AppendHex(bytes, sizeof(bytes), out);
  EXPECT_EQ(std::string(out, end), "000fa5ff");
}

TEST(ObjectNameTest, NamespaceTagIsTheFirstEightBytes) {
  const core::PageKey ns = testing::TestNamespace();
  char out[2 * kNamespaceTagBytes + 1] = {};
  char* end = AppendNamespaceTag(ns, out);
  ASSERT_EQ(end - out, 16);
  EXPECT_EQ(std::string(out, end), ns.Hex().substr(0, 16));
}

TEST(ObjectNameTest, DecimalIsNulTerminatedAndFitsTheLargestShard) {
  char out[kMaxDecimalChars + 1];
  std::memset(out, 'x', sizeof(out));
  char* end = AppendDecimal(UINT32_MAX, out);
  EXPECT_EQ(end - out, 10);
  EXPECT_EQ(*end, '\0');
  EXPECT_STREQ(out, "4294967295");
  end = AppendDecimal(0, out);
  EXPECT_STREQ(out, "0");
  EXPECT_EQ(end - out, 1);
}

TEST(ObjectNameTest, ParseHexTakesOnlyWhatWeWrite) {
  uint8_t out[4];
  ASSERT_TRUE(ParseHex("00a5ff", out));
  EXPECT_EQ(out[0], 0x00);
  EXPECT_EQ(out[1], 0xa5);
  EXPECT_EQ(out[2], 0xff);
  EXPECT_TRUE(ParseHex("", out));
  EXPECT_FALSE(ParseHex("abc", out));  // Odd length.
  EXPECT_FALSE(ParseHex("AB", out));   // Uppercase: not ours.
  EXPECT_FALSE(ParseHex("0g", out));
}

TEST(ObjectNameTest, ParseDecimalRejectsAnythingButAPlainUint32) {
  uint32_t v = 0;
  ASSERT_TRUE(ParseDecimal("4294967295", &v));
  EXPECT_EQ(v, UINT32_MAX);
  ASSERT_TRUE(ParseDecimal("007", &v));
  EXPECT_EQ(v, 7u);
  EXPECT_FALSE(ParseDecimal("", &v));
  EXPECT_FALSE(ParseDecimal("4294967296", &v));   // Overflow.
  EXPECT_FALSE(ParseDecimal("12345678901", &v));  // Too many digits.
  EXPECT_FALSE(ParseDecimal("-1", &v));
  EXPECT_FALSE(ParseDecimal("+1", &v));
  EXPECT_FALSE(ParseDecimal(" 1", &v));
}

TEST(ObjectNameTest, HexRoundTrips) {
  const core::PageKey key = testing::TestKey(42);
  char out[64];
  AppendHex(key.bytes.data(), key.bytes.size(), out);
  core::PageKey back;
  ASSERT_TRUE(ParseHex(absl::string_view(out, 64), back.bytes.data()));
  EXPECT_EQ(back, key);
}

}  // namespace
}  // namespace kvcellar::storage
