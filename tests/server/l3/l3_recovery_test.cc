// Tests server/l3/l3_recovery.h: what a file tier's startup scan found enters the radix index
// prefix-closed (parents before children, whatever order the files were listed in), only once the
// namespace has an index, and what cannot be placed (orphans, version 1 objects without a parent
// link, another geometry's objects) is counted and left out; objects the tier evicts for its
// capacity leave the index at once, and never enter it when they were still pending.
#include "server/l3/l3_recovery.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"
#include "tests/storage/storage_test_util.h"

namespace kvcellar::server {
namespace {

using storage::ParentLink;
using storage::testing::AlignedBuffer;
using storage::testing::TempDir;
using storage::testing::TestKey;
using testing::kObjectBytes;
using testing::L2World;

// Keys of a chain: salt names the chain.
std::vector<core::PageKey> Chain(uint64_t salt, size_t n) {
  std::vector<core::PageKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(TestKey(i, salt));
  return keys;
}

class L3RecoveryTest : public ::testing::Test {
 protected:
  L3RecoveryTest() : spec_(testing::NsSpec()), world_(WithOneTier()) {}

  static L2World::Options WithOneTier() {
    L2World::Options o;
    o.l3_tiers = 1;
    return o;
  }

  std::string TierSpec() const {
    return absl::StrCat("file:", dir_.path(), "?name=t0&io=threads", capacity_);
  }

  // Writes objects as an earlier daemon would have: (key, parent link), shard 0, `bytes` each.
  void Store(const std::vector<std::pair<core::PageKey, ParentLink>>& pages,
             uint64_t bytes = kObjectBytes, uint32_t shard = 0) {
    storage::FileBackendOptions o;
    o.root = dir_.path();
    o.io.kind = storage::IoEngineKind::kThreadPool;
    absl::StatusOr<std::unique_ptr<storage::FileBackend>> b = storage::FileBackend::Open(o);
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<AlignedBuffer> bufs;
    std::vector<storage::PutItem> items;
    for (const auto& [key, parent] : pages) {
      bufs.emplace_back(bytes);
      storage::testing::FillPayload(key, shard, bufs.back().get(), bytes);
      items.push_back({key, shard, bufs.back().get(), bytes, parent});
    }
    storage::BatchResult r =
        storage::testing::PutSync(**b, {spec_.Digest(), absl::MakeConstSpan(items), {}});
    for (const storage::ItemResult& item : r.items)
      ASSERT_EQ(item.status, storage::ObjectStatus::kOk);
  }

  // Opens the tier as a restarted daemon does (its scan runs) and the recovery over it.
  void Restart() {
    StorageConfig c = DefaultConfig().storage;
    c.tiers = TierSpec();
    absl::StatusOr<std::unique_ptr<L3Tiers>> t = L3Tiers::Open(c);
    ASSERT_TRUE(t.ok()) << t.status();
    tiers_ = *std::move(t);
    ASSERT_TRUE(tiers_->tier(0).file()->WaitForIndex(absl::Seconds(10)));
    recovery_ = std::make_unique<L3Recovery>(tiers_.get(), &world_.namespaces());
  }

  // Pages of `keys` (from the first page) the index holds in tier 0.
  uint32_t L3Pages(Namespace& ns, const std::vector<core::PageKey>& keys) {
    core::MatchOptions o;
    o.shards = ns.group_shards();
    absl::StatusOr<core::MatchResult> m = ns.index()->Match(keys, o);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? m->l3_pages[0] : 0;
  }

  L3ScanStats Stats() { return recovery_->Stats()[0]; }

  // Puts `keys` (a chain from its first page) through the running tier, as the daemon's writer.
  void Write(const std::vector<core::PageKey>& keys) {
    std::vector<AlignedBuffer> bufs;
    std::vector<storage::PutItem> items;
    for (size_t i = 0; i < keys.size(); ++i) {
      bufs.emplace_back(kObjectBytes);
      storage::testing::FillPayload(keys[i], 0, bufs.back().get(), kObjectBytes);
      items.push_back({keys[i], 0, bufs.back().get(), kObjectBytes,
                       i == 0 ? ParentLink::First() : ParentLink::Of(keys[i - 1])});
    }
    storage::BatchResult r = storage::testing::PutSync(
        *tiers_->tier(0).backend, {spec_.Digest(), absl::MakeConstSpan(items), {}});
    for (const storage::ItemResult& item : r.items) {
      ASSERT_EQ(item.status, storage::ObjectStatus::kOk);
    }
  }

  // Leading pages of `keys` the tier itself holds.
  uint32_t TierHolds(const std::vector<core::PageKey>& keys) {
    const std::vector<uint32_t> shards(keys.size(), 0);
    return storage::testing::ExistsSync(*tiers_->tier(0).backend, {spec_.Digest(), keys, shards})
        .present_prefix;
  }

  // Whether the index marks page `key` in tier 0.
  static bool Marked(Namespace& ns, const core::PageKey& key) {
    std::optional<core::PageInfo> info = ns.index()->Inspect(key);
    return info.has_value() && (info->shards[0].l3_tiers & 1) != 0;
  }

  TempDir dir_;
  std::string capacity_;  // "&capacity=..." for the tier, or empty.
  core::NamespaceSpec spec_;
  L2World world_;
  std::unique_ptr<L3Tiers> tiers_;
  std::unique_ptr<L3Recovery> recovery_;
};

TEST_F(L3RecoveryTest, PagesEnterParentsFirstOnlyOnceTheNamespaceHasAnIndex) {
  const std::vector<core::PageKey> a = Chain(1, 10);
  std::vector<core::PageKey> b(a.begin(), a.begin() + 4);  // Branches off a[3].
  for (const core::PageKey& k : Chain(2, 5)) b.push_back(k);
  const std::vector<core::PageKey> orphan = Chain(3, 4);  // Its first page's parent was lost.
  std::vector<std::pair<core::PageKey, ParentLink>> pages;
  // Children before parents, as a directory listing may give them.
  for (size_t i = a.size(); i-- > 0;) {
    pages.push_back({a[i], i == 0 ? ParentLink::First() : ParentLink::Of(a[i - 1])});
  }
  for (size_t i = 4; i < b.size(); ++i) pages.push_back({b[i], ParentLink::Of(b[i - 1])});
  pages.push_back({orphan[0], ParentLink::Of(TestKey(99, 9))});
  for (size_t i = 1; i < orphan.size(); ++i) {
    pages.push_back({orphan[i], ParentLink::Of(orphan[i - 1])});
  }
  pages.push_back({TestKey(5, 5), ParentLink{}});  // What a version 1 object carries.
  Store(pages);
  Store({{TestKey(6, 6), ParentLink::First()}}, kObjectBytes / 2);  // Another geometry.
  Restart();

  EXPECT_TRUE(Stats().complete);
  EXPECT_EQ(Stats().found, pages.size() + 1);
  EXPECT_EQ(Stats().objects_pending, pages.size() + 1) << "no index yet: the objects wait";
  std::shared_ptr<Namespace> ns = world_.Adopted(spec_);
  recovery_->OnIndexed(*ns);

  const L3ScanStats s = Stats();
  EXPECT_EQ(s.objects_pending, 0u);
  EXPECT_EQ(s.pages_inserted, 15u);
  EXPECT_EQ(s.pages_orphaned, 4u);
  EXPECT_EQ(s.pages_legacy, 1u);
  EXPECT_EQ(s.pages_mismatched, 1u);
  EXPECT_EQ(L3Pages(*ns, a), 10u);
  EXPECT_EQ(L3Pages(*ns, b), 9u);
  EXPECT_EQ(L3Pages(*ns, orphan), 0u);
  EXPECT_FALSE(ns->index()->Inspect(orphan[1]).has_value());
  EXPECT_FALSE(ns->index()->Inspect(TestKey(5, 5)).has_value());
  std::optional<core::PageInfo> info = ns->index()->Inspect(b[4]);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->parent, a[3]);
  EXPECT_TRUE(ns->index()->CheckInvariants().ok());
  // Once: a second registration finds nothing left to insert.
  recovery_->OnIndexed(*ns);
  EXPECT_EQ(Stats().pages_inserted, 15u);
}

TEST_F(L3RecoveryTest, APageHangsUnderAParentTheIndexAlreadyHolds) {
  const std::vector<core::PageKey> keys = Chain(7, 6);
  // Only keys[3..5] were written to L3; keys[0..2] are backed up to L2 after the restart.
  Store({{keys[3], ParentLink::Of(keys[2])},
         {keys[4], ParentLink::Of(keys[3])},
         {keys[5], ParentLink::Of(keys[4])}});
  Restart();
  std::shared_ptr<Namespace> ns = world_.Adopted(spec_);
  ASSERT_EQ(world_.Commit(*ns, absl::MakeConstSpan(keys).subspan(0, 3)), 3u);
  recovery_->OnIndexed(*ns);
  EXPECT_EQ(Stats().pages_inserted, 3u);
  EXPECT_EQ(Stats().pages_orphaned, 0u);
  core::MatchOptions o;
  o.shards = ns->group_shards();
  absl::StatusOr<core::MatchResult> m = ns->index()->Match(keys, o);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->l2_pages, 3u);
  EXPECT_EQ(m->l3_pages[0], 3u);
}

TEST_F(L3RecoveryTest, ANamespaceRegisteredBeforeTheScanEndsGetsItsPagesWhenItEnds) {
  const std::vector<core::PageKey> keys = Chain(8, 3);
  Store({{keys[0], ParentLink::First()},
         {keys[1], ParentLink::Of(keys[0])},
         {keys[2], ParentLink::Of(keys[1])}});
  // The namespace has its index before the recovery subscribes: the result applies at once.
  std::shared_ptr<Namespace> ns = world_.Adopted(spec_);
  Restart();
  EXPECT_EQ(Stats().pages_inserted, 3u);
  EXPECT_EQ(L3Pages(*ns, keys), 3u);
}

TEST_F(L3RecoveryTest, ObjectsTheTierEvictsForItsCapacityLeaveTheIndexAndWhatIsPending) {
  // Room for 6 objects (a 4 KiB header block each).
  capacity_ = absl::StrCat("&capacity=", 6 * (4096 + kObjectBytes));
  const std::vector<core::PageKey> keys = Chain(10, 6);
  std::vector<std::pair<core::PageKey, ParentLink>> pages;
  for (size_t i = 0; i < keys.size(); ++i) {
    pages.push_back({keys[i], i == 0 ? ParentLink::First() : ParentLink::Of(keys[i - 1])});
  }
  Store(pages);
  // The scan ranks by age: page 5 the oldest (coldest), page 0 the newest.
  const auto now = std::filesystem::file_time_type::clock::now();
  for (size_t i = 0; i < keys.size(); ++i) {
    std::filesystem::last_write_time(
        dir_.path() + "/" + storage::FileBackend::ObjectPath(spec_.Digest(), keys[i], 0),
        now - std::chrono::hours(1 + i));
  }
  Restart();
  ASSERT_EQ(Stats().objects_pending, 6u);
  // Two new objects while the namespace has no index: pages 5 and 4 go, and never enter.
  Write(Chain(11, 2));
  ASSERT_EQ(tiers_->tier(0).backend->Stats().evicted_objects, 2u);
  ASSERT_EQ(TierHolds(keys), 4u);
  std::shared_ptr<Namespace> ns = world_.Adopted(spec_);
  recovery_->OnIndexed(*ns);
  EXPECT_EQ(Stats().pages_inserted, 4u);
  EXPECT_EQ(L3Pages(*ns, keys), 4u);
  EXPECT_FALSE(Marked(*ns, keys[4]) || Marked(*ns, keys[5]));
  // Two more once the namespace is indexed: pages 3 and 2 go, and leave the index at once.
  Write(Chain(12, 2));
  ASSERT_EQ(TierHolds(keys), 2u);
  EXPECT_EQ(L3Pages(*ns, keys), 2u);
  EXPECT_TRUE(Marked(*ns, keys[1]));
  EXPECT_FALSE(Marked(*ns, keys[2]) || Marked(*ns, keys[3]));
  EXPECT_EQ(L3Pages(*ns, Chain(11, 2)), 0u) << "written around the index, never in it";
  EXPECT_TRUE(ns->index()->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvcellar::server
