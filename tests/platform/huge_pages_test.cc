// Tests for platform/huge_pages.h: the policy and backing names, and the kernel settings it reads.
#include "platform/huge_pages.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

TEST(HugePagesTest, HugePageNames) {
  EXPECT_EQ(*ParseHugePages("auto"), HugePages::kAuto);
  EXPECT_EQ(*ParseHugePages("on"), HugePages::kOn);
  EXPECT_EQ(*ParseHugePages("off"), HugePages::kOff);
  EXPECT_FALSE(ParseHugePages("yes").ok());
  EXPECT_EQ(HugePagesName(HugePages::kAuto), "auto");
  EXPECT_EQ(HugePagesName(HugePages::kOn), "on");
  EXPECT_EQ(HugePagesName(HugePages::kOff), "off");
  EXPECT_EQ(HugePageBackingName(HugePageBacking::kTransparent), "transparent");
  EXPECT_EQ(HugePageBackingName(HugePageBacking::kHugetlb), "hugetlb");
  EXPECT_EQ(HugePageBackingName(HugePageBacking::kNone), "none");
}

TEST(HugePagesTest, HugePageSizeIsAPowerOfTwoOfAtLeast64KiB) {
  const uint64_t page = HugePageBytes();
  EXPECT_GE(page, uint64_t{64} << 10);
  EXPECT_EQ(page & (page - 1), 0u) << page;
}

TEST(HugePagesTest, HugetlbAdviceSaysHowManyPagesAndWhatToDo) {
  const uint64_t page = HugePageBytes();
  const std::string advice = HugetlbAdvice(3 * page - 1);
  EXPECT_THAT(advice, HasSubstr("HugePages_Total="));
  EXPECT_THAT(advice, HasSubstr("HugePages_Free="));
  EXPECT_THAT(advice, HasSubstr("needs 3 free huge pages"));
  EXPECT_THAT(advice, HasSubstr("vm.nr_hugepages"));
  EXPECT_THAT(advice, HasSubstr("huge_pages=auto"));
}

}  // namespace
}  // namespace kvcellar::platform
