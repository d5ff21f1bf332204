#include "storage/file_backend.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "platform/log.h"
#include "storage/file_layout.h"
#include "storage/object_format.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

namespace fs = std::filesystem;
using testing::AlignedBuffer;
using testing::FillPayload;
using testing::GetOne;
using testing::PutOne;
using testing::ScopedUmask;
using testing::TempDir;
using testing::TestKey;
using testing::TestNamespace;

constexpr uint64_t kBlock = kFileHeaderBlockBytes;

std::vector<std::string> FilesUnder(const std::string& root, const std::string& contains = "") {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); it != fs::end(it); ++it) {
    if (!it->is_regular_file()) continue;
    std::string p = it->path().string();
    if (contains.empty() || p.find(contains) != std::string::npos) out.push_back(p);
  }
  return out;
}

// Every test runs on both engines: io_uring and the thread-pool fallback.
class FileBackendTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  FileBackendOptions Options() const {
    FileBackendOptions o;
    o.root = dir_.path() + "/l3";
    o.io.kind = GetParam();
    o.io.pool_threads = 4;
    o.startup_scan_budget = absl::Seconds(5);
    return o;
  }
  std::unique_ptr<FileBackend> Open(const FileBackendOptions& o) {
    absl::StatusOr<std::unique_ptr<FileBackend>> b = FileBackend::Open(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }
  std::string PathOf(const core::PageKey& key, uint32_t shard) const {
    return dir_.path() + "/l3/" + FileBackend::ObjectPath(ns_, key, shard);
  }

  TempDir dir_;
  core::PageKey ns_ = TestNamespace();
};

TEST_P(FileBackendTest, EngineIsTheOneAskedFor) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->io_engine_name(),
            GetParam() == IoEngineKind::kThreadPool ? "thread_pool" : "io_uring");
}

TEST_P(FileBackendTest, PutGetRoundTripIsByteExact) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  // Aligned sizes take O_DIRECT; odd sizes and offsets take buffered I/O.
  const std::vector<size_t> sizes = {4096, 256 * 1024, 1 << 20, 10000, 1};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const core::PageKey key = TestKey(i);
    ASSERT_EQ(PutOne(*b, ns_, key, 0, sizes[i]), ObjectStatus::kOk) << sizes[i];
    struct stat st;
    ASSERT_EQ(::stat(PathOf(key, 0).c_str(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBlock + sizes[i]);
    // Into a slot larger than the object (a host pool size class), and into an exact one.
    EXPECT_EQ(GetOne(*b, ns_, key, 0, (sizes[i] + 4095) / 4096 * 4096 + 8192, sizes[i]),
              ObjectStatus::kOk);
    EXPECT_EQ(GetOne(*b, ns_, key, 0, sizes[i], sizes[i]), ObjectStatus::kOk);
  }
  // Unaligned host buffers.
  std::vector<uint8_t> src(5000 + 3), dst(5000 + 3);
  FillPayload(TestKey(99), 2, src.data() + 3, 5000);
  PutItem put{TestKey(99), 2, src.data() + 3, 5000, {}};
  BatchResult pr = testing::PutSync(*b, {ns_, absl::MakeConstSpan(&put, 1)});
  ASSERT_EQ(pr.items[0].status, ObjectStatus::kOk);
  GetItem get{TestKey(99), 2, dst.data() + 3, 5000};
  BatchResult gr = testing::GetSync(*b, {ns_, absl::MakeConstSpan(&get, 1)});
  ASSERT_EQ(gr.items[0].status, ObjectStatus::kOk);
  EXPECT_EQ(gr.items[0].bytes, 5000u);
  EXPECT_TRUE(testing::PayloadMatches(TestKey(99), 2, dst.data() + 3, 5000));

  BackendStats s = b->Stats();
  EXPECT_EQ(s.op(OpKind::kPut).by_status[0], sizes.size() + 1);
  EXPECT_GT(s.op(OpKind::kGet).bytes, 0u);
  EXPECT_EQ(s.corrupt_removed, 0u);
}

TEST_P(FileBackendTest, BatchOfManyShardsAndMisses) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  constexpr int kN = 40;
  constexpr size_t kSize = 64 * 1024;
  std::vector<AlignedBuffer> bufs;
  std::vector<PutItem> puts;
  for (int i = 0; i < kN; ++i) {
    bufs.emplace_back(kSize);
    FillPayload(TestKey(i / 4), i % 4, bufs.back().get(), kSize);
  }
  for (int i = 0; i < kN; ++i) puts.push_back({TestKey(i / 4), uint32_t(i % 4), bufs[i].get(), kSize, {}});
  BatchResult pr = testing::PutSync(*b, {ns_, puts});
  ASSERT_EQ(pr.items.size(), size_t{kN});
  for (const ItemResult& r : pr.items) ASSERT_EQ(r.status, ObjectStatus::kOk);

  std::vector<AlignedBuffer> out;
  std::vector<GetItem> gets;
  for (int i = 0; i < kN + 5; ++i) out.emplace_back(kSize);
  for (int i = 0; i < kN + 5; ++i) {
    // The last five name objects that were never written.
    gets.push_back({TestKey(i / 4), uint32_t(i < kN ? i % 4 : 9), out[i].get(), kSize});
  }
  BatchResult gr = testing::GetSync(*b, {ns_, gets});
  ASSERT_EQ(gr.items.size(), size_t{kN + 5});
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(gr.items[i].status, ObjectStatus::kOk) << i;
    EXPECT_TRUE(testing::PayloadMatches(TestKey(i / 4), i % 4, out[i].get(), kSize)) << i;
  }
  for (int i = kN; i < kN + 5; ++i) EXPECT_EQ(gr.items[i].status, ObjectStatus::kNotFound);
}

TEST_P(FileBackendTest, ExistsIsTheLongestPresentPrefix) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  const std::vector<uint32_t> shards = {0, 1};
  std::vector<core::PageKey> keys;
  for (int i = 0; i < 10; ++i) keys.push_back(TestKey(100 + i));
  for (int i = 0; i < 10; ++i) {
    for (uint32_t s : shards) {
      if (i == 5 && s == 1) continue;  // Page 5 misses one shard: not a hit.
      ASSERT_EQ(PutOne(*b, ns_, keys[i], s, 8192), ObjectStatus::kOk);
    }
  }
  ExistsResult r = testing::ExistsSync(*b, {ns_, keys, shards});
  EXPECT_EQ(r.present_prefix, 5u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);
  const std::vector<uint32_t> shard0 = {0};
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, keys, shard0}).present_prefix, 10u);
  EXPECT_EQ(testing::ExistsSync(*b, {TestNamespace(7), keys, shard0}).present_prefix, 0u);
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, {}, shard0}).present_prefix, 0u);

  // A fresh daemon answers the same while its index is still being rebuilt (stat fallback) and
  // after (index).
  b.reset();
  FileBackendOptions o = Options();
  o.startup_scan_budget = absl::ZeroDuration();
  b = Open(o);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, keys, shards}).present_prefix, 5u);
  ASSERT_TRUE(b->WaitForIndex(absl::Seconds(10)));
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, keys, shards}).present_prefix, 5u);
  EXPECT_EQ(b->Stats().indexed_objects, 19u);
}

TEST_P(FileBackendTest, Delete) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  const core::PageKey key = TestKey(5);
  ASSERT_EQ(PutOne(*b, ns_, key, 0, 4096), ObjectStatus::kOk);
  ObjectRef ref{key, 0};
  EXPECT_EQ(testing::DeleteSync(*b, {ns_, absl::MakeConstSpan(&ref, 1)}).items[0].status,
            ObjectStatus::kOk);
  EXPECT_FALSE(fs::exists(PathOf(key, 0)));
  EXPECT_EQ(GetOne(*b, ns_, key, 0, 4096), ObjectStatus::kNotFound);
  EXPECT_EQ(testing::DeleteSync(*b, {ns_, absl::MakeConstSpan(&ref, 1)}).items[0].status,
            ObjectStatus::kNotFound);
  EXPECT_EQ(b->Stats().indexed_objects, 0u);
  EXPECT_EQ(b->Stats().used_bytes, 0u);
}

TEST_P(FileBackendTest, CapacityEvictsColdestFirst) {
  FileBackendOptions o = Options();
  constexpr size_t kSize = 16 * 1024;
  const uint64_t footprint = kBlock + kSize;
  o.capacity_bytes = 10 * footprint;
  auto b = Open(o);
  ASSERT_NE(b, nullptr);
  // Every eviction is told to the removal sink (the daemon's index), at once.
  absl::Mutex mu;
  std::vector<FileObjectId> removed;
  b->SetRemovalSink([&](absl::Span<const FileObjectId> ids) {
    absl::MutexLock lock(&mu);
    removed.insert(removed.end(), ids.begin(), ids.end());
  });
  for (int i = 0; i < 10; ++i) ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
  // A read makes object 0 hot: it survives the next five writes, 1..5 do not.
  ASSERT_EQ(GetOne(*b, ns_, TestKey(0), 0, kSize), ObjectStatus::kOk);
  for (int i = 10; i < 15; ++i) {
    ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
  }
  BackendStats s = b->Stats();
  EXPECT_LE(s.used_bytes, o.capacity_bytes);
  EXPECT_EQ(s.evicted_objects, 5u);
  EXPECT_EQ(s.indexed_objects, 10u);
  EXPECT_EQ(GetOne(*b, ns_, TestKey(0), 0, kSize), ObjectStatus::kOk);
  for (int i = 1; i <= 5; ++i) EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kNotFound) << i;
  for (int i = 6; i < 15; ++i) EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk) << i;
  {
    absl::MutexLock lock(&mu);
    std::vector<FileObjectId> want;
    for (int i = 1; i <= 5; ++i) want.push_back({NamespacePrefix(ns_), TestKey(i), 0});
    EXPECT_EQ(removed, want);
  }
  b->SetRemovalSink(nullptr);
  // The evicted files are gone from disk (unlinks are asynchronous: settle first).
  b.reset();
  EXPECT_EQ(FilesUnder(o.root).size(), 10u);
  // An object larger than the whole tier is rejected, and so is one past max_object_bytes.
  o.max_object_bytes = 64 * 1024;
  b = Open(o);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(PutOne(*b, ns_, TestKey(50), 0, 11 * footprint), ObjectStatus::kRejected);
  EXPECT_EQ(PutOne(*b, ns_, TestKey(51), 0, 64 * 1024 + 4096), ObjectStatus::kRejected);
  s = b->Stats();
  EXPECT_EQ(s.op(OpKind::kPut).by_status[size_t(ObjectStatus::kRejected)], 2u);
  // A refusal is an error to report, but the tier answered: it stays healthy.
  EXPECT_EQ(s.last_error, "put: rejected");
  EXPECT_GT(s.last_error_unix_ms, 0);
  EXPECT_TRUE(s.healthy);
}

TEST_P(FileBackendTest, RestartRebuildsIndexAndCapacityOrder) {
  FileBackendOptions o = Options();
  constexpr size_t kSize = 8192;
  const uint64_t footprint = kBlock + kSize;
  {
    auto b = Open(o);
    ASSERT_NE(b, nullptr);
    for (int i = 0; i < 12; ++i) {
      ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
      // Distinct mtimes: the order the restarted daemon evicts in.
      struct timespec ts[2] = {{0, UTIME_OMIT}, {1000000 + i, 0}};
      ASSERT_EQ(::utimensat(AT_FDCWD, PathOf(TestKey(i), 0).c_str(), ts, 0), 0);
    }
  }
  // Restart with room for 8: the 4 oldest by mtime go.
  o.capacity_bytes = 8 * footprint;
  o.startup_scan_budget = absl::ZeroDuration();
  auto b = Open(o);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->WaitForIndex(absl::Seconds(10)));
  BackendStats s = b->Stats();
  EXPECT_TRUE(s.index_complete);
  EXPECT_EQ(s.indexed_objects, 8u);
  EXPECT_EQ(s.used_bytes, 8 * footprint);
  EXPECT_EQ(s.evicted_objects, 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kNotFound);
  for (int i = 4; i < 12; ++i) EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
  // Once the index is complete (and the directory private), a miss is answered without I/O:
  // a file planted behind the daemon's back is not seen.
  fs::copy_file(PathOf(TestKey(4), 0), PathOf(TestKey(4), 1));
  EXPECT_EQ(GetOne(*b, ns_, TestKey(4), 1, kSize), ObjectStatus::kNotFound);
}

TEST_P(FileBackendTest, SharedDirectorySeesOtherNodesObjects) {
  FileBackendOptions o = Options();
  o.shared = true;
  o.host_id = "node-a";
  auto a = Open(o);
  o.host_id = "node-b";
  auto b = Open(o);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(a->capabilities().shared_across_nodes);
  ASSERT_EQ(PutOne(*a, ns_, TestKey(1), 0, 12288), ObjectStatus::kOk);
  const core::PageKey key = TestKey(1);
  const uint32_t shard0 = 0;
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, absl::MakeConstSpan(&key, 1),
                                     absl::MakeConstSpan(&shard0, 1)})
                .present_prefix,
            1u);
  EXPECT_EQ(GetOne(*b, ns_, TestKey(1), 0, 12288, 12288), ObjectStatus::kOk);
}

// ---- Corrupt, torn and foreign objects ---------------------------------------------------------

class FileBackendCorruptionTest : public FileBackendTest {
 protected:
  void SetUp() override {
    b_ = Open(Options());
    ASSERT_NE(b_, nullptr);
    WatchRemovals();
    ASSERT_EQ(PutOne(*b_, ns_, TestKey(1), 0, kSize), ObjectStatus::kOk);
    ASSERT_EQ(PutOne(*b_, ns_, TestKey(2), 0, kSize), ObjectStatus::kOk);
  }
  // What b_ tells its removal sink (the daemon's index) lands in removed_.
  void WatchRemovals() {
    b_->SetRemovalSink([this](absl::Span<const FileObjectId> ids) {
      absl::MutexLock lock(&mu_);
      removed_.insert(removed_.end(), ids.begin(), ids.end());
    });
  }
  void FlipByte(const std::string& path, off_t offset) {
    int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t c;
    ASSERT_EQ(::pread(fd, &c, 1, offset), 1);
    c ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &c, 1, offset), 1);
    ::close(fd);
  }
  // kChecksumError once, the file removed, counted; then a plain miss.
  void ExpectCaught(const core::PageKey& ns, const core::PageKey& key, uint32_t shard,
                    size_t capacity = kSize) {
    const std::string path = dir_.path() + "/l3/" + FileBackend::ObjectPath(ns, key, shard);
    const uint64_t before = b_->Stats().corrupt_removed;
    EXPECT_EQ(GetOne(*b_, ns, key, shard, capacity), ObjectStatus::kChecksumError);
    EXPECT_FALSE(fs::exists(path));
    {
      absl::MutexLock lock(&mu_);  // Told to the removal sink (the daemon's index).
      ASSERT_FALSE(removed_.empty());
      EXPECT_EQ(removed_.back(), (FileObjectId{NamespacePrefix(ns), key, shard}));
    }
    BackendStats s = b_->Stats();
    EXPECT_EQ(s.corrupt_removed, before + 1);
    EXPECT_GE(s.op(OpKind::kGet).by_status[size_t(ObjectStatus::kChecksumError)], 1u);
    EXPECT_EQ(s.last_error, "get: checksum_error");
    EXPECT_TRUE(s.healthy);
    EXPECT_EQ(GetOne(*b_, ns, key, shard, capacity), ObjectStatus::kNotFound);
  }

  static constexpr size_t kSize = 64 * 1024;
  absl::Mutex mu_;
  std::vector<FileObjectId> removed_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<FileBackend> b_;
};

// An object of a later format (a newer daemon's, in a shared tier or after a downgrade) is a miss
// for this build, and stays for the daemons that read it: neither removed nor told to the index
// as gone.
TEST_P(FileBackendCorruptionTest, ANewerFormatsObjectIsAMissAndStays) {
  const std::string path = dir_.path() + "/l3/" + FileBackend::ObjectPath(ns_, TestKey(1), 0);
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const uint8_t version = kObjectFormatVersion + 1;  // The format version (u16 LE) at 8.
    ASSERT_EQ(::pwrite(fd, &version, 1, 8), 1);
    ::close(fd);
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(GetOne(*b_, ns_, TestKey(1), 0, kSize), ObjectStatus::kNotFound);
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_EQ(b_->Stats().corrupt_removed, 0u);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(2), 0, kSize), ObjectStatus::kOk);
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(removed_.empty());
}

TEST_P(FileBackendCorruptionTest, FlippedPayloadByte) {
  FlipByte(PathOf(TestKey(1), 0), kBlock + 12345);
  ExpectCaught(ns_, TestKey(1), 0);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(2), 0, kSize), ObjectStatus::kOk);  // Neighbor untouched.
}

TEST_P(FileBackendCorruptionTest, FlippedHeaderByte) {
  FlipByte(PathOf(TestKey(1), 0), 90);  // Payload size field.
  ExpectCaught(ns_, TestKey(1), 0);
}

TEST_P(FileBackendCorruptionTest, TruncatedFile) {
  ASSERT_EQ(::truncate(PathOf(TestKey(1), 0).c_str(), kBlock + kSize / 2), 0);
  ExpectCaught(ns_, TestKey(1), 0);
  // Torn inside the header block, and empty.
  ASSERT_EQ(::truncate(PathOf(TestKey(2), 0).c_str(), 100), 0);
  ExpectCaught(ns_, TestKey(2), 0);
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(3), 0, kSize), ObjectStatus::kOk);
  ASSERT_EQ(::truncate(PathOf(TestKey(3), 0).c_str(), 0), 0);
  ExpectCaught(ns_, TestKey(3), 0);
}

TEST_P(FileBackendCorruptionTest, TrailingGarbage) {
  std::ofstream(PathOf(TestKey(1), 0), std::ios::app) << "junk";
  std::ofstream(PathOf(TestKey(2), 0), std::ios::app) << "junk";
  // A slot with room past the object sees the extra bytes in the slot: size mismatch.
  ExpectCaught(ns_, TestKey(1), 0, 2 * kSize);
  // An exact slot (the usual case: the namespace fixes the object size) sees them too, through
  // the read's probe past the slot; the intact payload in front of them is not served.
  ExpectCaught(ns_, TestKey(2), 0, kSize);
}

TEST_P(FileBackendCorruptionTest, TrailingBytesAfterAnExactSlotObject) {
  // One byte, and a whole block, appended to objects that fill the reader's slot exactly.
  std::ofstream(PathOf(TestKey(1), 0), std::ios::app) << 'x';
  std::ofstream(PathOf(TestKey(2), 0), std::ios::app) << std::string(kBlock, '\0');
  ExpectCaught(ns_, TestKey(1), 0, kSize);
  ExpectCaught(ns_, TestKey(2), 0, kSize);
  // An intact object of the same size still reads whole: the probe finds nothing past it.
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(3), 0, kSize), ObjectStatus::kOk);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(3), 0, kSize, kSize), ObjectStatus::kOk);
  EXPECT_EQ(b_->Stats().corrupt_removed, 2u);
}

TEST_P(FileBackendCorruptionTest, ForeignKeyShardAndNamespace) {
  // Another object's bytes under this name.
  fs::copy_file(PathOf(TestKey(2), 0), PathOf(TestKey(1), 0), fs::copy_options::overwrite_existing);
  ExpectCaught(ns_, TestKey(1), 0);
  // Shard 0's bytes as shard 1, planted behind the daemon's back: the restart's scan reads its
  // header, drops it and counts it; it is never indexed nor served.
  fs::copy_file(PathOf(TestKey(2), 0), PathOf(TestKey(2), 1));
  b_.reset();
  b_ = Open(Options());
  ASSERT_NE(b_, nullptr);
  WatchRemovals();
  ASSERT_TRUE(b_->WaitForIndex(absl::Seconds(10)));
  uint64_t dropped = 0;
  absl::Notification scanned;
  b_->SetScanSink([&](FileScanResult r) {
    dropped = r.dropped;
    scanned.Notify();
  });
  ASSERT_TRUE(scanned.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(dropped, 1u);
  EXPECT_FALSE(fs::exists(PathOf(TestKey(2), 1)));
  EXPECT_EQ(testing::GetOne(*b_, ns_, TestKey(2), 1, kSize), ObjectStatus::kNotFound);
  // A namespace whose digest shares the 8-byte directory prefix: same path, other owner.
  core::PageKey twin = ns_;
  twin.bytes[31] ^= 0xff;
  ASSERT_EQ(FileBackend::ObjectPath(twin, TestKey(2), 0), FileBackend::ObjectPath(ns_, TestKey(2), 0));
  ExpectCaught(twin, TestKey(2), 0);
}

TEST_P(FileBackendCorruptionTest, ObjectLargerThanTheSlot) {
  // The namespace fixes the object size; a larger stored object is foreign.
  ExpectCaught(ns_, TestKey(1), 0, kSize / 2);
}

TEST_P(FileBackendCorruptionTest, NotAnObjectAtAll) {
  std::ofstream(PathOf(TestKey(1), 0), std::ios::trunc) << std::string(kBlock + kSize, 'x');
  ExpectCaught(ns_, TestKey(1), 0);
}

// ---- Permissions -----------------------------------------------------------------------------

TEST_P(FileBackendTest, CreatedTreeIsOwnerOnlyWhateverTheUmask) {
  // 022: the usual umask, which left objects 0644 and directories 0755. 0: no help from the
  // umask at all. 0277: one that takes the owner's write bit, which a chmod must restore.
  for (mode_t mask : {mode_t{022}, mode_t{0}, mode_t{0277}}) {
    SCOPED_TRACE(absl::StrCat("umask 0", absl::Hex(mask)));
    const std::string top = absl::StrCat(dir_.path(), "/umask", mask);
    {
      ScopedUmask scoped(mask);
      FileBackendOptions o = Options();
      o.root = top + "/parent/l3";  // Parents the tier creates too.
      std::unique_ptr<FileBackend> b = Open(o);
      ASSERT_NE(b, nullptr);
      for (int i = 0; i < 6; ++i) {
        ASSERT_EQ(PutOne(*b, ns_, TestKey(i), i % 2, 3 * kBlock), ObjectStatus::kOk);
      }
      // Another namespace, and an unaligned object (buffered I/O).
      ASSERT_EQ(PutOne(*b, TestNamespace(1), TestKey(0), 0, 1000), ObjectStatus::kOk);
      EXPECT_EQ(GetOne(*b, ns_, TestKey(1), 1, 3 * kBlock, 3 * kBlock), ObjectStatus::kOk);
    }
    size_t dirs = 0, files = 0;
    struct stat st;
    ASSERT_EQ(::stat(top.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u) << top;
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(top)) {
      ASSERT_EQ(::lstat(e.path().c_str(), &st), 0) << e.path();
      if (S_ISDIR(st.st_mode)) {
        EXPECT_EQ(st.st_mode & 07777, 0700u) << e.path();
        ++dirs;
      } else {
        EXPECT_TRUE(S_ISREG(st.st_mode)) << e.path();
        EXPECT_EQ(st.st_mode & 07777, 0600u) << e.path();
        ++files;
      }
    }
    // parent, l3, two namespaces with their leaves.
    EXPECT_GE(dirs, 2u + 2u + 2u);
    EXPECT_EQ(files, 7u);
  }
}

// ---- Concurrency, deadlines, API contract ------------------------------------------------------

TEST_P(FileBackendTest, ConcurrentBatchesFromManyThreads) {
  FileBackendOptions o = Options();
  o.max_inflight_objects = 8;  // Forces queueing.
  auto b = Open(o);
  ASSERT_NE(b, nullptr);
  constexpr int kThreads = 4, kRounds = 15, kPerBatch = 6;
  constexpr size_t kSize = 32 * 1024;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<AlignedBuffer> bufs;
      for (int i = 0; i < kPerBatch; ++i) bufs.emplace_back(kSize);
      for (int round = 0; round < kRounds; ++round) {
        // Keys overlap across threads: concurrent writers of one object.
        std::vector<PutItem> puts;
        for (int i = 0; i < kPerBatch; ++i) {
          core::PageKey key = TestKey(rng() % 20);
          FillPayload(key, 0, bufs[i].get(), kSize);
          puts.push_back({key, 0, bufs[i].get(), kSize, {}});
        }
        BatchResult pr = testing::PutSync(*b, {ns_, puts});
        for (const ItemResult& r : pr.items) failures += r.status != ObjectStatus::kOk;
        std::vector<GetItem> gets;
        for (int i = 0; i < kPerBatch; ++i) {
          std::memset(bufs[i].get(), 0, kSize);
          gets.push_back({puts[i].key, 0, bufs[i].get(), kSize});
        }
        BatchResult gr = testing::GetSync(*b, {ns_, gets});
        for (int i = 0; i < kPerBatch; ++i) {
          // Another thread may be replacing it right now: the rename makes that invisible.
          failures += gr.items[i].status != ObjectStatus::kOk;
          failures += !testing::PayloadMatches(gets[i].key, 0, bufs[i].get(), kSize);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(b->Stats().corrupt_removed, 0u);
  EXPECT_TRUE(FilesUnder(o.root, ".tmp-").empty());
}

TEST_P(FileBackendTest, CallbackNeverRunsInsideTheSubmittingCall) {
  auto b = Open(Options());
  ASSERT_NE(b, nullptr);
  // An empty batch and an all-miss batch complete without I/O: still not inline.
  for (int n : {0, 3}) {
    std::vector<AlignedBuffer> bufs;
    std::vector<GetItem> gets;
    for (int i = 0; i < n; ++i) bufs.emplace_back(4096);
    for (int i = 0; i < n; ++i) gets.push_back({TestKey(1000 + i), 0, bufs[i].get(), 4096});
    const std::thread::id submitter = std::this_thread::get_id();
    std::atomic<bool> ran_inline{false};
    absl::Notification done;
    ASSERT_TRUE(b->Get({ns_, gets},
                       [&](BatchResult r) {
                         ran_inline = std::this_thread::get_id() == submitter;
                         EXPECT_EQ(r.items.size(), size_t(n));
                         done.Notify();
                       })
                    .ok());
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_FALSE(ran_inline.load());
  }
}

TEST_P(FileBackendTest, BadRequestsAreRefusedWholeAndNeverCalledBack) {
  FileBackendOptions o = Options();
  o.max_batch_items = 4;
  auto b = Open(o);
  ASSERT_NE(b, nullptr);
  bool called = false;
  GetItem bad{TestKey(1), 0, nullptr, 4096};
  absl::Status s = b->Get({ns_, absl::MakeConstSpan(&bad, 1)}, [&](BatchResult) { called = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[0]"), std::string::npos) << s;
  AlignedBuffer buf(4096);
  std::vector<GetItem> many(5, GetItem{TestKey(1), 0, buf.get(), 4096});
  EXPECT_EQ(b->Get({ns_, many}, [&](BatchResult) { called = true; }).code(),
            absl::StatusCode::kInvalidArgument);
  PutItem empty{TestKey(1), 0, buf.get(), 0, {}};
  EXPECT_EQ(b->Put({ns_, absl::MakeConstSpan(&empty, 1)}, [&](BatchResult) { called = true; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(called);
}

TEST_P(FileBackendTest, DeadlineFailsQueuedObjectsWithRetry) {
  FileBackendOptions o = Options();
  o.max_inflight_objects = 1;  // One object at a time: most of the batch waits in the queue.
  o.io.pool_threads = 1;
  auto b = Open(o);
  ASSERT_NE(b, nullptr);
  constexpr int kN = 300;
  constexpr size_t kSize = 64 * 1024;
  AlignedBuffer buf(kSize);
  std::vector<PutItem> puts;
  for (int i = 0; i < kN; ++i) puts.push_back({TestKey(i), 0, buf.get(), kSize, {}});
  PutRequest r{ns_, puts, absl::Milliseconds(5)};
  const absl::Time start = absl::Now();
  BatchResult res = testing::PutSync(*b, r);
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(res.items.size(), size_t{kN});
  int ok = 0, retry = 0;
  for (const ItemResult& i : res.items) {
    ok += i.status == ObjectStatus::kOk;
    retry += i.status == ObjectStatus::kRetry;
  }
  EXPECT_EQ(ok + retry, kN);
  EXPECT_GT(retry, 0);
  EXPECT_TRUE(res.deadline_exceeded);
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_EQ(b->Stats().op(OpKind::kPut).deadline_exceeded, 1u);
  // Nothing half-written is left behind; what succeeded reads back.
  b.reset();
  EXPECT_TRUE(FilesUnder(o.root, ".tmp-").empty());
  EXPECT_EQ(FilesUnder(o.root).size(), size_t(ok));
}

TEST_P(FileBackendTest, FsyncPolicies) {
  for (FsyncPolicy p : {FsyncPolicy::kData, FsyncPolicy::kDataAndDirectory}) {
    FileBackendOptions o = Options();
    o.fsync = p;
    auto b = Open(o);
    ASSERT_NE(b, nullptr);
    const core::PageKey key = TestKey(static_cast<int>(p) + 40);
    ASSERT_EQ(PutOne(*b, ns_, key, 0, 16384), ObjectStatus::kOk);
    EXPECT_EQ(GetOne(*b, ns_, key, 0, 16384, 16384), ObjectStatus::kOk);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, FileBackendTest,
                         ::testing::Values(IoEngineKind::kUring, IoEngineKind::kThreadPool),
                         [](const auto& info) {
                           return info.param == IoEngineKind::kUring ? "IoUring" : "ThreadPool";
                         });
INSTANTIATE_TEST_SUITE_P(Engines, FileBackendCorruptionTest,
                         ::testing::Values(IoEngineKind::kUring, IoEngineKind::kThreadPool),
                         [](const auto& info) {
                           return info.param == IoEngineKind::kUring ? "IoUring" : "ThreadPool";
                         });

// ---- Environment -------------------------------------------------------------------------------

TEST(FileBackendEnvTest, RefusedIoUringFallsBackToThreadPoolAndLogsOnce) {
  TempDir dir;
  const std::string log_path = dir.path() + "/log";
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(log_fd, 0);
  platform::SetLogFd(log_fd);
  FileBackendOptions o;
  o.root = dir.path() + "/l3";
  o.io.kind = IoEngineKind::kAuto;
  o.io.fail_uring_init_with = EPERM;  // What a seccomp profile that blocks io_uring gives.
  absl::StatusOr<std::unique_ptr<FileBackend>> b = FileBackend::Open(o);
  platform::SetLogFd(2);
  ::close(log_fd);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->io_engine_name(), "thread_pool");
  const core::PageKey ns = TestNamespace();
  for (int i = 0; i < 5; ++i) {
    ASSERT_EQ(PutOne(**b, ns, TestKey(i), 0, 8192), ObjectStatus::kOk);
    EXPECT_EQ(GetOne(**b, ns, TestKey(i), 0, 8192, 8192), ObjectStatus::kOk);
  }
  std::ifstream in(log_path);
  std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t count = 0;
  for (size_t pos = 0; (pos = log.find("io_uring refused", pos)) != std::string::npos; ++pos) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << log;
  EXPECT_NE(log.find("Operation not permitted"), std::string::npos) << log;

  // kUring, by contrast, reports the refusal.
  o.io.kind = IoEngineKind::kUring;
  EXPECT_EQ(IoEngine::Create(o.io).status().code(), absl::StatusCode::kUnavailable);
}

TEST(FileBackendEnvTest, FileSystemWithoutODirectUsesBufferedIo) {
  if (!fs::exists("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  TempDir dir("/dev/shm");  // tmpfs refuses O_DIRECT with EINVAL.
  FileBackendOptions o;
  o.root = dir.path() + "/l3";
  absl::StatusOr<std::unique_ptr<FileBackend>> b = FileBackend::Open(o);
  ASSERT_TRUE(b.ok()) << b.status();
  const core::PageKey ns = TestNamespace();
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(PutOne(**b, ns, TestKey(i), 0, 65536), ObjectStatus::kOk);
    EXPECT_EQ(GetOne(**b, ns, TestKey(i), 0, 65536, 65536), ObjectStatus::kOk);
  }
}

TEST(FileBackendEnvTest, StartupRemovesOnlyStaleTempFiles) {
  TempDir dir;
  const core::PageKey ns = TestNamespace();
  const std::string root = dir.path() + "/l3";
  {
    FileBackendOptions o;
    o.root = root;
    o.host_id = "this-host";
    auto b = FileBackend::Open(o);
    ASSERT_TRUE(b.ok());
    ASSERT_EQ(PutOne(**b, ns, TestKey(1), 0, 4096), ObjectStatus::kOk);
  }
  const std::string obj = root + "/" + FileBackend::ObjectPath(ns, TestKey(1), 0);
  // A dead pid of this host: a child that has exited and been reaped.
  pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string dead_tmp = obj + ".tmp-this-host-" + std::to_string(dead) + "-7";
  const std::string live_tmp = obj + ".tmp-this-host-" + std::to_string(::getppid()) + "-8";
  const std::string other_fresh = obj + ".tmp-other-host-" + std::to_string(dead) + "-9";
  const std::string other_old = obj + ".tmp-other-host-12345-10";
  for (const std::string& p : {dead_tmp, live_tmp, other_fresh, other_old}) {
    std::ofstream(p) << "partial";
  }
  struct timespec old[2] = {{0, UTIME_OMIT}, {::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, other_old.c_str(), old, 0), 0);

  FileBackendOptions o;
  o.root = root;
  o.host_id = "this-host";
  o.stale_temp_age = absl::Hours(1);
  auto b = FileBackend::Open(o);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->WaitForIndex(absl::Seconds(10)));
  EXPECT_FALSE(fs::exists(dead_tmp));     // Our host, writer dead.
  EXPECT_TRUE(fs::exists(live_tmp));      // Our host, writer alive.
  EXPECT_TRUE(fs::exists(other_fresh));   // Another node, recent: may still be writing.
  EXPECT_FALSE(fs::exists(other_old));    // Another node, older than stale_temp_age.
  EXPECT_EQ((*b)->Stats().indexed_objects, 1u);  // Temps are never objects.
}

// ---- Crash test --------------------------------------------------------------------------------
//
// A child process (this test binary, re-executed with a filter and an environment variable)
// writes and deletes objects as fast as it can and is killed with SIGKILL at a random moment,
// several times. Then a fresh backend opens the directory: it must rebuild its index, remove the
// dead writers' temp files, and serve every object byte-exact or not at all.

constexpr char kCrashDirEnv[] = "KVCELLAR_CRASH_WRITER_DIR";
constexpr int kCrashKeys = 96;

size_t CrashObjectSize(int key) {
  // Aligned sizes (O_DIRECT) and odd ones (buffered), 4 KiB to 260 KiB.
  return key % 3 == 0 ? 4096 * (1 + key % 64) + 777 : 4096 * (1 + key % 64);
}

TEST(FileBackendCrashChild, Writer) {
  const char* dir = std::getenv(kCrashDirEnv);
  if (dir == nullptr) GTEST_SKIP() << "only runs as the crash test's child";
  FileBackendOptions o;
  o.root = dir;
  o.startup_scan_budget = absl::Seconds(5);
  o.fsync = std::getenv("KVCELLAR_CRASH_FSYNC") != nullptr ? FsyncPolicy::kData : FsyncPolicy::kNone;
  auto b = FileBackend::Open(o);
  ASSERT_TRUE(b.ok()) << b.status();
  const core::PageKey ns = TestNamespace();
  std::mt19937 rng(::getpid());
  std::vector<AlignedBuffer> bufs;
  for (int i = 0; i < 16; ++i) bufs.emplace_back(4096 * 65);
  std::fprintf(stdout, "writer ready\n");
  std::fflush(stdout);
  for (;;) {  // Until SIGKILL.
    std::vector<PutItem> puts;
    for (int i = 0; i < 16; ++i) {
      const int k = static_cast<int>(rng() % kCrashKeys);
      const size_t size = CrashObjectSize(k);
      FillPayload(TestKey(k), 0, bufs[i].get(), size);
      puts.push_back({TestKey(k), 0, bufs[i].get(), size, {}});
    }
    absl::StatusOr<BatchFuture> f = (*b)->PutAsync({ns, puts});
    ASSERT_TRUE(f.ok());
    f->Wait();
    ObjectRef del{TestKey(static_cast<int>(rng() % kCrashKeys)), 0};
    testing::DeleteSync(**b, {ns, absl::MakeConstSpan(&del, 1)});
  }
}

TEST(FileBackendCrashTest, SigkillDuringWritesNeverServesATornObject) {
  TempDir dir;
  const std::string root = dir.path() + "/l3";
  std::mt19937 rng(std::random_device{}());
  constexpr int kRounds = 5;
  for (int round = 0; round < kRounds; ++round) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::close(out[0]);
      ::setenv(kCrashDirEnv, root.c_str(), 1);
      if (round % 2 == 1) ::setenv("KVCELLAR_CRASH_FSYNC", "1", 1);
      const char* argv[] = {"/proc/self/exe", "--gtest_filter=FileBackendCrashChild.Writer",
                            nullptr};
      ::execv("/proc/self/exe", const_cast<char**>(argv));
      ::_exit(127);
    }
    ASSERT_GT(pid, 0);
    ::close(out[1]);
    // Wait for "writer ready" (bounded), then let it write for a random while.
    FILE* child_out = ::fdopen(out[0], "r");
    char line[256] = {};
    bool ready = false;
    while (std::fgets(line, sizeof(line), child_out) != nullptr) {
      if (std::string(line).find("writer ready") != std::string::npos) {
        ready = true;
        break;
      }
    }
    ASSERT_TRUE(ready) << "crash writer did not start";
    ::usleep(20000 + rng() % 200000);
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    std::fclose(child_out);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round;
  }
  // Temp files of the last writer are still there, its pid is dead.
  const size_t temps_before = FilesUnder(root, ".tmp-").size();

  FileBackendOptions o;
  o.root = root;
  o.startup_scan_budget = absl::ZeroDuration();
  auto b = FileBackend::Open(o);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->WaitForIndex(absl::Seconds(20)));
  EXPECT_TRUE(FilesUnder(root, ".tmp-").empty()) << temps_before << " temps before";
  const core::PageKey ns = TestNamespace();
  int served = 0;
  for (int k = 0; k < kCrashKeys; ++k) {
    const size_t size = CrashObjectSize(k);
    ObjectStatus s = GetOne(**b, ns, TestKey(k), 0, 4096 * 65, size);  // Checks the bytes.
    EXPECT_TRUE(s == ObjectStatus::kOk || s == ObjectStatus::kNotFound) << ObjectStatusName(s);
    served += s == ObjectStatus::kOk;
  }
  BackendStats st = (*b)->Stats();
  EXPECT_EQ(st.corrupt_removed, 0u);
  EXPECT_EQ(st.indexed_objects, static_cast<uint64_t>(served));
  EXPECT_GT(served, 0);
  EXPECT_EQ(FilesUnder(root).size(), static_cast<size_t>(served));
}

}  // namespace
}  // namespace kvcellar::storage
