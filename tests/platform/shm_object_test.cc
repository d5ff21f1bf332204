// Tests for platform/shm_object.h: names, create versus open, the one-owner lock, and that a
// failed open leaves nothing behind.
#include "platform/shm_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBytes = uint64_t{1} << 20;

// A name unique to this process and test, so parallel ctest runs never share an object.
std::string ShmName(absl::string_view tag) {
  return absl::StrCat("/kvcellar-test-", getpid(), "-", tag);
}

bool ShmExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(ShmObjectTest, NormalizeName) {
  EXPECT_EQ(*ShmObject::NormalizeName("pool"), "/pool");
  EXPECT_EQ(*ShmObject::NormalizeName("/pool"), "/pool");
  for (absl::string_view bad : {"", "/", "a/b", "/a/b", "//a"}) {
    absl::StatusOr<std::string> n = ShmObject::NormalizeName(bad);
    ASSERT_FALSE(n.ok()) << bad;
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(n.status().message(), HasSubstr("must be one path component"));
  }
  EXPECT_FALSE(ShmObject::NormalizeName(std::string(300, 'x')).ok());
}

TEST(ShmObjectTest, CreatesThenOpensOneOwnerAtATime) {
  const std::string name = ShmName("owner");
  {
    absl::StatusOr<std::unique_ptr<ShmObject>> a = ShmObject::Open(name, kBytes);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE((*a)->created());
    EXPECT_EQ((*a)->name(), name);
    struct stat st;
    ASSERT_EQ(fstat((*a)->fd(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBytes);
    // A second owner is refused while the first holds the object, and removes nothing.
    absl::StatusOr<std::unique_ptr<ShmObject>> b = ShmObject::Open(name, kBytes);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(ShmExists(name));
  }
  ASSERT_TRUE(ShmExists(name)) << "an object outlives its owner unless asked otherwise";
  {
    absl::StatusOr<std::unique_ptr<ShmObject>> again = ShmObject::Open(name, kBytes);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_FALSE((*again)->created());
    (*again)->UnlinkOnDestroy();
  }
  EXPECT_FALSE(ShmExists(name));
  EXPECT_EQ(ShmObject::Unlink(name).code(), absl::StatusCode::kNotFound);
}

TEST(ShmObjectTest, AFailedCreateLeavesNothingBehind) {
  const std::string name = ShmName("toolarge");
  // More than any /dev/shm holds: refused after the object was created, which removes it.
  absl::StatusOr<std::unique_ptr<ShmObject>> a = ShmObject::Open(name, uint64_t{1} << 60);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a.status().message(), HasSubstr("/dev/shm has"));
  EXPECT_FALSE(ShmExists(name));
}

}  // namespace
}  // namespace kvcellar::platform
