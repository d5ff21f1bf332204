#include "storage/file_startup_scan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::TestKey;
using testing::TestNamespace;

constexpr char kHost[] = "scanhost";

// A pid that was just used and is no longer (a reaped child).
pid_t DeadPid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

class FileStartupScanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_fd_ = ::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(root_fd_, 0);
  }
  void TearDown() override {
    if (root_fd_ >= 0) ::close(root_fd_);
  }

  // Writes `bytes` bytes at the relative path, making its directories.
  std::string Write(const std::string& rel, size_t bytes) {
    const std::string path = dir_.path() + "/" + rel;
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path, std::ios::binary) << std::string(bytes, 'x');
    return path;
  }
  // Writes a whole object of key i at the name of key `name_key` (i when negative): header block
  // (version 2 with `parent`, or version 1), then the payload, then `extra` bytes.
  std::string WriteObject(uint64_t i, uint32_t shard, uint64_t ns = 0, size_t payload = 10,
                          ParentLink parent = ParentLink::First(), bool v1 = false,
                          int64_t name_key = -1, size_t extra = 0) {
    std::string bytes(kFileHeaderBlockBytes + payload + extra, '\0');
    auto* p = reinterpret_cast<uint8_t*>(bytes.data());
    testing::FillPayload(TestKey(i), shard, p + kFileHeaderBlockBytes, payload);
    const ObjectHeader h = MakeObjectHeader(TestNamespace(ns), TestKey(i), shard,
                                            p + kFileHeaderBlockBytes, payload, 1, parent);
    if (v1) {
      EncodeObjectHeaderV1(h, p);
    } else {
      EncodeObjectHeader(h, p);
    }
    const std::string path =
        dir_.path() + "/" + ObjectRel(name_key < 0 ? i : static_cast<uint64_t>(name_key), shard, ns);
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  std::string ObjectRel(uint64_t i, uint32_t shard, uint64_t ns = 0) {
    char buf[kMaxRelPath];
    FormatObjectPath(NamespacePrefix(TestNamespace(ns)), TestKey(i), shard, buf);
    return buf;
  }
  std::string TempRel(uint64_t i, const std::string& host, pid_t pid) {
    char buf[kMaxRelPath];
    FormatTempPath(ObjectRel(i, 0).c_str(), host, pid, 1, buf);
    return buf;
  }
  static void SetMtime(const std::string& path, absl::Time t) {
    timespec ts[2];
    ts[0] = ts[1] = absl::ToTimespec(t);
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, 0), 0);
  }
  FileStartupScan Scan() {
    return FileStartupScan(root_fd_, kHost, ::getpid(), absl::Hours(1), &stop_);
  }

  TempDir dir_;
  int root_fd_ = -1;
  std::atomic<bool> stop_{false};
};

TEST_F(FileStartupScanTest, FindsObjectsNewestFirstWithTheirFootprint) {
  const absl::Time now = absl::Now();
  SetMtime(WriteObject(1, 0, 0, 10), now - absl::Seconds(30));
  SetMtime(WriteObject(2, 3, /*ns=*/1, 8192), now - absl::Seconds(10));
  SetMtime(WriteObject(3, 0, 0, 0), now - absl::Seconds(20));
  FileStartupScan scan = Scan();
  ASSERT_TRUE(scan.ScanUntil(absl::InfiniteFuture()));
  const std::vector<FileStartupScan::Found> found = scan.TakeFoundNewestFirst();
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(found[0].id, (FileObjectId{NamespacePrefix(TestNamespace(1)), TestKey(2), 3}));
  EXPECT_EQ(found[0].bytes, 4096u + 8192);
  EXPECT_EQ(found[1].id.key, TestKey(3));
  EXPECT_EQ(found[1].bytes, 4096u);  // An empty payload: the header block alone.
  EXPECT_EQ(found[2].id.key, TestKey(1));
  EXPECT_EQ(found[2].bytes, 8192u);
  EXPECT_GT(found[0].mtime_ns, found[1].mtime_ns);
  EXPECT_TRUE(scan.TakeFoundNewestFirst().empty());  // Taken.
}

TEST_F(FileStartupScanTest, SkipsWhatIsNotOurs) {
  WriteObject(1, 0);
  const std::string leaf = ObjectRel(1, 0).substr(0, 19);
  Write(leaf + "/README", 10);
  Write(leaf + "/" + std::string(64, 'Z') + ".0", 10);  // Not lowercase hex.
  Write(leaf + "/" + TestKey(5).Hex() + ".x", 10);      // Not a shard.
  Write("notanamespace/ab/" + TestKey(6).Hex() + ".0", 10);
  Write(leaf.substr(0, 16) + "/zz/" + TestKey(7).Hex() + ".0", 10);
  fs::create_directories(dir_.path() + "/" + leaf + "/" + TestKey(8).Hex() + ".0");  // A directory.
  FileStartupScan scan = Scan();
  ASSERT_TRUE(scan.ScanUntil(absl::InfiniteFuture()));
  const auto found = scan.TakeFoundNewestFirst();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].id.key, TestKey(1));
}

TEST_F(FileStartupScanTest, RemovesOnlyTempsWhoseWriterIsGone) {
  const std::string dead = Write(TempRel(1, kHost, DeadPid()), 10);
  const std::string ours = Write(TempRel(2, kHost, ::getpid()), 10);
  const std::string alive = Write(TempRel(3, kHost, ::getppid()), 10);
  const std::string other_host = Write(TempRel(4, "otherhost", DeadPid()), 10);
  const std::string old = Write(TempRel(5, "otherhost", 1), 10);
  SetMtime(old, absl::Now() - absl::Hours(2));
  FileStartupScan scan = Scan();
  ASSERT_TRUE(scan.ScanUntil(absl::InfiniteFuture()));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(ours));        // Maybe still being written.
  EXPECT_TRUE(fs::exists(alive));       // Its writer runs.
  EXPECT_TRUE(fs::exists(other_host));  // Only age tells another node's writer is gone.
  EXPECT_FALSE(fs::exists(old));
  EXPECT_EQ(scan.temps_removed(), 2u);
  EXPECT_TRUE(scan.TakeFoundNewestFirst().empty());  // Temps are never objects.
}

TEST_F(FileStartupScanTest, ResumesWhereTheBudgetStoppedIt) {
  for (uint64_t i = 0; i < 20; ++i) WriteObject(i, 0);
  FileStartupScan scan = Scan();
  int rounds = 0;
  while (!scan.ScanUntil(absl::InfinitePast())) ++rounds;  // One leaf per call.
  EXPECT_GT(rounds, 1);
  EXPECT_EQ(scan.TakeFoundNewestFirst().size(), 20u);
  EXPECT_EQ(scan.entries_seen(), 20u);
}

TEST_F(FileStartupScanTest, ReadsEachHeadersParentLinkAndDropsTornOrForeignObjects) {
  const std::string first = WriteObject(1, 0, 0, 100, ParentLink::First());
  const std::string child = WriteObject(2, 0, 0, 100, ParentLink::Of(TestKey(1)));
  const std::string legacy = WriteObject(3, 0, 0, 100, {}, /*v1=*/true);
  // Torn: the file ends inside the payload (a crash after the rename, before the data landed).
  const std::string torn = WriteObject(4, 0, 0, 100);
  fs::resize_file(torn, kFileHeaderBlockBytes + 50);
  const std::string empty = Write(ObjectRel(5, 0), 0);
  const std::string junk = Write(ObjectRel(6, 0), 5000);  // No header at all.
  const std::string foreign = WriteObject(7, 0, 0, 100, ParentLink::First(), false, /*name=*/8);
  const std::string appended = WriteObject(9, 0, 0, 100, ParentLink::First(), false, -1, 7);
  const std::string damaged = WriteObject(10, 0, 0, 100);
  {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(110);  // Inside the parent key: only the header CRC tells.
    f.put('\x5a');
  }
  // A later format version (a newer daemon's object, after a downgrade or in a mixed fleet):
  // neither found nor removed.
  const std::string newer = WriteObject(11, 0, 0, 100);
  {
    std::fstream f(newer, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);  // The format version (u16 LE).
    f.put(static_cast<char>(kObjectFormatVersion + 1));
  }
  FileStartupScan scan = Scan();
  ASSERT_TRUE(scan.ScanUntil(absl::InfiniteFuture()));
  EXPECT_EQ(scan.objects_found(), 3u);
  EXPECT_EQ(scan.objects_legacy(), 1u);
  EXPECT_EQ(scan.objects_newer(), 1u);
  EXPECT_EQ(scan.objects_dropped(), 6u);
  EXPECT_EQ(scan.payload_bytes(), 300u);
  for (const std::string& gone : {torn, empty, junk, foreign, appended, damaged}) {
    EXPECT_FALSE(fs::exists(gone)) << gone;
  }
  for (const std::string& kept : {first, child, legacy, newer}) {
    EXPECT_TRUE(fs::exists(kept)) << kept;
  }
  ASSERT_EQ(scan.namespaces().size(), 1u);
  EXPECT_EQ(scan.namespaces()[0], TestNamespace(0));
  std::vector<FileStartupScan::Found> found = scan.TakeFoundNewestFirst();
  ASSERT_EQ(found.size(), 3u);
  absl::flat_hash_map<core::PageKey, FileStartupScan::Found> by_key;
  for (const auto& f : found) by_key[f.id.key] = f;
  EXPECT_EQ(by_key[TestKey(1)].parent, ParentLink::First());
  EXPECT_EQ(by_key[TestKey(2)].parent, ParentLink::Of(TestKey(1)));
  EXPECT_EQ(by_key[TestKey(3)].parent.kind, ParentLink::Kind::kUnknown);
  EXPECT_EQ(by_key[TestKey(3)].version, kObjectFormatVersionV1);
  EXPECT_EQ(by_key[TestKey(2)].payload_bytes, 100u);
  EXPECT_EQ(by_key[TestKey(2)].ns, 0u);
}

TEST_F(FileStartupScanTest, StopEndsIt) {
  Write(ObjectRel(1, 0), 10);
  FileStartupScan scan = Scan();
  stop_.store(true);
  EXPECT_FALSE(scan.ScanUntil(absl::InfiniteFuture()));
  EXPECT_TRUE(scan.TakeFoundNewestFirst().empty());
}

TEST_F(FileStartupScanTest, AnEmptyOrMissingTreeIsDone) {
  FileStartupScan scan = Scan();
  EXPECT_TRUE(scan.ScanUntil(absl::InfiniteFuture()));
  EXPECT_TRUE(scan.TakeFoundNewestFirst().empty());
}

TEST_F(FileStartupScanTest, StaleTempRules) {
  FileStartupScan scan = Scan();
  const int64_t now = absl::GetCurrentTimeNanos();
  const int64_t old = now - absl::ToInt64Nanoseconds(absl::Hours(2));
  EXPECT_TRUE(scan.IsStaleTemp("garbage", old));  // Age alone decides for anything.
  EXPECT_FALSE(scan.IsStaleTemp("garbage", now));
  EXPECT_FALSE(scan.IsStaleTemp(absl::StrCat("otherhost-", DeadPid(), "-1"), now));
  EXPECT_TRUE(scan.IsStaleTemp(absl::StrCat(kHost, "-", DeadPid(), "-1"), now));
  EXPECT_FALSE(scan.IsStaleTemp(absl::StrCat(kHost, "-", ::getpid(), "-1"), now));
}

}  // namespace
}  // namespace kvcellar::storage
