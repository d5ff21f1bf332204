#include "storage/redis_watch.h"

#include <hiredis/hiredis.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "redis_test_util.h"
#include "storage/redis_backend.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::AlignedBuffer;
using testing::FillPayload;
using testing::TestKey;
using testing::TestNamespace;

TEST(RedisObjectKey, ParsesTheBackendsNamesAndNothingElse) {
  RedisBackendOptions o;
  o.addresses = {"unix:/nonexistent/redis.sock"};
  o.key_prefix = "it:";
  o.index = false;
  o.watch_removals = false;
  absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  const core::PageKey ns = TestNamespace();
  FileObjectId id;
  ASSERT_TRUE(ParseRedisObjectKey("it:", (*b)->ObjectKey(ns, TestKey(5), 70000), &id));
  EXPECT_EQ(id.ns_prefix, NamespacePrefix(ns));
  EXPECT_EQ(id.key, TestKey(5));
  EXPECT_EQ(id.shard, 70000u);
  // The tier's index hashes, another prefix, and names that are not quite an object's.
  EXPECT_FALSE(ParseRedisObjectKey("it:", (*b)->IndexKey(ns, TestKey(5), 0), &id));
  EXPECT_FALSE(ParseRedisObjectKey("kvc:", (*b)->ObjectKey(ns, TestKey(5), 0), &id));
  const std::string good = (*b)->ObjectKey(ns, TestKey(5), 1);
  EXPECT_FALSE(ParseRedisObjectKey("it:", good.substr(0, good.size() - 2), &id));
  EXPECT_FALSE(ParseRedisObjectKey("it:", good + "x", &id));
  std::string upper = good;
  upper[4] = 'A';
  EXPECT_FALSE(ParseRedisObjectKey("it:", upper, &id));
}

class RedisWatchTest : public testing::RedisServerTest {
 protected:
  std::unique_ptr<RedisBackend> Create() {
    RedisBackendOptions o;
    o.addresses = {server_->address()};
    o.connections_per_node = 1;
    absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }
  void Put(RedisBackend& b, int n) {
    std::vector<AlignedBuffer> bufs;
    std::vector<PutItem> puts;
    for (int i = 0; i < n; ++i) {
      bufs.emplace_back(4096);
      FillPayload(TestKey(i), 0, bufs.back().get(), 4096);
      puts.push_back({TestKey(i), 0, bufs.back().get(), 4096,
                      i == 0 ? ParentLink::First() : ParentLink::Of(TestKey(i - 1))});
    }
    BatchResult r = testing::PutSync(b, {ns_, puts});
    for (const ItemResult& it : r.items) ASSERT_EQ(it.status, ObjectStatus::kOk);
  }
  // What b's watch reports lands in removed_.
  void Follow(RedisBackend& b) {
    b.SetRemovalSink([this](absl::Span<const FileObjectId> ids) {
      absl::MutexLock lock(&mu_);
      removed_.insert(removed_.end(), ids.begin(), ids.end());
    });
  }
  bool Subscribed() const {
    testing::ReplyPtr r = server_->Command({"PUBSUB", "NUMSUB", "__keyevent@0__:evicted"});
    return r != nullptr && r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
           r->element[1]->integer == 1;
  }
  template <typename F>
  static bool WaitFor(F done, absl::Duration timeout = absl::Seconds(10)) {
    for (absl::Time until = absl::Now() + timeout; absl::Now() < until;) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return done();
  }

  core::PageKey ns_ = TestNamespace();
  absl::Mutex mu_;
  std::vector<FileObjectId> removed_ ABSL_GUARDED_BY(mu_);
};

// What the server expires or evicts reaches the sink, object by object; what a client deletes
// (the daemon's own Deletes, another tool's DEL) does not, nor do the tier's index hashes.
TEST_F(RedisWatchTest, ExpiredAndEvictedObjectsReachTheSinkAndNothingElse) {
  // A stock server publishes no keyspace events: the watch turns on what it needs.
  ASSERT_EQ(server_->CommandString({"CONFIG", "SET", "notify-keyspace-events", "g"}), "OK");
  auto b = Create();
  ASSERT_NE(b, nullptr);
  Follow(*b);
  ASSERT_TRUE(WaitFor([&] { return Subscribed(); }));
  testing::ReplyPtr flags = server_->Command({"CONFIG", "GET", "notify-keyspace-events"});
  ASSERT_NE(flags, nullptr);
  ASSERT_EQ(flags->elements, 2u);
  const std::string value(flags->element[1]->str, flags->element[1]->len);
  for (char c : {'g', 'E', 'x', 'e'}) EXPECT_NE(value.find(c), std::string::npos) << value;
  EXPECT_EQ(b->WatchStats().configured, 1u);

  Put(*b, 10);
  // Two expire, one is deleted by someone else.
  for (int i : {3, 4}) {
    ASSERT_EQ(server_->CommandInt({"PEXPIRE", b->ObjectKey(ns_, TestKey(i), 0), "1"}), 1);
  }
  ASSERT_EQ(server_->CommandInt({"DEL", b->ObjectKey(ns_, TestKey(9), 0)}), 1);
  ASSERT_TRUE(WaitFor([&] {
    absl::MutexLock lock(&mu_);
    return removed_.size() >= 2;
  }));
  // Then a maxmemory the server cannot meet: it evicts every key it can, the index hash too.
  ASSERT_EQ(server_->CommandString({"CONFIG", "SET", "maxmemory-policy", "allkeys-random"}), "OK");
  ASSERT_EQ(server_->CommandString({"CONFIG", "SET", "maxmemory", "1"}), "OK");
  server_->Command({"SET", "unrelated", "x"});  // Eviction runs before a write command.
  server_->Command({"CONFIG", "SET", "maxmemory", "0"});
  ASSERT_TRUE(WaitFor([&] {
    absl::MutexLock lock(&mu_);
    return removed_.size() >= 9;
  }));
  absl::SleepFor(absl::Milliseconds(200));  // Nothing more arrives.
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<int> got;
  for (const FileObjectId& id : removed_) {
    EXPECT_EQ(id.ns_prefix, NamespacePrefix(ns_));
    EXPECT_EQ(id.shard, 0u);
    int i = 0;
    while (i < 10 && TestKey(i) != id.key) ++i;
    ASSERT_LT(i, 10);
    EXPECT_TRUE(got.insert(i).second) << "page " << i << " twice";
  }
  EXPECT_EQ(got.size(), 9u);
  EXPECT_FALSE(got.contains(9));  // Deleted, not expired or evicted.
  EXPECT_EQ(b->WatchStats().removed, 9u);
  EXPECT_GE(b->WatchStats().messages, 10u);  // The index hash's eviction too.
}

// A server restart drops the subscription: the watch subscribes again and keeps following.
TEST_F(RedisWatchTest, AWatchThatLostItsServerSubscribesAgain) {
  auto b = Create();
  ASSERT_NE(b, nullptr);
  Follow(*b);
  ASSERT_TRUE(WaitFor([&] { return Subscribed(); }));
  ASSERT_GE(server_->CommandInt({"CLIENT", "KILL", "TYPE", "pubsub"}), 1);
  ASSERT_TRUE(WaitFor([&] { return b->WatchStats().connects >= 2 && Subscribed(); }));
  Put(*b, 1);
  ASSERT_EQ(server_->CommandInt({"PEXPIRE", b->ObjectKey(ns_, TestKey(0), 0), "1"}), 1);
  ASSERT_TRUE(WaitFor([&] {
    absl::MutexLock lock(&mu_);
    return removed_.size() == 1;
  }));
}

}  // namespace
}  // namespace kvcellar::storage
