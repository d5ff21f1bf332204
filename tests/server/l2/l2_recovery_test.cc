// Tests server/l2/l2_recovery.h: one "daemon life" writes pages through L2Space and the journal
// into a pool over memory that outlives it, as a named shm object does; a second life over the
// same memory re-attaches the journal and recovers. Committed pages come back with their
// namespace, geometry, owners and bytes; pages being written, torn records, damaged bytes and
// orphans do not, each counted; a freed slot's page never comes back. Real daemons and real
// kills are tests/integration/test_l2_restart.py.
#include "server/l2/l2_recovery.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/crc32c.h"
#include "core/slot_journal.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

constexpr uint64_t kPoolBytes = 4 * kRegionBytes;

core::HostPoolOptions PoolOptions() {
  core::HostPoolOptions o;
  o.capacity_bytes = kPoolBytes;
  o.region_bytes = kRegionBytes;
  o.slot_sizes = {kObjectBytes, 4 * kObjectBytes};
  return o;
}

// Memory that outlives a daemon life, like the pool's and the journal's shm objects.
struct Shared {
  Shared()
      : pool(static_cast<uint8_t*>(std::aligned_alloc(4096, kPoolBytes))),
        journal_bytes(*core::SlotJournal::Bytes(
            {kPoolBytes, kRegionBytes, 4, {kObjectBytes, 4 * kObjectBytes}})),
        journal(static_cast<uint8_t*>(std::aligned_alloc(64, journal_bytes))) {
    std::memset(pool, 0, kPoolBytes);
    std::memset(journal, 0, journal_bytes);
  }
  ~Shared() {
    std::free(pool);
    std::free(journal);
  }
  uint8_t* pool;
  uint64_t journal_bytes;
  uint8_t* journal;
};

// One daemon life: a pool, its journal, a registry and L2Space over the shared memory.
class Life {
 public:
  Life(Shared& shared, bool attach) {
    pool_ = *core::HostPool::Create(PoolOptions(), {shared.pool, kPoolBytes});
    const std::span<uint8_t> j{shared.journal, shared.journal_bytes};
    absl::StatusOr<std::unique_ptr<core::SlotJournal>> journal =
        attach ? core::SlotJournal::Attach(core::SlotJournalGeometry::Of(*pool_), j)
               : core::SlotJournal::Format(core::SlotJournalGeometry::Of(*pool_), j);
    EXPECT_TRUE(journal.ok()) << journal.status();
    journal_ = *std::move(journal);
    pool_->set_journal(journal_.get());
    namespaces_ = std::make_unique<NamespaceRegistry>(pool_.get(), core::EvictionPolicyKind::kLru,
                                                      0, nullptr, &tenants_);
    metrics_ = std::make_unique<CacheMetrics>(&registry_);
    l2_ = std::make_unique<L2Space>(pool_.get(), namespaces_.get(), 1.0, 0.99, metrics_.get(),
                                    &tenants_);
  }

  // A Backup of `keys` (a chain under `parent`) into L2: journaled WRITING, bytes gathered
  // (FillPayload), journaled COMMITTED, committed in the index. With `commit` false it stops
  // after the bytes, as a copy in flight when the daemon died.
  void Backup(Namespace& ns, const std::vector<core::PageKey>& keys, bool commit = true,
              std::optional<core::PageKey> parent = std::nullopt) {
    for (size_t i = 0; i < keys.size(); ++i) {
      for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
        absl::StatusOr<core::SlotRef> slot = l2_->Allocate(ns, keys[i], shard, 0);
        ASSERT_TRUE(slot.ok());
        const core::WriteRequest w{keys[i], i == 0 ? parent : std::optional(keys[i - 1]), shard,
                                   *slot, core::WriteKind::kBackup};
        ASSERT_TRUE(ns.index()->BeginWrite(w).ok());
        l2_->JournalWriting(ns, w);
        storage::testing::FillPayload(keys[i], shard, pool_->Address(*slot), ns.object_bytes());
        if (!commit) continue;
        l2_->JournalCommitted(ns, *slot);
        ASSERT_TRUE(ns.index()->Commit({keys[i], shard}).ok());
      }
    }
  }

  core::SlotRef SlotOf(Namespace& ns, const core::PageKey& key, uint16_t shard) {
    core::SlotRef slot;
    ns.index()->GetL2Slots(absl::MakeConstSpan(&key, 1), shard, absl::MakeSpan(&slot, 1));
    return slot;
  }

  L2RecoveryStats Recover() { return RecoverL2(*pool_, *journal_, *namespaces_, 2); }

  core::HostPool& pool() { return *pool_; }
  NamespaceRegistry& namespaces() { return *namespaces_; }
  L2Space& l2() { return *l2_; }
  TenantLedger& tenants() { return tenants_; }

 private:
  std::unique_ptr<core::HostPool> pool_;
  std::unique_ptr<core::SlotJournal> journal_;
  TenantLedger tenants_;
  std::unique_ptr<NamespaceRegistry> namespaces_;
  MetricsRegistry registry_;
  std::unique_ptr<CacheMetrics> metrics_;
  std::unique_ptr<L2Space> l2_;
};

// Whether every shard of every key is a committed L2 hit holding FillPayload's bytes.
void ExpectServed(Life& life, Namespace& ns, const std::vector<core::PageKey>& keys) {
  core::MatchOptions m;
  m.shards = ns.group_shards();
  absl::StatusOr<core::MatchResult> r = ns.index()->Match(keys, m);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->l2_pages, keys.size());
  std::vector<uint8_t> want(ns.object_bytes());
  for (const core::PageKey& key : keys) {
    for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
      const core::SlotRef slot = life.SlotOf(ns, key, shard);
      ASSERT_TRUE(slot.valid());
      storage::testing::FillPayload(key, shard, want.data(), want.size());
      EXPECT_EQ(std::memcmp(life.pool().Address(slot), want.data(), want.size()), 0);
    }
  }
}

TEST(L2RecoveryTest, CommittedPagesComeBackWithTheirNamespaceAndBytes) {
  Shared shared;
  const core::NamespaceSpec tp2 = NsSpec(2);
  const core::NamespaceSpec mla = NsSpec(4, /*mla=*/true, "mla-model");
  const std::vector<core::PageKey> a = PromptKeys(tp2, 1, 12);
  const std::vector<core::PageKey> b = PromptKeys(mla, 2, 5);
  {
    Life first(shared, /*attach=*/false);
    first.namespaces().GetOrCreate(NsSpec(1, false, "never-fixed"));  // No geometry, no pages.
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(tp2);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    std::shared_ptr<Namespace> ns_mla = first.namespaces().GetOrCreate(mla);
    ASSERT_TRUE(ns_mla->AdoptLayout(TestLayout(kLayers, kBytesPerBlock, /*mla=*/true)).ok());
    first.Backup(*ns, a);
    first.Backup(*ns_mla, b);
    // The life ends without freeing anything: a SIGKILL.
  }
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_TRUE(stats.warm);
  EXPECT_EQ(stats.namespaces, 3u);
  EXPECT_EQ(stats.pages, 17u);
  EXPECT_EQ(stats.objects, 12u * 2 + 5);
  EXPECT_EQ(stats.dropped(), 0u);
  std::shared_ptr<Namespace> ns = second.namespaces().ById(2);
  ASSERT_NE(ns, nullptr);
  EXPECT_EQ(ns->digest(), tp2.Digest());
  EXPECT_EQ(ns->object_bytes(), kObjectBytes);
  ExpectServed(second, *ns, a);
  ExpectServed(second, *second.namespaces().ById(3), b);
  // The geometry is held by the pages: an engine with another layout is refused.
  EXPECT_FALSE(ns->AdoptLayout(TestLayout(kLayers + 1)).ok());
  EXPECT_TRUE(ns->AdoptLayout(TestLayout()).ok());
  // The pool accounts for them, with their owners, and so does their tenant (tenants.quotas);
  // the records name its account, so evicting them discharges it.
  EXPECT_EQ(second.l2().UsedBytes(), (12u * 2 + 5) * kObjectBytes);
  TenantAccount* tenant = second.tenants().ForTenant(tp2.tenant);
  EXPECT_EQ(tenant->used_bytes(), (12u * 2 + 5) * kObjectBytes);
  EXPECT_TRUE(ns->index()->CheckInvariants().ok());
  second.l2().EvictScope(*ns, std::nullopt, 0, false);
  second.l2().EvictScope(*second.namespaces().ById(3), std::nullopt, 0, false);
  EXPECT_EQ(second.l2().UsedBytes(), 0u);
  EXPECT_EQ(tenant->used_bytes(), 0u);
}

TEST(L2RecoveryTest, InFlightTornDamagedAndOrphanedObjectsAreDroppedAndCounted) {
  Shared shared;
  const core::NamespaceSpec spec = NsSpec(1);
  const std::vector<core::PageKey> whole = PromptKeys(spec, 1, 6);
  const std::vector<core::PageKey> in_flight = PromptKeys(spec, 2, 3);
  const std::vector<core::PageKey> damaged = PromptKeys(spec, 3, 4);
  const std::vector<core::PageKey> torn = PromptKeys(spec, 4, 2);
  core::SlotRef damaged_slot;
  core::SlotRef torn_slot;
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(spec);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    first.Backup(*ns, whole);
    first.Backup(*ns, in_flight, /*commit=*/false);
    first.Backup(*ns, damaged);
    first.Backup(*ns, torn);
    damaged_slot = first.SlotOf(*ns, damaged[1], 0);
    torn_slot = first.SlotOf(*ns, torn[0], 0);
  }
  // A byte of the second damaged page changes after its checksum (a stray writer), and the
  // first torn page's record loses its last store.
  shared.pool[damaged_slot.region * kRegionBytes + damaged_slot.index * kObjectBytes + 100] ^= 1;
  const uint64_t max_slots = kRegionBytes / kObjectBytes;
  const uint64_t rec = core::SlotJournal::kHeaderBytes + core::SlotJournal::kNamespaceLogBytes +
                       (torn_slot.region * max_slots + torn_slot.index) *
                           core::SlotJournal::kRecordBytes;
  shared.journal[rec + 24] ^= 0xff;  // Its payload checksum, after the record's own.

  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.dropped_in_flight, 3u);
  EXPECT_EQ(stats.dropped_checksum, 1u);
  EXPECT_EQ(stats.dropped_torn, 1u);
  // Under the damaged page: 2 orphans; under the torn one: 1.
  EXPECT_EQ(stats.dropped_orphan, 3u);
  EXPECT_EQ(stats.pages, 6u + 1);
  std::shared_ptr<Namespace> ns = second.namespaces().ById(1);
  ExpectServed(second, *ns, whole);
  core::MatchOptions m;
  absl::StatusOr<core::MatchResult> r = ns->index()->Match(damaged, m);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->l2_pages, 1u);  // The page before the damaged one only.
  r = ns->index()->Match(in_flight, m);
  EXPECT_EQ(r->l2_pages, 0u);
  r = ns->index()->Match(torn, m);
  EXPECT_EQ(r->l2_pages, 0u);
  // Every dropped slot is free again: only the 7 recovered objects hold the pool.
  EXPECT_EQ(second.l2().UsedBytes(), 7 * kObjectBytes);
  // Only they are charged to the tenant: the dropped ones were freed uncharged.
  EXPECT_EQ(second.tenants().ForTenant(spec.tenant)->used_bytes(), 7 * kObjectBytes);
  // And their records are gone: a third life recovers exactly the same pages.
  Life third(shared, /*attach=*/true);
  const L2RecoveryStats again = third.Recover();
  EXPECT_EQ(again.pages, 7u);
  EXPECT_EQ(again.dropped(), 0u);
}

TEST(L2RecoveryTest, AFreedSlotsPageNeverComesBack) {
  Shared shared;
  const core::NamespaceSpec spec = NsSpec(1);
  const std::vector<core::PageKey> keys = PromptKeys(spec, 1, 4);
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(spec);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    first.Backup(*ns, keys);
    // Evict the last two pages (leaf first); their slots go back to the pool.
    std::vector<core::ReleasedObject> evicted;
    ASSERT_EQ(ns->index()->EvictPages(2, &evicted), 2u);
    first.l2().FreeReleased(evicted);
    // One of those slots is taken by another page, written and committed.
    first.Backup(*ns, PromptKeys(spec, 2, 1));
  }
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.pages, 3u);
  EXPECT_EQ(stats.dropped(), 0u);
  std::shared_ptr<Namespace> ns = second.namespaces().ById(1);
  core::MatchOptions m;
  EXPECT_EQ(ns->index()->Match(keys, m)->l2_pages, 2u);
  ExpectServed(second, *ns, PromptKeys(spec, 2, 1));
}

TEST(L2RecoveryTest, ANamespaceWhoseLogEntryIsLostDropsItsPagesAndLaterOnes) {
  Shared shared;
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(NsSpec(1));
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    first.Backup(*ns, PromptKeys(NsSpec(1), 1, 3));
  }
  // The first log entry's payload damaged.
  shared.journal[core::SlotJournal::kHeaderBytes + 16 + 4] ^= 0xff;
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.namespaces, 0u);
  EXPECT_EQ(stats.pages, 0u);
  EXPECT_EQ(stats.dropped_mismatch, 3u);
  EXPECT_EQ(second.l2().UsedBytes(), 0u);
}

// A namespace's geometry fixed anew (nothing held the old one) while a write-back still held
// evicted slots of the old geometry: those records name the old epoch and are never read as
// pages of the new geometry, though their lengths agree.
TEST(L2RecoveryTest, PagesOfAnEarlierGeometryAreNotRecoveredUnderTheNextOne) {
  Shared shared;
  const core::NamespaceSpec spec = NsSpec(1);
  const std::vector<core::PageKey> old_pages = PromptKeys(spec, 1, 3);
  const std::vector<core::PageKey> new_pages = PromptKeys(spec, 2, 2);
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(spec);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    first.Backup(*ns, old_pages);
    std::vector<core::ReleasedObject> held;  // Kept, as a write-back keeps evicted slots.
    ASSERT_EQ(ns->index()->EvictPages(3, &held), 3u);
    ns->ReleaseLayout();
    // Four layers of half the bytes: the same object size, another meaning.
    ASSERT_TRUE(ns->AdoptLayout(TestLayout(2 * kLayers, kBytesPerBlock / 2)).ok());
    EXPECT_EQ(ns->object_bytes(), kObjectBytes);
    EXPECT_EQ(ns->geometry_epoch(), 2u);
    first.Backup(*ns, new_pages);
  }
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.pages, 2u);
  EXPECT_EQ(stats.dropped_mismatch, 3u);
  std::shared_ptr<Namespace> ns = second.namespaces().ById(1);
  EXPECT_EQ(ns->geometry_epoch(), 2u);
  ExpectServed(second, *ns, new_pages);
  core::MatchOptions m;
  EXPECT_EQ(ns->index()->Match(old_pages, m)->l2_pages, 0u);
  // The restored geometry is the second one.
  EXPECT_FALSE(ns->AdoptLayout(TestLayout()).ok());
  EXPECT_TRUE(ns->AdoptLayout(TestLayout(2 * kLayers, kBytesPerBlock / 2)).ok());
}

// A daemon killed before its sealer reached a page leaves the record LANDED: whole bytes, no
// checksum. It is not served: dropped as unsealed, and so are the pages under it.
TEST(L2RecoveryTest, PagesLandedButNotSealedAreDropped) {
  Shared shared;
  const core::NamespaceSpec spec = NsSpec(1);
  const std::vector<core::PageKey> keys = PromptKeys(spec, 1, 5);
  core::SlotRef third;
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(spec);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    first.Backup(*ns, keys);
    third = first.SlotOf(*ns, keys[2], 0);
  }
  {
    // What the record of page 2 would be had the daemon died before sealing it.
    std::unique_ptr<core::HostPool> pool =
        *core::HostPool::Create(PoolOptions(), {shared.pool, kPoolBytes});
    auto journal = core::SlotJournal::Attach(core::SlotJournalGeometry::Of(*pool),
                                             {shared.journal, shared.journal_bytes});
    ASSERT_TRUE(journal.ok());
    (*journal)->MarkLanded(third, kObjectBytes);
  }
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.dropped_unsealed, 1u);
  EXPECT_EQ(stats.dropped_orphan, 2u);
  EXPECT_EQ(stats.pages, 2u);
  core::MatchOptions m;
  EXPECT_EQ(second.namespaces().ById(1)->index()->Match(keys, m)->l2_pages, 2u);
}

// The sealer keeps up in the background; the pages a life backed up are sealed before it ends
// (a SIGTERM's clean stop) and all come back.
TEST(L2RecoveryTest, TheSealerSealsEveryLandedPageByTheEnd) {
  Shared shared;
  const core::NamespaceSpec spec = NsSpec(2);
  {
    Life first(shared, /*attach=*/false);
    std::shared_ptr<Namespace> ns = first.namespaces().GetOrCreate(spec);
    ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
    for (uint32_t p = 0; p < 8; ++p) first.Backup(*ns, PromptKeys(spec, p, 10));
    const L2Sealer* sealer = first.l2().sealer();
    ASSERT_NE(sealer, nullptr);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (sealer->sealed() < 8 * 10 * 2 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(sealer->sealed(), 160u);
    EXPECT_EQ(sealer->pending(), 0u);
  }
  Life second(shared, /*attach=*/true);
  const L2RecoveryStats stats = second.Recover();
  EXPECT_EQ(stats.pages, 80u);
  EXPECT_EQ(stats.dropped(), 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
