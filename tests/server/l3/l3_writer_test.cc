// Tests server/l3/l3_writer.h on real file tiers and a real L2: each write policy (when a page is
// written, to which tiers), the admission filter, write-back on eviction with the slot kept until
// the write ends, the bytes that reach the backend, the index marks, and backpressure.
#include "server/l3/l3_writer.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kPages = 3;

StorageConfig Storage(L3WritePolicy policy, int64_t selective_hits = 2,
                      uint64_t max_pending_bytes = 1 << 30) {
  StorageConfig s = DefaultConfig().storage;
  s.write_policy = policy;
  s.selective_hits = selective_hits;
  s.max_pending_write_bytes = max_pending_bytes;
  return s;
}

// An L3World with `tiers` and the writer, wired as the Cache (server/cache/cache.h) wires them.
class Writer {
 public:
  explicit Writer(std::vector<std::string> tiers, StorageConfig storage,
                  L2World::Options l2 = L2World::Options())
      : world(std::move(tiers), storage, l2),
        writer(
            &world.tiers(), &world.l2(), [this] { return next_id++; }, &world.metrics(),
            world.storage()),
        ns(world.Adopted(NsSpec(2))),
        keys(PromptKeys(NsSpec(2), 1, kPages)) {
    world.l2().set_eviction_observer(&writer);
    EXPECT_EQ(world.Commit(*ns, keys), kPages);
    world.FillPayloads(*ns, keys);
  }
  ~Writer() { world.l2().set_eviction_observer(nullptr); }

  // What DeviceMover tells the writer after a Backup committed `keys`.
  void Committed(v1::WritePolicy policy) {
    std::vector<core::ObjectId> objects;
    for (const core::PageKey& k : keys) {
      for (uint16_t s = 0; s < ns->shards(); ++s) objects.push_back({k, s});
    }
    writer.OnCommitted(*ns, objects, policy);
  }
  // Pages of `keys` whose every shard tier `t` holds, per the index.
  uint64_t Marked(size_t t) { return ns->index()->Stats().l3_objects[t] / ns->shards(); }
  bool Stored(size_t t, const core::PageKey& key) {
    return world.Read(*ns, t, key, 0) == storage::ObjectStatus::kOk &&
           world.Read(*ns, t, key, 1) == storage::ObjectStatus::kOk;
  }
  std::string Scrape() { return world.registry().Scrape(); }

  std::atomic<uint64_t> next_id{1000};
  L3World world;
  L3Writer writer;
  std::shared_ptr<Namespace> ns;
  std::vector<core::PageKey> keys;
};

TEST(L3WriterTest, DefaultPolicyComesFromTheConfig) {
  Writer w({""}, Storage(L3WritePolicy::kWriteBack));
  EXPECT_EQ(w.writer.default_policy(), v1::WRITE_POLICY_WRITE_BACK);
  EXPECT_EQ(w.writer.Resolve(v1::WRITE_POLICY_UNSPECIFIED), v1::WRITE_POLICY_WRITE_BACK);
  EXPECT_EQ(w.writer.Resolve(v1::WRITE_POLICY_L2_ONLY), v1::WRITE_POLICY_L2_ONLY);
}

TEST(L3WriterTest, WriteThroughWritesEveryTierAtCommit) {
  Writer w({"", ""}, Storage(L3WritePolicy::kWriteThrough));
  w.Committed(v1::WRITE_POLICY_UNSPECIFIED);
  w.writer.Drain();
  for (const core::PageKey& key : w.keys) {
    EXPECT_TRUE(w.Stored(0, key)) << "the L2 bytes, read back and checked";
    EXPECT_TRUE(w.Stored(1, key));
  }
  EXPECT_EQ(w.Marked(0), kPages);
  EXPECT_EQ(w.Marked(1), kPages);
  EXPECT_EQ(w.ns->index()->Stats().pins, 0u) << "the write's pins are gone";
  EXPECT_EQ(w.writer.pending_bytes(), 0u);
  EXPECT_EQ(w.writer.tracked(), 0u);
  EXPECT_EQ(w.world.metrics().Snapshot().l2_to_l3_bytes, 2 * 2 * kPages * kObjectBytes);
  EXPECT_THAT(w.Scrape(), HasSubstr("kvcellar_l3_writes_total{tier=\"t1\",result=\"ok\"} 6"));
}

TEST(L3WriterTest, L2OnlyWritesNothing) {
  Writer w({""}, Storage(L3WritePolicy::kWriteThrough));
  w.Committed(v1::WRITE_POLICY_L2_ONLY);
  w.writer.Drain();
  EXPECT_FALSE(w.Stored(0, w.keys[0]));
  EXPECT_EQ(w.Marked(0), 0u);
  EXPECT_EQ(w.writer.tracked(), 0u);
}

TEST(L3WriterTest, SelectiveWritesAPageOnceItHasEnoughL2Hits) {
  Writer w({""}, Storage(L3WritePolicy::kWriteThrough, /*selective_hits=*/2));
  w.Committed(v1::WRITE_POLICY_WRITE_THROUGH_SELECTIVE);
  w.writer.Drain();
  EXPECT_EQ(w.writer.tracked(), kPages);
  EXPECT_EQ(w.Marked(0), 0u);

  const std::vector<core::PageKey> hit = {w.keys[0], w.keys[1]};
  w.writer.OnL2Hits(*w.ns, hit);
  w.writer.Drain();
  EXPECT_EQ(w.Marked(0), 0u) << "one hit of two";
  w.writer.OnL2Hits(*w.ns, hit);
  w.writer.Drain();
  EXPECT_TRUE(w.Stored(0, w.keys[0]));
  EXPECT_TRUE(w.Stored(0, w.keys[1]));
  EXPECT_FALSE(w.Stored(0, w.keys[2]));
  EXPECT_EQ(w.writer.tracked(), 1u) << "written pages are forgotten";

  // Hits on another namespace's pages of the same key count nothing.
  std::shared_ptr<Namespace> other = w.world.Adopted(NsSpec(1, false, "other"));
  w.writer.OnL2Hits(*other, {w.keys[2]});
  w.writer.OnL2Hits(*other, {w.keys[2]});
  w.writer.Drain();
  EXPECT_FALSE(w.Stored(0, w.keys[2]));
}

TEST(L3WriterTest, AdmissionHoldsOneTierBackUntilThePageIsHit) {
  Writer w({"", "admit_after=1"}, Storage(L3WritePolicy::kWriteThrough));
  w.Committed(v1::WRITE_POLICY_WRITE_THROUGH);
  w.writer.Drain();
  EXPECT_EQ(w.Marked(0), kPages) << "no threshold: at once";
  EXPECT_EQ(w.Marked(1), 0u);
  EXPECT_EQ(w.writer.tracked(), kPages);
  w.writer.OnL2Hits(*w.ns, {w.keys[1]});
  w.writer.Drain();
  EXPECT_TRUE(w.Stored(1, w.keys[1]));
  EXPECT_FALSE(w.Stored(1, w.keys[0]));
  EXPECT_EQ(w.Marked(1), 1u);
}

TEST(L3WriterTest, WriteBackWritesEvictedPagesAndFreesTheirSlotsAfter) {
  L2World::Options l2;
  l2.high_watermark = 0.0;  // Any page is over the watermark.
  l2.low_watermark = 0.0;
  Writer w({""}, Storage(L3WritePolicy::kWriteBack), l2);
  w.Committed(v1::WRITE_POLICY_UNSPECIFIED);
  w.writer.Drain();
  EXPECT_EQ(w.Marked(0), 0u) << "nothing is written while the pages are in L2";
  EXPECT_EQ(w.writer.tracked(), kPages);

  ASSERT_EQ(w.world.l2().EnforceWatermarks(), 2 * kPages * kObjectBytes);
  w.writer.Drain();
  EXPECT_EQ(w.writer.held_bytes(), 0u);
  EXPECT_EQ(SlotsUsed(w.world.pool()), 0u) << "slots freed once written";
  for (const core::PageKey& key : w.keys) {
    EXPECT_TRUE(w.Stored(0, key)) << "both shards of the TP-2 page, with the bytes L2 held";
  }
  EXPECT_EQ(w.Marked(0), kPages) << "the pages stay indexed, in L3 only";
  EXPECT_EQ(L2World::L2Hits(*w.ns, w.keys), 0u);
  EXPECT_EQ(w.writer.tracked(), 0u);
}

TEST(L3WriterTest, AnAdminEvictWritesBackLikeAnyEviction) {
  Writer w({""}, Storage(L3WritePolicy::kWriteBack));
  w.Committed(v1::WRITE_POLICY_UNSPECIFIED);
  w.writer.Drain();
  ASSERT_EQ(w.writer.tracked(), kPages);
  uint64_t written_back = 0;
  const core::AdminEvictResult r =
      w.world.l2().EvictScope(*w.ns, std::nullopt, 0, /*dry_run=*/false, &written_back);
  EXPECT_EQ(r.pages, kPages);
  EXPECT_EQ(written_back, kPages) << "pages, not objects: each TP-2 page counts once";
  w.writer.Drain();
  EXPECT_EQ(SlotsUsed(w.world.pool()), 0u) << "slots freed once written";
  for (const core::PageKey& key : w.keys) EXPECT_TRUE(w.Stored(0, key));
  EXPECT_EQ(w.Marked(0), kPages);
}

TEST(L3WriterTest, WritesPastThePendingLimitAreDroppedNotQueued) {
  // Room for one object in flight; a commit of six objects is dropped whole.
  Writer w({""}, Storage(L3WritePolicy::kWriteThrough, 2, kObjectBytes));
  w.Committed(v1::WRITE_POLICY_WRITE_THROUGH);
  w.writer.Drain();
  EXPECT_FALSE(w.Stored(0, w.keys[0]));
  EXPECT_EQ(w.writer.pending_bytes(), 0u);
  EXPECT_EQ(w.ns->index()->Stats().pins, 0u);
  EXPECT_THAT(w.Scrape(), HasSubstr("kvcellar_l3_writes_total{tier=\"t0\",result=\"dropped\"} 6"));
}

TEST(L3WriterTest, PageThatLeftL2IsNotWritten) {
  Writer w({""}, Storage(L3WritePolicy::kWriteThrough));
  const core::PageKey gone = PromptKeys(NsSpec(2), 7, 1)[0];
  std::vector<core::ObjectId> objects = {{gone, 0}, {gone, 1}, {w.keys[0], 0}};
  w.writer.OnCommitted(*w.ns, objects, v1::WRITE_POLICY_WRITE_THROUGH);
  w.writer.Drain();
  EXPECT_EQ(w.world.Read(*w.ns, 0, w.keys[0], 0), storage::ObjectStatus::kOk);
  EXPECT_EQ(w.world.Read(*w.ns, 0, gone, 0), storage::ObjectStatus::kNotFound);
  EXPECT_THAT(w.Scrape(),
              HasSubstr("kvcellar_l3_writes_total{tier=\"t0\",result=\"not_resident\"} 2"));
  EXPECT_EQ(w.ns->index()->Stats().pins, 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
