#include "storage/file_modes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::ScopedUmask;
using testing::TempDir;

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(FileModesTest, UsualUmasksNeedNoChmod) {
  EXPECT_FALSE(FileModes::ForUmask(022).chmod_after_create());
  EXPECT_FALSE(FileModes::ForUmask(027).chmod_after_create());
  EXPECT_FALSE(FileModes::ForUmask(077).chmod_after_create());
  EXPECT_TRUE(FileModes::ForUmask(0277).chmod_after_create());  // Takes the owner's write bit.
  EXPECT_TRUE(FileModes::ForUmask(std::nullopt).chmod_after_create());
}

TEST(FileModesTest, ReadsTheUmaskWithoutChangingIt) {
  ScopedUmask mask(023);
  EXPECT_EQ(ReadProcessUmask(), std::optional<mode_t>(023));
  EXPECT_EQ(::umask(023), 023);  // Still what it was.
}

TEST(FileModesTest, DirectoriesAndObjectsAreOwnerOnlyWhateverTheUmask) {
  TempDir dir;
  for (mode_t m : {mode_t{0}, mode_t{022}, mode_t{0377}}) {
    ScopedUmask mask(m);
    const FileModes modes = FileModes::ForProcessUmask();
    const std::string d = dir.path() + "/d" + std::to_string(m);
    ASSERT_EQ(modes.MakeDir(AT_FDCWD, d.c_str()), 0);
    EXPECT_EQ(ModeOf(d), FileModes::kDirMode) << std::oct << m;
    EXPECT_EQ(modes.MakeDir(AT_FDCWD, d.c_str()), -1);
    EXPECT_EQ(errno, EEXIST);

    const std::string f = d + "/object";
    const int fd =
        ::open(f.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, FileModes::kObjectMode);
    ASSERT_GE(fd, 0);
    modes.FixObject(fd);
    ::close(fd);
    EXPECT_EQ(ModeOf(f), FileModes::kObjectMode) << std::oct << m;
  }
}

}  // namespace
}  // namespace kvcellar::storage
