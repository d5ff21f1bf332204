#include "storage/file_object_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

namespace fs = std::filesystem;
using testing::AlignedBuffer;
using testing::FillPayload;
using testing::PayloadMatches;
using testing::TempDir;
using testing::TestKey;
using testing::TestNamespace;

// A task the test waits on; the listener hands back its status.
struct TestTask : FileIoTask {
  FileObjectIo* io = nullptr;
  absl::Notification done;
  ObjectStatus result = ObjectStatus::kRetry;
};

class Recorder : public FileObjectIo::Listener {
 public:
  void OnObjectDone(FileIoTask* t, ObjectStatus status) override {
    auto* tt = static_cast<TestTask*>(t);
    tt->result = status;
    tt->done.Notify();
  }
};

void OnOp(IoOp* op) {
  auto* t = static_cast<TestTask*>(op->context);
  t->io->Advance(t, op->result);
}

class FileObjectIoTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void SetUp() override {
    root_fd_ = ::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(root_fd_, 0);
    IoEngineOptions eo;
    eo.kind = GetParam();
    eo.pool_threads = 2;
    absl::StatusOr<std::unique_ptr<IoEngine>> engine = IoEngine::Create(eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    slot_ = static_cast<uint8_t*>(std::aligned_alloc(kFileHeaderBlockBytes, kFileIoSlotBytes));
    Open(FsyncPolicy::kNone);
  }
  void TearDown() override {
    engine_.reset();
    std::free(slot_);
    if (root_fd_ >= 0) ::close(root_fd_);
  }
  void Open(FsyncPolicy fsync) {
    FileObjectIo::Options o;
    o.root = dir_.path();
    o.root_fd = root_fd_;
    o.fsync = fsync;
    o.host_id = "testhost";
    o.pid = ::getpid();
    io_ =
        std::make_unique<FileObjectIo>(o, FileModes::ForProcessUmask(), engine_.get(), &recorder_);
  }

  ObjectStatus Run(OpKind kind, uint64_t key, uint8_t* buf, uint64_t len, TestTask* t) {
    t->io = io_.get();
    t->kind = kind;
    t->ns = &ns_;
    t->id = FileObjectId{NamespacePrefix(ns_), TestKey(key), 0};
    t->buf = buf;
    t->len = len;
    t->block = slot_;
    FormatObjectPath(t->id.ns_prefix, t->id.key, t->id.shard, t->path);
    t->op.context = t;
    t->op.done = &OnOp;
    io_->Start(t);
    engine_->Submit(&t->op);
    EXPECT_TRUE(t->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return t->result;
  }
  ObjectStatus Put(uint64_t key, size_t size) {
    AlignedBuffer buf(size);
    FillPayload(TestKey(key), 0, buf.get(), size);
    TestTask t;
    return Run(OpKind::kPut, key, buf.get(), size, &t);
  }
  ObjectStatus Get(uint64_t key, size_t capacity, TestTask* t, AlignedBuffer* buf) {
    return Run(OpKind::kGet, key, buf->get(), capacity, t);
  }
  ObjectStatus Simple(OpKind kind, uint64_t key) {
    TestTask t;
    return Run(kind, key, nullptr, 0, &t);
  }
  std::string PathOf(uint64_t key) const {
    char buf[kMaxRelPath];
    FormatObjectPath(NamespacePrefix(ns_), TestKey(key), 0, buf);
    return dir_.path() + "/" + buf;
  }

  TempDir dir_;
  int root_fd_ = -1;
  std::unique_ptr<IoEngine> engine_;
  Recorder recorder_;
  std::unique_ptr<FileObjectIo> io_;
  uint8_t* slot_ = nullptr;
  core::PageKey ns_ = TestNamespace();
};

TEST_P(FileObjectIoTest, PutThenGetIsByteExact) {
  for (size_t size : {size_t{1}, size_t{4096}, size_t{10000}, size_t{256 * 1024}}) {
    ASSERT_EQ(Put(size, size), ObjectStatus::kOk) << size;
    EXPECT_EQ(fs::file_size(PathOf(size)), kFileHeaderBlockBytes + size);
    AlignedBuffer buf(size + 8192);
    TestTask t;
    ASSERT_EQ(Get(size, size + 8192, &t, &buf), ObjectStatus::kOk) << size;
    EXPECT_EQ(t.payload, size);
    EXPECT_TRUE(PayloadMatches(TestKey(size), 0, buf.get(), size));
  }
  // No temp file left behind.
  for (const auto& e : fs::recursive_directory_iterator(dir_.path())) {
    EXPECT_EQ(e.path().string().find(kTempMarker), std::string::npos) << e.path();
  }
}

TEST_P(FileObjectIoTest, PutMakesTheDirectoriesOwnerOnly) {
  ASSERT_EQ(Put(1, 4096), ObjectStatus::kOk);
  const fs::path leaf = fs::path(PathOf(1)).parent_path();
  EXPECT_EQ(fs::status(leaf).permissions() & fs::perms::all, fs::perms::owner_all);
  EXPECT_EQ(fs::status(leaf.parent_path()).permissions() & fs::perms::all, fs::perms::owner_all);
  EXPECT_EQ(fs::status(PathOf(1)).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
}

TEST_P(FileObjectIoTest, EveryFsyncPolicyLandsTheObject) {
  for (FsyncPolicy p : {FsyncPolicy::kData, FsyncPolicy::kDataAndDirectory}) {
    Open(p);
    const uint64_t key = 10 + static_cast<uint64_t>(p);
    ASSERT_EQ(Put(key, 8192), ObjectStatus::kOk);
    AlignedBuffer buf(8192);
    TestTask t;
    EXPECT_EQ(Get(key, 8192, &t, &buf), ObjectStatus::kOk);
  }
}

TEST_P(FileObjectIoTest, MissingObjectsAreNotFound) {
  AlignedBuffer buf(4096);
  TestTask t;
  EXPECT_EQ(Get(5, 4096, &t, &buf), ObjectStatus::kNotFound);
  EXPECT_EQ(Simple(OpKind::kExists, 5), ObjectStatus::kNotFound);
  EXPECT_EQ(Simple(OpKind::kDelete, 5), ObjectStatus::kNotFound);
}

TEST_P(FileObjectIoTest, ExistsAndDelete) {
  ASSERT_EQ(Put(1, 4096), ObjectStatus::kOk);
  EXPECT_EQ(Simple(OpKind::kExists, 1), ObjectStatus::kOk);
  EXPECT_EQ(Simple(OpKind::kDelete, 1), ObjectStatus::kOk);
  EXPECT_FALSE(fs::exists(PathOf(1)));
  EXPECT_EQ(Simple(OpKind::kExists, 1), ObjectStatus::kNotFound);
}

TEST_P(FileObjectIoTest, AFileShorterThanAHeaderIsNotPresent) {
  ASSERT_EQ(Put(1, 4096), ObjectStatus::kOk);
  fs::resize_file(PathOf(1), 100);
  EXPECT_EQ(Simple(OpKind::kExists, 1), ObjectStatus::kNotFound);
}

TEST_P(FileObjectIoTest, ACorruptObjectIsUnlinkedAndNamed) {
  ASSERT_EQ(Put(1, 8192), ObjectStatus::kOk);
  {
    std::fstream f(PathOf(1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(kFileHeaderBlockBytes + 100);
    f.put('\x5a');
  }
  AlignedBuffer buf(8192);
  TestTask t;
  EXPECT_EQ(Get(1, 8192, &t, &buf), ObjectStatus::kChecksumError);
  EXPECT_NE(t.defect, ObjectDefect::kNone);
  EXPECT_FALSE(fs::exists(PathOf(1)));
}

TEST_P(FileObjectIoTest, BytesAfterThePayloadAreADefect) {
  ASSERT_EQ(Put(1, 4096), ObjectStatus::kOk);
  {
    std::ofstream f(PathOf(1), std::ios::app | std::ios::binary);
    f << std::string(10, 'x');
  }
  AlignedBuffer buf(4096);
  TestTask t;
  EXPECT_EQ(Get(1, 4096, &t, &buf), ObjectStatus::kChecksumError);
}

INSTANTIATE_TEST_SUITE_P(Engines, FileObjectIoTest,
                         ::testing::Values(IoEngineKind::kUring, IoEngineKind::kThreadPool),
                         [](const ::testing::TestParamInfo<IoEngineKind>& info) {
                           return info.param == IoEngineKind::kUring ? "IoUring" : "ThreadPool";
                         });

TEST(FileObjectIoStatusTest, ErrnoBecomesAStatus) {
  EXPECT_EQ(StatusFromErrno(ENOENT), ObjectStatus::kNotFound);
  EXPECT_EQ(StatusFromErrno(ENOSPC), ObjectStatus::kRejected);
  EXPECT_EQ(StatusFromErrno(EDQUOT), ObjectStatus::kRejected);
  EXPECT_EQ(StatusFromErrno(ESTALE), ObjectStatus::kRetry);
  EXPECT_EQ(StatusFromErrno(EMFILE), ObjectStatus::kRetry);
  EXPECT_EQ(StatusFromErrno(EIO), ObjectStatus::kDeviceError);
}

}  // namespace
}  // namespace kvcellar::storage
