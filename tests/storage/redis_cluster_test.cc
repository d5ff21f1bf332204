#include "storage/redis_cluster.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "redis_test_util.h"
#include "storage/redis_backend.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::GetOne;
using testing::PutOne;
using testing::RedisCluster;
using testing::TempDir;
using testing::TestKey;
using testing::TestNamespace;

// ---- Pure routing ------------------------------------------------------------------------------

TEST(RedisClusterRoutingTest, Crc16AndSlotsMatchTheSpec) {
  EXPECT_EQ(Crc16("123456789"), 0x31C3);  // The spec's check value.
  EXPECT_EQ(KeyHashSlot("foo"), 12182);
  EXPECT_EQ(KeyHashSlot("bar"), 5061);
  EXPECT_EQ(KeyHashSlot("123456789"), 0x31C3 & 16383);
}

TEST(RedisClusterRoutingTest, HashTags) {
  EXPECT_EQ(KeyHashSlot("{user1000}.following"), KeyHashSlot("{user1000}.followers"));
  EXPECT_EQ(KeyHashSlot("{user1000}.following"), KeyHashSlot("user1000"));
  EXPECT_EQ(KeyHashSlot("foo{}{bar}"), KeyHashSlot("foo{}{bar}"));  // Empty tag: whole key.
  EXPECT_NE(KeyHashSlot("foo{}{bar}"), KeyHashSlot("bar"));
  EXPECT_EQ(KeyHashSlot("foo{{bar}}zap"), KeyHashSlot("{bar"));
  EXPECT_EQ(KeyHashSlot("foo{bar}{zap}"), KeyHashSlot("bar"));
  EXPECT_EQ(KeyHashSlot("{bar"), Crc16("{bar") & 16383);  // No closing brace: whole key.
}

TEST(RedisClusterRoutingTest, ParsesRedirects) {
  Redirect r;
  ASSERT_TRUE(ParseRedirect("MOVED 3999 127.0.0.1:6381", &r));
  EXPECT_EQ(r.kind, Redirect::Kind::kMoved);
  EXPECT_EQ(r.slot, 3999);
  EXPECT_EQ(r.address, "127.0.0.1:6381");
  ASSERT_TRUE(ParseRedirect("ASK 1 [::1]:7000", &r));
  EXPECT_EQ(r.kind, Redirect::Kind::kAsk);
  EXPECT_EQ(r.address, "[::1]:7000");
  EXPECT_FALSE(ParseRedirect("ERR unknown command", &r));
  EXPECT_FALSE(ParseRedirect("MOVED 99999 host:1", &r));
  EXPECT_FALSE(ParseRedirect("MOVED 12", &r));
}

TEST(RedisClusterRoutingTest, Addresses) {
  absl::StatusOr<RedisAddress> a = ParseRedisAddress("10.0.0.1:6379");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "10.0.0.1");
  EXPECT_EQ(a->port, 6379);
  a = ParseRedisAddress("[::1]:7000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->ToString(), "[::1]:7000");
  a = ParseRedisAddress("unix:/run/redis.sock");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->is_unix);
  EXPECT_EQ(a->ToString(), "unix:/run/redis.sock");
  EXPECT_FALSE(ParseRedisAddress("host").ok());
  EXPECT_FALSE(ParseRedisAddress("host:0").ok());
  EXPECT_FALSE(ParseRedisAddress("unix:").ok());
}

TEST(RedisClusterRoutingTest, SlotMap) {
  SlotMap m;
  EXPECT_EQ(m.Lookup(5), SlotMap::kUnknown);
  m.Replace({{0, 99, "a:1"}, {100, 16383, "b:2"}});
  EXPECT_EQ(m.Address(m.Lookup(5)), "a:1");
  EXPECT_EQ(m.Address(m.Lookup(16383)), "b:2");
  m.SetSlot(5, m.NodeId("c:3"));
  EXPECT_EQ(m.Address(m.Lookup(5)), "c:3");
  EXPECT_EQ(m.node_count(), 3u);
  m.Replace({{0, 10, "b:2"}});
  EXPECT_EQ(m.Lookup(11), SlotMap::kUnknown);
  EXPECT_EQ(m.node_count(), 3u);  // Ids are never reused.
}

// ---- A real three-node cluster ---------------------------------------------------------------

class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveRedis()) GTEST_SKIP() << "redis-server not installed";
    ASSERT_TRUE(cluster_.Start(dir_.path())) << "cluster did not converge";
    RedisBackendOptions o;
    o.addresses = {cluster_.nodes[0]->address()};  // One seed is enough.
    o.cluster = true;
    o.connections_per_node = 2;
    o.connect_timeout = absl::Milliseconds(300);
    o.refresh_interval = absl::Milliseconds(20);
    absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = *std::move(b);
  }

  int SlotOf(int key) const { return KeyHashSlot(b_->ObjectKey(ns_, TestKey(key), 0)); }
  // A key index whose slot node `owner` serves, distinct from `not`.
  int KeyOwnedBy(int owner, int not_key = -1, int not_slot = -1) const {
    for (int k = 1000;; ++k) {
      if (k != not_key && cluster_.OwnerOf(SlotOf(k)) == owner &&
          (not_slot < 0 || SlotOf(k) != not_slot)) {
        return k;
      }
    }
  }
  // Moves keys of `slot` from node `from` to node `to`; completes the move unless `finish` is
  // false (then the slot stays MIGRATING/IMPORTING: the ASK window).
  void Migrate(int slot, int from, int to, const std::vector<std::string>& keys, bool finish) {
    auto& src = *cluster_.nodes[from];
    auto& dst = *cluster_.nodes[to];
    const std::string s = std::to_string(slot);
    ASSERT_EQ(dst.CommandString({"CLUSTER", "SETSLOT", s, "IMPORTING", cluster_.ids[from]}), "OK");
    ASSERT_EQ(src.CommandString({"CLUSTER", "SETSLOT", s, "MIGRATING", cluster_.ids[to]}), "OK");
    for (const std::string& k : keys) {
      ASSERT_EQ(src.CommandString({"MIGRATE", "127.0.0.1", std::to_string(dst.port()), k, "0",
                                   "5000"}),
                "OK");
    }
    if (finish) {
      for (auto& n : cluster_.nodes) {
        ASSERT_EQ(n->CommandString({"CLUSTER", "SETSLOT", s, "NODE", cluster_.ids[to]}), "OK");
      }
    }
  }

  TempDir dir_;
  RedisCluster cluster_;
  std::unique_ptr<RedisBackend> b_;
  core::PageKey ns_ = TestNamespace();
};

TEST_F(RedisClusterTest, PutGetAcrossNodes) {
  constexpr int kN = 90;
  constexpr size_t kSize = 20000;
  std::vector<testing::AlignedBuffer> bufs;
  std::vector<PutItem> puts;
  for (int i = 0; i < kN; ++i) bufs.emplace_back(kSize);
  for (int i = 0; i < kN; ++i) {
    testing::FillPayload(TestKey(i), 0, bufs[i].get(), kSize);
    puts.push_back({TestKey(i), 0, bufs[i].get(), kSize, {}});
  }
  BatchResult pr = testing::PutSync(*b_, {ns_, puts});  // One batch, split over three nodes.
  for (const ItemResult& r : pr.items) ASSERT_EQ(r.status, ObjectStatus::kOk);
  for (auto& n : cluster_.nodes) EXPECT_GT(n->CommandInt({"DBSIZE"}), 5) << n->address();
  std::vector<GetItem> gets;
  for (int i = 0; i < kN; ++i) {
    std::memset(bufs[i].get(), 0, kSize);
    gets.push_back({TestKey(i), 0, bufs[i].get(), kSize});
  }
  BatchResult gr = testing::GetSync(*b_, {ns_, gets});
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(gr.items[i].status, ObjectStatus::kOk) << i;
    EXPECT_TRUE(testing::PayloadMatches(TestKey(i), 0, bufs[i].get(), kSize));
  }
  std::vector<core::PageKey> keys;
  for (int i = 0; i < kN; ++i) keys.push_back(TestKey(i));
  keys.push_back(TestKey(5000));
  const uint32_t s0 = 0;
  EXPECT_EQ(testing::ExistsSync(*b_, {ns_, keys, absl::MakeConstSpan(&s0, 1)}).present_prefix,
            size_t{kN});
  EXPECT_EQ(b_->Stats().redirects, 0u);  // The map was right all along.
  EXPECT_GE(b_->Stats().topology_refreshes, 1u);
}

TEST_F(RedisClusterTest, MovedSlotIsFollowedAndLearned) {
  const int k = KeyOwnedBy(0);
  const int slot = SlotOf(k);
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(k), 0, 5000), ObjectStatus::kOk);
  // The slot's every key, as a resharding moves them: the object and the index hash that lives in
  // its slot (storage/redis_index.h).
  Migrate(slot, 0, 1, {b_->ObjectKey(ns_, TestKey(k), 0), b_->IndexKey(ns_, TestKey(k), 0)},
          /*finish=*/true);
  // The backend still routes the slot to node 0, which answers MOVED.
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(k), 0, 5000, 5000), ObjectStatus::kOk);
  EXPECT_GE(b_->Stats().redirects, 1u);
  const uint64_t redirects = b_->Stats().redirects;
  // Learned: no redirect the second time (the refresh agrees with the updated slot).
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(k), 0, 5000, 5000), ObjectStatus::kOk);
  EXPECT_EQ(b_->Stats().redirects, redirects);
  EXPECT_EQ(cluster_.nodes[1]->CommandInt({"EXISTS", b_->ObjectKey(ns_, TestKey(k), 0)}), 1);
  // Writes to the moved slot follow too.
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(k), 0, 6000), ObjectStatus::kOk);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(k), 0, 6000, 6000), ObjectStatus::kOk);
  EXPECT_EQ(b_->Stats().redirects, redirects);
}

TEST_F(RedisClusterTest, AskDuringMigration) {
  const int moved = KeyOwnedBy(2);
  const int slot = SlotOf(moved);
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(moved), 0, 3000), ObjectStatus::kOk);
  // Only `moved` goes to node 1; the slot stays MIGRATING on node 2.
  Migrate(slot, 2, 1, {b_->ObjectKey(ns_, TestKey(moved), 0)}, /*finish=*/false);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(moved), 0, 3000, 3000), ObjectStatus::kOk);
  EXPECT_GE(b_->Stats().redirects, 1u);
  // ASK does not change the map: the slot is still routed to node 2, which answers ASK again for
  // a key it no longer has, reads and writes alike.
  EXPECT_EQ(PutOne(*b_, ns_, TestKey(moved), 0, 3000), ObjectStatus::kOk);
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(moved), 0, 3000, 3000), ObjectStatus::kOk);
}

TEST_F(RedisClusterTest, NodeDownFailsItsSlotsFastOthersKeepWorking) {
  const int on0 = KeyOwnedBy(0), on2 = KeyOwnedBy(2);
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(on0), 0, 4000), ObjectStatus::kOk);
  ASSERT_EQ(PutOne(*b_, ns_, TestKey(on2), 0, 4000), ObjectStatus::kOk);
  cluster_.nodes[2]->Kill();
  const absl::Time start = absl::Now();
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(on2), 0, 4000), ObjectStatus::kRetry);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(GetOne(*b_, ns_, TestKey(on0), 0, 4000, 4000), ObjectStatus::kOk);
}

}  // namespace
}  // namespace kvcellar::storage
