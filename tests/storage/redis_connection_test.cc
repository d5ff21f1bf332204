#include "storage/redis_connection.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "redis_test_util.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

class RedisConnectionTest : public testing::RedisServerTest {
 protected:
  void SetUp() override {
    testing::RedisServerTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(server_->address());
    ASSERT_TRUE(a.ok());
    addr_ = *a;
  }

  // Connects `c` and builds a pipeline of one EXISTS.
  void ConnectWithOneExists(RedisConnection& c) {
    ASSERT_TRUE(c.Connect(addr_, absl::Seconds(1), "").ok());
    c.Begin();
    c.AddSimple(RedisCommand::kExists, "EXISTS", "k", 0);
  }

  struct Got {
    RedisCommand cmd;
    uint32_t item;
    RedisReplyType type;
    long long integer;
    std::string text;
    size_t header_len;
    uint64_t payload_len;
    bool oversize;
  };
  std::vector<Got> Run(RedisConnection& c, absl::Status* status,
                       absl::Duration timeout = absl::Seconds(5)) {
    std::vector<Got> out;
    c.Run(
        absl::Now() + timeout, status, [&](const RedisConnection::Expect& e, const RedisReply& r) {
          out.push_back(
              {e.cmd, e.item, r.type, r.integer, r.text, r.header_len, r.payload_len, r.oversize});
        });
    return out;
  }

  // Runs the pipeline, expecting every reply.
  std::vector<Got> RunAll(RedisConnection& c) {
    absl::Status s;
    std::vector<Got> got = Run(c, &s);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(got.size(), c.pending());
    return got;
  }

  RedisAddress addr_;
};

TEST_F(RedisConnectionTest, APipelineSetsAndGetsWithoutCopies) {
  RedisConnection c;
  ASSERT_TRUE(c.Connect(addr_, absl::Seconds(1), "").ok());
  ASSERT_TRUE(c.connected());
  uint8_t header[kObjectHeaderBytes];
  for (size_t i = 0; i < sizeof(header); ++i) header[i] = static_cast<uint8_t>(i);
  std::vector<uint8_t> payload(100000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);

  c.Begin();
  c.AddSet("k1", header, payload.data(), payload.size(), "", 0);
  c.AddSimple(RedisCommand::kExists, "EXISTS", "k1", 1);
  c.AddSimple(RedisCommand::kExists, "EXISTS", "nope", 2);
  EXPECT_EQ(c.pending(), 3u);
  std::vector<Got> got = RunAll(c);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].type, RedisReplyType::kStatus);
  EXPECT_EQ(got[1].type, RedisReplyType::kInteger);
  EXPECT_EQ(got[1].integer, 1);
  EXPECT_EQ(got[2].integer, 0);
  EXPECT_EQ(got[2].item, 2u);
  EXPECT_EQ(server_->CommandInt({"STRLEN", "k1"}), kObjectHeaderBytes + payload.size());

  // GET into a destination: the header apart, the payload straight in.
  std::vector<uint8_t> dst(payload.size());
  std::vector<uint8_t> small(10);
  c.Begin();
  c.AddSimple(RedisCommand::kGet, "GET", "k1", 0, dst.data(), dst.size());
  c.AddSimple(RedisCommand::kGet, "GET", "k1", 1, small.data(), small.size());
  c.AddSimple(RedisCommand::kGet, "GET", "nope", 2, dst.data(), dst.size());
  got = RunAll(c);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].type, RedisReplyType::kString);
  EXPECT_EQ(got[0].header_len, kObjectHeaderBytes);
  EXPECT_EQ(got[0].payload_len, payload.size());
  EXPECT_FALSE(got[0].oversize);
  EXPECT_EQ(dst, payload);
  EXPECT_TRUE(got[1].oversize);  // Larger than its destination: not copied.
  EXPECT_EQ(small, std::vector<uint8_t>(10, 0));
  EXPECT_EQ(got[2].type, RedisReplyType::kNil);

  c.Begin();
  c.AddSimple(RedisCommand::kUnlink, "UNLINK", "k1", 0);
  got = RunAll(c);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].integer, 1);
}

TEST_F(RedisConnectionTest, ErrorRepliesCarryTheirText) {
  RedisConnection c;
  ASSERT_TRUE(c.Connect(addr_, absl::Seconds(1), "").ok());
  c.Begin();
  c.AddAsking();  // Not a cluster: an error reply, matched to ASKING.
  c.AddSimple(RedisCommand::kGet, "NOSUCHCOMMAND", "k", 4);
  std::vector<Got> got = RunAll(c);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].cmd, RedisCommand::kAsking);
  EXPECT_EQ(got[1].type, RedisReplyType::kError);
  EXPECT_EQ(got[1].item, 4u);
  EXPECT_NE(got[1].text.find("ERR"), std::string::npos) << got[1].text;
}

TEST_F(RedisConnectionTest, TheTtlArgumentsGoOnTheSet) {
  RedisConnection c;
  ASSERT_TRUE(c.Connect(addr_, absl::Seconds(1), "").ok());
  uint8_t header[kObjectHeaderBytes] = {};
  const uint8_t payload[] = {1, 2, 3};
  c.Begin();
  c.AddSet("ttl", header, payload, sizeof(payload), "$2\r\nPX\r\n$6\r\n100000\r\n", 0);
  ASSERT_EQ(RunAll(c).size(), 1u);
  const long long pttl = server_->CommandInt({"PTTL", "ttl"});
  EXPECT_GT(pttl, 0);
  EXPECT_LE(pttl, 100000);
}

TEST_F(RedisConnectionTest, AStalledServerStopsTheRunAtTheDeadline) {
  RedisConnection c;
  ASSERT_NO_FATAL_FAILURE(ConnectWithOneExists(c));
  server_->Pause();
  absl::Status s;
  const absl::Time start = absl::Now();
  std::vector<Got> got = Run(c, &s, absl::Milliseconds(100));
  server_->Resume();
  EXPECT_TRUE(got.empty());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  c.Close();
  EXPECT_FALSE(c.connected());
  ASSERT_TRUE(c.Connect(addr_, absl::Seconds(1), "").ok());  // Reconnects.
}

TEST_F(RedisConnectionTest, AServerThatGoesAwayIsUnavailable) {
  RedisConnection c;
  ASSERT_NO_FATAL_FAILURE(ConnectWithOneExists(c));
  server_->Kill();
  absl::Status s;
  EXPECT_TRUE(Run(c, &s).empty());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  c.Close();
  EXPECT_TRUE(absl::IsUnavailable(c.Connect(addr_, absl::Milliseconds(100), "")));
}

TEST_F(RedisConnectionTest, ARefusedAuthIsPermissionDenied) {
  RedisConnection c;
  // The server has no password: AUTH is an error.
  EXPECT_TRUE(absl::IsPermissionDenied(c.Connect(addr_, absl::Seconds(1), "secret")));
  EXPECT_FALSE(c.connected());
}

}  // namespace
}  // namespace kvcellar::storage
