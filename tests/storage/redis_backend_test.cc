#include "storage/redis_backend.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "redis_test_util.h"
#include "storage/object_format.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::AlignedBuffer;
using testing::FillPayload;
using testing::GetOne;
using testing::PutOne;
using testing::RedisServer;
using testing::TempDir;
using testing::TestKey;
using testing::TestNamespace;

class RedisBackendTest : public testing::RedisServerTest {
 protected:
  RedisBackendOptions Options() const {
    RedisBackendOptions o;
    o.addresses = {server_->address()};
    o.connections_per_node = 2;
    o.connect_timeout = absl::Milliseconds(200);
    o.command_timeout = absl::Seconds(2);
    o.reconnect_backoff = absl::Milliseconds(50);
    return o;
  }
  std::unique_ptr<RedisBackend> Create(const RedisBackendOptions& o) {
    absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }

  core::PageKey ns_ = TestNamespace();
};

TEST_F(RedisBackendTest, PutGetRoundTripIsByteExact) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  const std::vector<size_t> sizes = {1, 4096, 10000, 256 * 1024, 4 << 20};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 3, sizes[i]), ObjectStatus::kOk) << sizes[i];
    EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 3, sizes[i] + 4096, sizes[i]), ObjectStatus::kOk);
    // Stored as header + payload.
    EXPECT_EQ(server_->CommandInt({"STRLEN", b->ObjectKey(ns_, TestKey(i), 3)}),
              static_cast<long long>(kObjectHeaderBytes + sizes[i]));
  }
  EXPECT_EQ(GetOne(*b, ns_, TestKey(100), 0, 4096), ObjectStatus::kNotFound);
  BackendStats s = b->Stats();
  EXPECT_EQ(s.op(OpKind::kPut).by_status[0], sizes.size());
  EXPECT_EQ(s.op(OpKind::kGet).by_status[size_t(ObjectStatus::kNotFound)], 1u);
  EXPECT_FALSE(b->capabilities().persistent);
  EXPECT_TRUE(b->capabilities().shared_across_nodes);
}

TEST_F(RedisBackendTest, PipelinedBatchWithMissesAndManyConnections) {
  RedisBackendOptions o = Options();
  o.connections_per_node = 4;
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  constexpr int kN = 64;
  constexpr size_t kSize = 32 * 1024;
  std::vector<AlignedBuffer> bufs;
  std::vector<PutItem> puts;
  for (int i = 0; i < kN; ++i) bufs.emplace_back(kSize);
  for (int i = 0; i < kN; ++i) {
    FillPayload(TestKey(i), i % 2, bufs[i].get(), kSize);
    puts.push_back({TestKey(i), uint32_t(i % 2), bufs[i].get(), kSize, {}});
  }
  BatchResult pr = testing::PutSync(*b, {ns_, puts});
  for (const ItemResult& r : pr.items) ASSERT_EQ(r.status, ObjectStatus::kOk);
  std::vector<GetItem> gets;
  for (int i = 0; i < kN; ++i) {
    std::memset(bufs[i].get(), 0, kSize);
    gets.push_back({TestKey(i), uint32_t(i % 2), bufs[i].get(), kSize});
  }
  AlignedBuffer miss(kSize);
  gets.push_back({TestKey(999), 0, miss.get(), kSize});
  BatchResult gr = testing::GetSync(*b, {ns_, gets});
  ASSERT_EQ(gr.items.size(), size_t{kN + 1});
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(gr.items[i].status, ObjectStatus::kOk) << i;
    EXPECT_TRUE(testing::PayloadMatches(TestKey(i), i % 2, bufs[i].get(), kSize)) << i;
  }
  EXPECT_EQ(gr.items[kN].status, ObjectStatus::kNotFound);
}

TEST_F(RedisBackendTest, ExistsPrefixAndDelete) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  const std::vector<uint32_t> shards = {0, 1, 2};
  std::vector<core::PageKey> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(TestKey(i));
  for (int i = 0; i < 8; ++i) {
    for (uint32_t s : shards) {
      if (i == 3 && s == 2) continue;
      ASSERT_EQ(PutOne(*b, ns_, keys[i], s, 1000), ObjectStatus::kOk);
    }
  }
  ExistsResult r = testing::ExistsSync(*b, {ns_, keys, shards});
  EXPECT_EQ(r.present_prefix, 3u);
  EXPECT_EQ(r.status, ObjectStatus::kOk);
  ObjectRef refs[] = {{keys[1], 0}, {keys[1], 0}};
  BatchResult d = testing::DeleteSync(*b, {ns_, refs});
  // The same object twice in one batch: one removes it, the other finds it gone (the two may run
  // on different connections, in either order).
  ASSERT_EQ(d.items.size(), 2u);
  EXPECT_EQ(
      int(d.items[0].status == ObjectStatus::kOk) + int(d.items[1].status == ObjectStatus::kOk), 1);
  EXPECT_EQ(int(d.items[0].status == ObjectStatus::kNotFound) +
                int(d.items[1].status == ObjectStatus::kNotFound),
            1);
  EXPECT_EQ(testing::ExistsSync(*b, {ns_, keys, shards}).present_prefix, 1u);
  EXPECT_EQ(GetOne(*b, ns_, keys[1], 0, 1000), ObjectStatus::kNotFound);
}

TEST_F(RedisBackendTest, KeyPrefixPerNamespaceAndTtl) {
  RedisBackendOptions o = Options();
  o.key_prefix = "test:";
  o.ttl = absl::Seconds(30);
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(PutOne(*b, ns_, TestKey(1), 0, 100), ObjectStatus::kOk);
  const std::string key = b->ObjectKey(ns_, TestKey(1), 0);
  EXPECT_EQ(key.rfind("test:", 0), 0u);
  EXPECT_NE(key, b->ObjectKey(TestNamespace(2), TestKey(1), 0));
  const long long pttl = server_->CommandInt({"PTTL", key});
  EXPECT_GT(pttl, 20000);
  EXPECT_LE(pttl, 30000);
  // Another namespace does not see it.
  EXPECT_EQ(GetOne(*b, TestNamespace(2), TestKey(1), 0, 100), ObjectStatus::kNotFound);
  // Expiry turns into a miss.
  o.ttl = absl::Milliseconds(50);
  b = Create(o);
  ASSERT_EQ(PutOne(*b, ns_, TestKey(2), 0, 100), ObjectStatus::kOk);
  ::usleep(150000);
  EXPECT_EQ(GetOne(*b, ns_, TestKey(2), 0, 100), ObjectStatus::kNotFound);
}

TEST_F(RedisBackendTest, CorruptTornAndForeignValuesAreRemovedAndCounted) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  constexpr size_t kSize = 50000;
  for (int i = 0; i < 5; ++i) ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
  auto key = [&](int i) { return b->ObjectKey(ns_, TestKey(i), 0); };
  // 0: a flipped payload byte. 1: truncated (torn). 2: another key's value. 3: not ours at all.
  std::string v0 = server_->CommandString({"GET", key(0)});
  v0[kObjectHeaderBytes + 777] ^= 1;
  server_->Command({"SET", key(0), v0});
  const std::string v1 = server_->CommandString({"GET", key(1)});
  server_->Command({"SET", key(1), v1.substr(0, v1.size() - 100)});
  server_->Command({"SET", key(2), server_->CommandString({"GET", key(4)})});
  server_->Command({"SET", key(3), "hello"});
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kChecksumError) << i;
    EXPECT_EQ(server_->CommandInt({"EXISTS", key(i)}), 0) << i;
    EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kNotFound) << i;
  }
  EXPECT_EQ(GetOne(*b, ns_, TestKey(4), 0, kSize, kSize), ObjectStatus::kOk);
  // A value larger than the slot: foreign size.
  ASSERT_EQ(PutOne(*b, ns_, TestKey(5), 0, kSize), ObjectStatus::kOk);
  EXPECT_EQ(GetOne(*b, ns_, TestKey(5), 0, kSize / 2), ObjectStatus::kChecksumError);
  BackendStats s = b->Stats();
  EXPECT_EQ(s.corrupt_removed, 5u);
  EXPECT_EQ(s.op(OpKind::kGet).by_status[size_t(ObjectStatus::kChecksumError)], 5u);
}

// A value of a later object format (a newer daemon's, sharing the server during an upgrade or
// after a downgrade) is a miss for this build, and stays for the daemons that read it.
TEST_F(RedisBackendTest, ANewerFormatsValueIsAMissAndStays) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  constexpr size_t kSize = 50000;
  ASSERT_EQ(PutOne(*b, ns_, TestKey(0), 0, kSize), ObjectStatus::kOk);
  const std::string key = b->ObjectKey(ns_, TestKey(0), 0);
  std::string v = server_->CommandString({"GET", key});
  v[8] = static_cast<char>(kObjectFormatVersion + 1);  // The format version (u16 LE).
  server_->Command({"SET", key, v});
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(GetOne(*b, ns_, TestKey(0), 0, kSize), ObjectStatus::kNotFound);
    EXPECT_EQ(server_->CommandInt({"EXISTS", key}), 1);
  }
  EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 1);
  EXPECT_EQ(b->Stats().corrupt_removed, 0u);
}

TEST_F(RedisBackendTest, BytesAppendedAfterThePayloadAreRemovedAndCounted) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  constexpr size_t kSize = 50000;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(PutOne(*b, ns_, TestKey(i), 0, kSize), ObjectStatus::kOk);
  auto key = [&](int i) { return b->ObjectKey(ns_, TestKey(i), 0); };
  // 0: one byte past an object that fills the slot exactly; 1: bytes that still fit a larger
  // slot. Both: intact header and payload, then extra bytes.
  server_->Command({"APPEND", key(0), "x"});
  server_->Command({"APPEND", key(1), "junk"});
  const size_t capacity[2] = {kSize, 2 * kSize};
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, capacity[i]), ObjectStatus::kChecksumError) << i;
    EXPECT_EQ(server_->CommandInt({"EXISTS", key(i)}), 0) << i;
    EXPECT_EQ(GetOne(*b, ns_, TestKey(i), 0, capacity[i]), ObjectStatus::kNotFound) << i;
  }
  EXPECT_EQ(GetOne(*b, ns_, TestKey(2), 0, kSize, kSize), ObjectStatus::kOk);
  BackendStats s = b->Stats();
  EXPECT_EQ(s.corrupt_removed, 2u);
  EXPECT_EQ(s.op(OpKind::kGet).by_status[size_t(ObjectStatus::kChecksumError)], 2u);
}

TEST_F(RedisBackendTest, ServerDownFailsFastThenRecovers) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(PutOne(*b, ns_, TestKey(1), 0, 8192), ObjectStatus::kOk);
  server_->Kill();
  // Mid-run: the pooled connections are dead; every op fails with kRetry, quickly.
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    EXPECT_EQ(GetOne(*b, ns_, TestKey(1), 0, 8192), ObjectStatus::kRetry);
    EXPECT_EQ(PutOne(*b, ns_, TestKey(2), 0, 8192), ObjectStatus::kRetry);
    const core::PageKey k = TestKey(1);
    const uint32_t s0 = 0;
    ExistsResult e =
        testing::ExistsSync(*b, {ns_, absl::MakeConstSpan(&k, 1), absl::MakeConstSpan(&s0, 1)});
    EXPECT_EQ(e.present_prefix, 0u);
    EXPECT_EQ(e.status, ObjectStatus::kRetry);
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  }
  // Back (empty: no persistence): works again after the reconnect backoff.
  ASSERT_TRUE(server_->Start());
  ::usleep(60000);
  ObjectStatus s = ObjectStatus::kRetry;
  for (int i = 0; i < 20 && s != ObjectStatus::kOk; ++i) {
    s = PutOne(*b, ns_, TestKey(3), 0, 8192);
    if (s != ObjectStatus::kOk) ::usleep(20000);
  }
  EXPECT_EQ(s, ObjectStatus::kOk);
  // Each pooled connection reconnects on its own backoff, so a Get may still draw one that has
  // not (kRetry) right after the Put succeeded on another: retry it the same way.
  s = ObjectStatus::kRetry;
  for (int i = 0; i < 20 && s != ObjectStatus::kOk; ++i) {
    s = GetOne(*b, ns_, TestKey(3), 0, 8192, 8192);
    if (s == ObjectStatus::kRetry) ::usleep(20000);
  }
  EXPECT_EQ(s, ObjectStatus::kOk);
  EXPECT_GE(b->Stats().reconnects, 2u);
}

// A server that restarts while the pooled connections sit idle: each connection fails its next
// pipeline before any reply, reconnects at once and runs it again, so no op fails.
TEST_F(RedisBackendTest, RestartWhileIdleLosesNoOp) {
  RedisBackendOptions o = Options();
  o.connections_per_node = 4;
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  // A batch of 8 spreads over all four connections, connecting each.
  std::vector<core::PageKey> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(TestKey(100 + i));
  for (const core::PageKey& k : keys) ASSERT_EQ(PutOne(*b, ns_, k, 0, 4096), ObjectStatus::kOk);
  const uint64_t reconnects = b->Stats().reconnects;
  server_->Kill();
  ASSERT_TRUE(server_->Start());  // Empty: no persistence.
  for (int round = 0; round < 3; ++round) {
    for (const core::PageKey& k : keys) {
      EXPECT_EQ(PutOne(*b, ns_, k, 0, 4096), ObjectStatus::kOk) << "round " << round;
      EXPECT_EQ(GetOne(*b, ns_, k, 0, 4096, 4096), ObjectStatus::kOk) << "round " << round;
    }
  }
  EXPECT_GE(b->Stats().reconnects, reconnects + 1);
}

TEST_F(RedisBackendTest, StalledServerFailsAtTheDeadline) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(PutOne(*b, ns_, TestKey(1), 0, 8192), ObjectStatus::kOk);
  server_->Pause();  // Accepts bytes into the socket buffer, never answers.
  AlignedBuffer buf(8192);
  GetItem item{TestKey(1), 0, buf.get(), 8192};
  const absl::Time start = absl::Now();
  BatchResult r =
      testing::GetSync(*b, {ns_, absl::MakeConstSpan(&item, 1), absl::Milliseconds(200)});
  const absl::Duration took = absl::Now() - start;
  server_->Resume();
  ASSERT_EQ(r.items.size(), 1u);
  EXPECT_EQ(r.items[0].status, ObjectStatus::kRetry);
  EXPECT_TRUE(r.deadline_exceeded);
  EXPECT_GE(took, absl::Milliseconds(190));
  EXPECT_LT(took, absl::Milliseconds(700));
  // The stalled connection was dropped; a new one works.
  EXPECT_EQ(GetOne(*b, ns_, TestKey(1), 0, 8192, 8192), ObjectStatus::kOk);
}

TEST_F(RedisBackendTest, UnreachableAtStartIsNotAnError) {
  RedisBackendOptions o = Options();
  o.addresses = {"unix:" + dir_.path() + "/nobody.sock"};
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(GetOne(*b, ns_, TestKey(1), 0, 4096), ObjectStatus::kRetry);
  // Bad options are errors.
  o.addresses = {"no-port"};
  EXPECT_EQ(RedisBackend::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.addresses = {};
  EXPECT_EQ(RedisBackend::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RedisBackendTest, ConcurrentBatchesAndOversizedObjects) {
  RedisBackendOptions o = Options();
  o.max_object_bytes = 64 * 1024;
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(PutOne(*b, ns_, TestKey(1), 0, 64 * 1024 + 1), ObjectStatus::kRejected);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        const core::PageKey key = TestKey(t * 100 + i);
        failures += PutOne(*b, ns_, key, 0, 20000) != ObjectStatus::kOk;
        failures += GetOne(*b, ns_, key, 0, 20000, 20000) != ObjectStatus::kOk;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace kvcellar::storage
