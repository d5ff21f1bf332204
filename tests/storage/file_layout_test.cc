#include "storage/file_layout.h"

#include <string>

#include "gtest/gtest.h"
#include "storage/file_backend.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::TestKey;
using testing::TestNamespace;

std::string ObjectPathOf(const core::PageKey& ns, const core::PageKey& key, uint32_t shard) {
  char buf[kMaxRelPath];
  FormatObjectPath(NamespacePrefix(ns), key, shard, buf);
  return buf;
}

TEST(FileLayoutTest, ObjectPathIsNamespaceLeafKeyShard) {
  const core::PageKey ns = TestNamespace();
  const core::PageKey key = TestKey(7);
  const std::string path = ObjectPathOf(ns, key, 12);
  const std::string hex = key.Hex();
  EXPECT_EQ(path, ns.Hex().substr(0, 16) + "/" + hex.substr(0, 2) + "/" + hex + ".12");
  EXPECT_EQ(path, FileBackend::ObjectPath(ns, key, 12));

  char dir[kMaxRelPath];
  char* end = FormatLeafDir(NamespacePrefix(ns), key, dir);
  EXPECT_EQ(std::string(dir, end), path.substr(0, 19));
  EXPECT_EQ(*end, '\0');
}

TEST(FileLayoutTest, LongestPathsFit) {
  const std::string path = ObjectPathOf(TestNamespace(), TestKey(1), UINT32_MAX);
  EXPECT_EQ(path.size(), 16u + 1 + 2 + 1 + 64 + 1 + 10);
  char tmp[kMaxRelPath];
  FormatTempPath(path.c_str(), std::string(kMaxHostChars, 'h'), 2147483647, UINT64_MAX, tmp);
  EXPECT_LT(std::string(tmp).size(), kMaxRelPath);
  EXPECT_EQ(std::string(tmp).substr(0, path.size()), path);
}

TEST(FileLayoutTest, TempNamesReadBackTheirWriter) {
  const std::string path = ObjectPathOf(TestNamespace(), TestKey(2), 0);
  char tmp[kMaxRelPath];
  FormatTempPath(path.c_str(), "node-a.example", 4321, 99, tmp);
  const std::string name = std::string(tmp).substr(20);  // The leaf entry.
  EXPECT_TRUE(MayBeObjectFile(name));
  absl::string_view suffix;
  ASSERT_TRUE(TempSuffix(name, &suffix));
  EXPECT_EQ(suffix, "node-a.example-4321-99");
  absl::string_view host;
  uint32_t pid = 0;
  ASSERT_TRUE(ParseTempWriter(suffix, &host, &pid));
  EXPECT_EQ(host, "node-a.example");  // A host with dashes: the last two dashes split.
  EXPECT_EQ(pid, 4321u);

  EXPECT_FALSE(TempSuffix(path.substr(20), &suffix));  // An object is not a temp.
  EXPECT_FALSE(ParseTempWriter("nodashes", &host, &pid));
  EXPECT_FALSE(ParseTempWriter("-12", &host, &pid));
  EXPECT_FALSE(ParseTempWriter("host-x-1", &host, &pid));  // The pid is not a number.
}

TEST(FileLayoutTest, TempHostIdHasNoSlashOrNulAndIsBounded) {
  EXPECT_EQ(TempHostId("a/b"), "a_b");
  EXPECT_EQ(TempHostId(absl::string_view("a\0b", 3)), "a_b");
  EXPECT_EQ(TempHostId(std::string(100, 'x')).size(), kMaxHostChars);
}

TEST(FileLayoutTest, ScanNamesParseBack) {
  const core::PageKey ns = TestNamespace(3);
  const core::PageKey key = TestKey(9);
  const std::string path = ObjectPathOf(ns, key, 5);
  uint64_t prefix = 0;
  ASSERT_TRUE(ParseNamespaceDir(path.substr(0, 16), &prefix));
  EXPECT_EQ(prefix, NamespacePrefix(ns));
  EXPECT_FALSE(ParseNamespaceDir(path.substr(0, 15), &prefix));
  EXPECT_FALSE(ParseNamespaceDir("lost+found", &prefix));
  EXPECT_TRUE(IsLeafDir(path.substr(17, 2)));
  EXPECT_FALSE(IsLeafDir("AB"));
  EXPECT_FALSE(IsLeafDir("abc"));

  const std::string entry = path.substr(20);
  ASSERT_TRUE(MayBeObjectFile(entry));
  core::PageKey back;
  uint32_t shard = 0;
  ASSERT_TRUE(ParseObjectFile(entry, &back, &shard));
  EXPECT_EQ(back, key);
  EXPECT_EQ(shard, 5u);
  EXPECT_FALSE(MayBeObjectFile("short.0"));
  EXPECT_FALSE(ParseObjectFile(entry.substr(0, 65) + "x", &back, &shard));
}

TEST(FileLayoutTest, FootprintIsTheHeaderBlockPlusWholeBlocks) {
  EXPECT_EQ(FileFootprint(0), 4096u);
  EXPECT_EQ(FileFootprint(1), 8192u);
  EXPECT_EQ(FileFootprint(4096), 8192u);
  EXPECT_EQ(FileFootprint(4097), 12288u);
  EXPECT_EQ(RoundUpToBlock(0), 0u);
  EXPECT_EQ(RoundUpToBlock(4096 + 10), 8192u);
}

}  // namespace
}  // namespace kvcellar::storage
