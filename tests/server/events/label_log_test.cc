#include "server/events/label_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvcellar::server {
namespace {

core::PageKey Key(uint8_t id) {
  core::PageKey k;
  k.bytes.fill(id);
  return k;
}

std::shared_ptr<const core::PageLabel> Tokens(uint32_t first, size_t n = 16) {
  auto label = std::make_shared<core::PageLabel>();
  for (size_t i = 0; i < n; ++i) label->tokens.push_back(first + static_cast<uint32_t>(i));
  return label;
}

class LabelLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "/labels-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::remove(path_.c_str());
  }
  void TearDown() override { std::remove(path_.c_str()); }

  std::unique_ptr<LabelLog> Open(uint64_t max_recovered = uint64_t{1} << 30) {
    LabelLogOptions o;
    o.path = path_;
    o.max_recovered_bytes = max_recovered;
    absl::StatusOr<std::unique_ptr<LabelLog>> log = LabelLog::Open(o);
    EXPECT_TRUE(log.ok()) << log.status();
    return log.ok() ? *std::move(log) : nullptr;
  }
  off_t Size() const {
    std::ifstream f(path_, std::ios::binary | std::ios::ate);
    return static_cast<off_t>(f.tellg());
  }

  std::string path_;
};

TEST_F(LabelLogTest, AttachedLabelsComeBackOnceAfterAReopenScopedByNamespace) {
  const core::PageKey ns_a = Key(0xA0), ns_b = Key(0xB0);
  {
    auto log = Open();
    ASSERT_NE(log, nullptr);
    auto opaque = std::make_shared<core::PageLabel>();
    opaque->has_engine_hash = true;
    opaque->engine_hash = 0x0123456789abcdefULL;
    const std::vector<core::PageKey> keys = {Key(1), Key(2), Key(3)};
    const std::vector<std::shared_ptr<const core::PageLabel>> labels = {Tokens(100), Tokens(200),
                                                                        opaque};
    // Page 2 was not attached (it had a label already): not recorded.
    log->Append(ns_a, keys, labels, {true, false, true});
    log->Append(ns_b, {Key(1)}, {Tokens(900, 4)}, {});
    EXPECT_EQ(log->Stats().appended, 3u);
  }  // The destructor writes what is buffered.
  auto log = Open();
  ASSERT_NE(log, nullptr);
  EXPECT_EQ(log->Stats().recovered, 3u);
  auto one = log->Take(ns_a, Key(1));
  ASSERT_NE(one, nullptr);
  EXPECT_EQ(one->tokens, Tokens(100)->tokens);
  EXPECT_FALSE(one->has_engine_hash);
  EXPECT_EQ(log->Take(ns_a, Key(1)), nullptr);  // Once.
  EXPECT_EQ(log->Take(ns_a, Key(2)), nullptr);
  auto three = log->Take(ns_a, Key(3));
  ASSERT_NE(three, nullptr);
  EXPECT_TRUE(three->has_engine_hash);
  EXPECT_EQ(three->engine_hash, 0x0123456789abcdefULL);
  EXPECT_TRUE(three->tokens.empty());
  // The same key in another namespace has its own label.
  auto other = log->Take(ns_b, Key(1));
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->tokens, Tokens(900, 4)->tokens);
  EXPECT_EQ(log->Stats().taken, 3u);
}

TEST_F(LabelLogTest, ATornTailIsCutAndTheRecordsBeforeItKept) {
  {
    auto log = Open();
    log->Append(Key(0xA0), {Key(1), Key(2)}, {Tokens(1), Tokens(2)}, {});
  }
  const off_t whole = Size();
  {
    auto log = Open();
    log->Append(Key(0xA0), {Key(3)}, {Tokens(3)}, {});
  }
  // A crash in the middle of the third record: its last bytes never reached the file.
  ASSERT_EQ(::truncate(path_.c_str(), Size() - 5), 0);
  {
    auto log = Open();
    const LabelLogStats s = log->Stats();
    EXPECT_EQ(s.recovered, 2u);
    EXPECT_EQ(s.truncated_bytes, 8u + 80 + 64 - 5);  // A 16-token record, less 5 bytes.
    EXPECT_EQ(Size(), whole);
    EXPECT_NE(log->Take(Key(0xA0), Key(2)), nullptr);
    EXPECT_EQ(log->Take(Key(0xA0), Key(3)), nullptr);
    log->Append(Key(0xA0), {Key(4)}, {Tokens(4)}, {});
  }
  // A flipped byte fails the record's CRC: the log ends before it.
  {
    const int fd = ::open(path_.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char bad = 0x7f;
    ASSERT_EQ(::pwrite(fd, &bad, 1, whole + 8 + 70), 1);  // Inside record 3's engine hash.
    ::close(fd);
  }
  auto log = Open();
  EXPECT_EQ(log->Stats().recovered, 2u);
  EXPECT_GT(log->Stats().truncated_bytes, 0u);
  EXPECT_EQ(log->Take(Key(0xA0), Key(4)), nullptr);
}

TEST_F(LabelLogTest, AFileThatIsNotALabelLogIsRefusedAndLeftAlone) {
  {
    std::ofstream f(path_);
    f << "this file belongs to someone else\n";
  }
  LabelLogOptions o;
  o.path = path_;
  absl::StatusOr<std::unique_ptr<LabelLog>> log = LabelLog::Open(o);
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(log.status().message().find("events.label_log"), std::string::npos);
  EXPECT_NE(log.status().message().find(path_), std::string::npos);
  EXPECT_EQ(Size(), 34);
}

TEST_F(LabelLogTest, CompactionKeepsTheLiveLabelsAndWhatIsAttachedDuringIt) {
  const core::PageKey ns = Key(0xA0);
  {
    auto log = Open();
    std::vector<core::PageKey> keys;
    std::vector<std::shared_ptr<const core::PageLabel>> labels;
    for (uint8_t i = 1; i <= 10; ++i) {
      keys.push_back(Key(i));
      labels.push_back(Tokens(i * 100u));
    }
    log->Append(ns, keys, labels, {});
  }
  auto log = Open();
  ASSERT_EQ(log->Stats().recovered, 10u);
  // Pages 1 and 2 came back into an index; 3..10 were not taken yet.
  auto one = log->Take(ns, Key(1));
  auto two = log->Take(ns, Key(2));
  bool keep_recovered = true;
  log->SetSnapshot(
      [&](LabelLog::Emit emit) {
        emit(ns, Key(1), one);
        emit(ns, Key(2), two);
        // A label attached while the snapshot is taken is recorded after it.
        log->Append(ns, {Key(11)}, {Tokens(1100)}, {});
      },
      [&] { return keep_recovered; });
  const off_t before = Size();
  log->CompactNow();
  EXPECT_EQ(log->Stats().compactions, 1u);
  log->Flush();
  {
    // A second reader of the file sees the compacted log: live, recovered and new labels.
    LabelLogOptions o;
    o.path = path_;
    auto again = LabelLog::Open(o);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ((*again)->Stats().recovered, 11u);
    EXPECT_NE((*again)->Take(ns, Key(11)), nullptr);
  }
  // Recovery settled: what was never taken is dropped at the next compaction.
  keep_recovered = false;
  log->CompactNow();
  log = nullptr;
  EXPECT_LT(Size(), before);
  log = Open();
  EXPECT_EQ(log->Stats().recovered, 3u);
  EXPECT_NE(log->Take(ns, Key(1)), nullptr);
  EXPECT_NE(log->Take(ns, Key(2)), nullptr);
  EXPECT_EQ(log->Take(ns, Key(3)), nullptr);
}

TEST_F(LabelLogTest, ReadingBackStopsAtTheBound) {
  {
    auto log = Open();
    log->Append(Key(0xA0), {Key(1), Key(2), Key(3)}, {Tokens(1), Tokens(2), Tokens(3)}, {});
  }
  auto log = Open(/*max_recovered=*/2 * 16 * 4);  // Two pages' tokens.
  EXPECT_EQ(log->Stats().recovered, 2u);
  EXPECT_EQ(log->Stats().recovered_skipped, 1u);
}

}  // namespace
}  // namespace kvcellar::server
