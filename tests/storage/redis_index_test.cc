#include "storage/redis_index.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "redis_test_util.h"
#include "storage/redis_backend.h"
#include "storage/redis_cluster.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

using testing::AlignedBuffer;
using testing::FillPayload;
using testing::GetOne;
using testing::TestKey;
using testing::TestNamespace;

TEST(RedisIndexFormat, EntryRoundTripsAndMalformedOnesAreRefused) {
  IndexEntry e;
  e.ns = TestNamespace();
  e.key = TestKey(7);
  e.shard = 70000;
  e.parent = ParentLink::Of(TestKey(6));
  e.payload_bytes = (uint64_t{5} << 32) + 3;
  char field[kIndexFieldBytes], entry[kIndexEntryBytes];
  EncodeIndexField(e.key, e.shard, field);
  EncodeIndexEntry(e, entry);
  IndexEntry d;
  ASSERT_TRUE(DecodeIndexEntry({field, sizeof(field)}, {entry, sizeof(entry)}, &d));
  EXPECT_EQ(d.ns, e.ns);
  EXPECT_EQ(d.key, e.key);
  EXPECT_EQ(d.shard, e.shard);
  EXPECT_EQ(d.parent, e.parent);
  EXPECT_EQ(d.payload_bytes, e.payload_bytes);
  EXPECT_EQ(d.version, kObjectFormatVersion);
  EXPECT_FALSE(DecodeIndexEntry({field, sizeof(field) - 1}, {entry, sizeof(entry)}, &d));
  EXPECT_FALSE(DecodeIndexEntry({field, sizeof(field)}, {entry, sizeof(entry) - 1}, &d));
  entry[0] = 9;  // A future entry version.
  EXPECT_FALSE(DecodeIndexEntry({field, sizeof(field)}, {entry, sizeof(entry)}, &d));
}

TEST(RedisIndexFormat, EverySlotHasATagThatHashesToIt) {
  for (int slot = 0; slot < kClusterSlots; ++slot) {
    const absl::string_view tag = SlotTag(static_cast<uint16_t>(slot));
    ASSERT_FALSE(tag.empty());
    ASSERT_LE(tag.size(), 4u);
    ASSERT_EQ(KeyHashSlot(absl::StrCat("kvc:0123456789abcdef:idx:{", tag, "}")), slot);
  }
}

class RedisIndexTest : public testing::RedisServerTest {
 protected:
  RedisBackendOptions Options() const {
    RedisBackendOptions o;
    o.addresses = {server_->address()};
    o.connections_per_node = 2;
    return o;
  }
  std::unique_ptr<RedisBackend> Create(const RedisBackendOptions& o) {
    absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }
  // A chain of n pages of `shards` shards each, `size` bytes, put in one batch.
  void PutChain(RedisBackend& b, int n, uint32_t shards, size_t size) {
    std::vector<AlignedBuffer> bufs;
    std::vector<PutItem> puts;
    for (int i = 0; i < n; ++i) {
      for (uint32_t s = 0; s < shards; ++s) {
        bufs.emplace_back(size);
        FillPayload(TestKey(i), s, bufs.back().get(), size);
        puts.push_back({TestKey(i), s, bufs.back().get(), size,
                        i == 0 ? ParentLink::First() : ParentLink::Of(TestKey(i - 1))});
      }
    }
    BatchResult r = testing::PutSync(b, {ns_, puts});
    for (const ItemResult& it : r.items) ASSERT_EQ(it.status, ObjectStatus::kOk);
  }
  static RedisIndexResult Readback(RedisBackend& b) {
    absl::Notification done;
    RedisIndexResult out;
    b.SetIndexSink([&](RedisIndexResult r) {
      out = std::move(r);
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return out;
  }

  core::PageKey ns_ = TestNamespace();
};

TEST_F(RedisIndexTest, ANewBackendReadsBackEveryObjectWithItsParent) {
  {
    auto b = Create(Options());
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(Readback(*b).scan.found, 0u);  // An empty server.
    PutChain(*b, 50, 2, 4096);
    EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 100);
    // Delete removes the entry too.
    ObjectRef gone{TestKey(49), 1};
    testing::DeleteSync(*b, {ns_, absl::MakeConstSpan(&gone, 1)});
    EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 99);
  }
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  const RedisIndexResult r = Readback(*b);
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.index_keys, 1u);
  EXPECT_EQ(r.scan.found, 99u);
  EXPECT_EQ(r.scan.dropped, 0u);
  EXPECT_EQ(r.scan.payload_bytes, 99u * 4096);
  ASSERT_EQ(r.scan.namespaces.size(), 1u);
  EXPECT_EQ(r.scan.namespaces[0], ns_);
  for (const FileStartupScan::Found& f : r.scan.objects) {
    int i = 0;
    while (TestKey(i) != f.id.key) ++i;
    EXPECT_EQ(f.parent, i == 0 ? ParentLink::First() : ParentLink::Of(TestKey(i - 1)));
    EXPECT_EQ(f.payload_bytes, 4096u);
    EXPECT_LT(f.id.shard, 2u);
  }
}

// An entry whose object went (TTL, maxmemory eviction) is pruned at readback; one that goes after
// is a hint the read finds missing. A malformed entry is counted as dropped and left alone.
TEST_F(RedisIndexTest, StaleEntriesArePrunedAndMalformedOnesDropped) {
  auto b = Create(Options());
  ASSERT_NE(b, nullptr);
  // Its own readback first: running beside the UNLINK below, it could prune the entry itself.
  EXPECT_EQ(Readback(*b).scan.found, 0u);
  PutChain(*b, 3, 1, 4096);
  server_->Command({"UNLINK", b->ObjectKey(ns_, TestKey(2), 0)});  // As if it had expired.
  server_->Command({"HSET", b->IndexKey(ns_, TestKey(0), 0), "junk", "junk"});
  auto again = Create(Options());
  const RedisIndexResult r = Readback(*again);
  EXPECT_EQ(r.scan.found, 2u);
  EXPECT_EQ(r.stale, 1u);
  EXPECT_EQ(r.scan.dropped, 2u);  // The stale entry and the junk one.
  EXPECT_EQ(r.scan.objects.size(), 2u);
  // The stale entry is gone from the hash; the junk one stays (not ours to judge).
  EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 3);
  // An object that goes after the readback: its hint is a miss at read time, never bytes, and
  // the read prunes the entry.
  server_->Command({"UNLINK", b->ObjectKey(ns_, TestKey(1), 0)});
  EXPECT_EQ(GetOne(*again, ns_, TestKey(1), 0, 4096), ObjectStatus::kNotFound);
  EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 2);
  EXPECT_EQ(GetOne(*again, ns_, TestKey(0), 0, 4096, 4096), ObjectStatus::kOk);
  EXPECT_EQ(server_->CommandInt({"HLEN", b->IndexKey(ns_, TestKey(0), 0)}), 2);
}

TEST_F(RedisIndexTest, WithoutTheIndexNothingIsWrittenOrDelivered) {
  RedisBackendOptions o = Options();
  o.index = false;
  auto b = Create(o);
  ASSERT_NE(b, nullptr);
  PutChain(*b, 4, 1, 4096);
  EXPECT_EQ(server_->CommandInt({"EXISTS", b->IndexKey(ns_, TestKey(0), 0)}), 0);
  EXPECT_EQ(server_->CommandInt({"DBSIZE"}), 4);
}

TEST(RedisIndexCluster, EntriesLiveInTheirObjectsSlotAndAreReadBackFromEveryNode) {
  if (!testing::HaveRedis()) GTEST_SKIP() << "redis-server not installed";
  testing::TempDir dir;
  testing::RedisCluster cluster;
  ASSERT_TRUE(cluster.Start(dir.path()));
  RedisBackendOptions o;
  o.addresses = cluster.Addresses();
  o.cluster = true;
  const core::PageKey ns = TestNamespace();
  constexpr int kPages = 64;
  {
    auto b = *RedisBackend::Create(o);
    std::vector<AlignedBuffer> bufs;
    std::vector<PutItem> puts;
    for (int i = 0; i < kPages; ++i) {
      bufs.emplace_back(4096);
      FillPayload(TestKey(i), 0, bufs.back().get(), 4096);
      puts.push_back({TestKey(i), 0, bufs.back().get(), 4096,
                      i == 0 ? ParentLink::First() : ParentLink::Of(TestKey(i - 1))});
    }
    BatchResult r = testing::PutSync(*b, {ns, puts});
    for (const ItemResult& it : r.items) ASSERT_EQ(it.status, ObjectStatus::kOk);
    for (int i = 0; i < kPages; ++i) {
      EXPECT_EQ(KeyHashSlot(b->IndexKey(ns, TestKey(i), 0)),
                KeyHashSlot(b->ObjectKey(ns, TestKey(i), 0)));
    }
  }
  auto b = *RedisBackend::Create(o);
  absl::Notification done;
  RedisIndexResult out;
  b->SetIndexSink([&](RedisIndexResult r) {
    out = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(out.complete);
  EXPECT_EQ(out.scan.found, static_cast<uint64_t>(kPages));
  EXPECT_GT(out.index_keys, 3u);  // Spread over slots, not one hot hash.
}

}  // namespace
}  // namespace kvcellar::storage
