// Tests for core/lru_policy.h and core/s3fifo_policy.h: ordering, parking, amortized cost, and
// scan resistance measured end to end through the radix index.
#include "core/eviction_policy.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "core/lru_policy.h"
#include "core/radix_index.h"
#include "core/s3fifo_policy.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

// Pages as the policy sees them: hooks plus the index's answers, decided by the test.
class FakePages final : public EvictionCandidates {
 public:
  explicit FakePages(size_t n) : hooks_(n), eligible_(n, true) {}

  EvictionHook* hook(size_t i) { return &hooks_[i]; }
  size_t Index(const EvictionHook* h) const { return static_cast<size_t>(h - hooks_.data()); }
  void SetEligible(size_t i, bool e) { eligible_[i] = e; }
  size_t checks() const { return checks_; }

  bool Evictable(const EvictionHook& h) const override {
    ++checks_;
    return eligible_[Index(&h)];
  }
  uint64_t Fingerprint(const EvictionHook& h) const override { return 1000 + Index(&h); }

 private:
  std::vector<EvictionHook> hooks_;
  std::vector<bool> eligible_;
  mutable size_t checks_ = 0;
};

// Victim indices until the policy has none left.
std::vector<size_t> Drain(EvictionPolicy& p, FakePages& pages, size_t max = 1000) {
  std::vector<size_t> out;
  while (out.size() < max) {
    EvictionHook* h = p.PickVictim(pages);
    if (h == nullptr) break;
    EXPECT_EQ(h->queue, 0);
    out.push_back(pages.Index(h));
  }
  return out;
}

TEST(LruPolicyTest, EvictsLeastRecentlyUsedFirst) {
  LruPolicy lru;
  FakePages pages(4);
  for (size_t i = 0; i < 4; ++i) lru.OnInsert(pages.hook(i), 1000 + i);
  lru.OnAccess(pages.hook(0));
  lru.OnAccess(pages.hook(2));
  EXPECT_EQ(Drain(lru, pages), (std::vector<size_t>{1, 3, 0, 2}));
  EXPECT_EQ(lru.Tracked(), 0u);
  EXPECT_TRUE(lru.CheckConsistency().ok());
}

TEST(LruPolicyTest, ParksIneligiblePagesUntilTheyBecomeEligible) {
  LruPolicy lru;
  FakePages pages(3);
  for (size_t i = 0; i < 3; ++i) lru.OnInsert(pages.hook(i), 0);
  pages.SetEligible(0, false);
  EXPECT_EQ(Drain(lru, pages, 1), (std::vector<size_t>{1}));
  EXPECT_TRUE(lru.Parked(*pages.hook(0)));
  EXPECT_EQ(lru.Tracked(), 2u);
  // Parked pages are not offered again; the policy has only page 2 to give.
  EXPECT_EQ(Drain(lru, pages), (std::vector<size_t>{2}));
  pages.SetEligible(0, true);
  lru.OnEligible(pages.hook(0));
  EXPECT_FALSE(lru.Parked(*pages.hook(0)));
  EXPECT_EQ(Drain(lru, pages), (std::vector<size_t>{0}));
}

TEST(LruPolicyTest, PageHitWhileParkedReturnsAtTheHead) {
  LruPolicy lru;
  FakePages pages(3);
  for (size_t i = 0; i < 3; ++i) lru.OnInsert(pages.hook(i), 0);
  pages.SetEligible(0, false);
  pages.SetEligible(1, false);
  pages.SetEligible(2, false);
  EXPECT_EQ(lru.PickVictim(pages), nullptr);  // All parked.
  lru.OnAccess(pages.hook(0));                // Hit while parked.
  for (size_t i = 0; i < 3; ++i) {
    pages.SetEligible(i, true);
    lru.OnEligible(pages.hook(i));
  }
  // 1 and 2 were untouched: back at the tail (in unpark order); 0 at the head.
  EXPECT_EQ(Drain(lru, pages), (std::vector<size_t>{2, 1, 0}));
}

TEST(LruPolicyTest, RemoveWorksOnQueuedAndParkedPages) {
  LruPolicy lru;
  FakePages pages(3);
  for (size_t i = 0; i < 3; ++i) lru.OnInsert(pages.hook(i), 0);
  pages.SetEligible(0, false);
  EXPECT_EQ(Drain(lru, pages, 1), (std::vector<size_t>{1}));
  lru.OnRemove(pages.hook(0));  // Parked.
  lru.OnRemove(pages.hook(2));  // Queued.
  EXPECT_EQ(lru.Tracked(), 0u);
  EXPECT_EQ(pages.hook(0)->queue, 0);
  EXPECT_TRUE(lru.CheckConsistency().ok());
}

TEST(S3FifoPolicyTest, OneHitPagesLeaveFromSmallIntoTheGhost) {
  S3FifoPolicy s3;
  FakePages pages(10);
  for (size_t i = 0; i < 10; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  EXPECT_EQ(s3.small_size(), 10u);
  EXPECT_EQ(Drain(s3, pages, 2), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(s3.ghost_size(), 2u);
  // Back soon after its eviction: it goes straight to the main queue.
  s3.OnInsert(pages.hook(0), 1000);
  EXPECT_EQ(s3.main_size(), 1u);
  EXPECT_EQ(s3.ghost_size(), 1u);
  EXPECT_TRUE(s3.CheckConsistency().ok());
}

TEST(S3FifoPolicyTest, GhostEntriesAgeOutAfterTheGhostCapacityOfEvictions) {
  S3FifoPolicy s3;
  constexpr size_t kN = 100;  // Peak 100 tracked pages: the ghost remembers 90 evictions.
  FakePages pages(kN);
  for (size_t i = 0; i < kN; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  EXPECT_EQ(Drain(s3, pages).size(), kN);  // Evicted in order 0..99.
  EXPECT_EQ(s3.ghost_size(), 90u);
  // Page 5 was followed by 94 evictions: forgotten. Page 50, by 49: remembered.
  s3.OnInsert(pages.hook(5), 1000 + 5);
  s3.OnInsert(pages.hook(50), 1000 + 50);
  EXPECT_EQ(s3.small_size(), 1u);
  EXPECT_EQ(s3.main_size(), 1u);
  EXPECT_TRUE(s3.CheckConsistency().ok());
}

TEST(S3FifoPolicyTest, PagesHitTwicePromoteToMain) {
  S3FifoPolicy s3;
  FakePages pages(10);
  for (size_t i = 0; i < 10; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  s3.OnAccess(pages.hook(0));
  s3.OnAccess(pages.hook(0));  // freq 2: promoted at the tail of S.
  s3.OnAccess(pages.hook(1));  // freq 1: not enough.
  EXPECT_EQ(Drain(s3, pages, 1), (std::vector<size_t>{1}));
  EXPECT_EQ(s3.main_size(), 1u);
  EXPECT_EQ(pages.hook(0)->freq, 0);  // Reset on the move, as libCacheSim does.
}

TEST(S3FifoPolicyTest, MainReinsertsWhileFrequencyLastsAndCapsAtThree) {
  S3FifoPolicy s3;
  FakePages pages(10);
  for (size_t i = 0; i < 10; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  // Pages 0 and 1 go through the ghost into M; the rest leave, so eviction works on M.
  EXPECT_EQ(Drain(s3, pages, 2), (std::vector<size_t>{0, 1}));
  for (size_t i = 0; i < 2; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  for (size_t i = 2; i < 10; ++i) s3.OnRemove(pages.hook(i));
  EXPECT_EQ(s3.main_size(), 2u);
  EXPECT_EQ(s3.small_size(), 0u);
  for (int k = 0; k < 10; ++k) s3.OnAccess(pages.hook(0));
  EXPECT_EQ(pages.hook(0)->freq, S3FifoPolicy::kMaxFreq);
  // Page 0 (tail, freq 3) is reinserted with freq 2; page 1 (freq 0) goes first.
  EXPECT_EQ(Drain(s3, pages, 1), (std::vector<size_t>{1}));
  EXPECT_EQ(pages.hook(0)->freq, 2);
  EXPECT_EQ(Drain(s3, pages), (std::vector<size_t>{0}));
  EXPECT_TRUE(s3.CheckConsistency().ok());
}

TEST(S3FifoPolicyTest, ParkedPagesReturnToTheTailOfTheirQueue) {
  S3FifoPolicy s3;
  FakePages pages(4);
  for (size_t i = 0; i < 4; ++i) s3.OnInsert(pages.hook(i), 1000 + i);
  pages.SetEligible(0, false);
  EXPECT_EQ(Drain(s3, pages, 1), (std::vector<size_t>{1}));
  EXPECT_TRUE(s3.Parked(*pages.hook(0)));
  pages.SetEligible(0, true);
  s3.OnEligible(pages.hook(0));
  EXPECT_EQ(Drain(s3, pages, 1), (std::vector<size_t>{0}));
  s3.OnRemove(pages.hook(3));
  EXPECT_EQ(s3.Tracked(), 1u);
  EXPECT_TRUE(s3.CheckConsistency().ok());
}

// A chain inserted root first where only the current leaf is evictable: each victim makes its
// parent the new leaf. Requeueing would cost O(n) checks per victim; parking costs O(1).
class ChainCostTest : public ::testing::TestWithParam<EvictionPolicyKind> {};

TEST_P(ChainCostTest, EvictingAChainLeafFirstIsLinear) {
  std::unique_ptr<EvictionPolicy> p = MakeEvictionPolicy(GetParam());
  constexpr size_t kN = 10'000;
  FakePages pages(kN);
  for (size_t i = 0; i < kN; ++i) {
    p->OnInsert(pages.hook(i), 1000 + i);
    pages.SetEligible(i, i == kN - 1);
  }
  for (size_t leaf = kN; leaf-- > 0;) {
    EvictionHook* h = p->PickVictim(pages);
    ASSERT_NE(h, nullptr);
    ASSERT_EQ(pages.Index(h), leaf);
    if (leaf > 0) {
      pages.SetEligible(leaf - 1, true);
      p->OnEligible(pages.hook(leaf - 1));
    }
  }
  EXPECT_EQ(p->Tracked(), 0u);
  EXPECT_LE(pages.checks(), 3 * kN);
}

INSTANTIATE_TEST_SUITE_P(Policies, ChainCostTest,
                         ::testing::Values(EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                           EvictionPolicyKind::kAdaptive),
                         [](const auto& info) {
                           return std::string(EvictionPolicyKindName(info.param));
                         });

// --- Scan resistance, end to end through the index ----------------------------------------------

PageKey ScanKey(uint64_t id) {
  PageKey k;
  const uint64_t mixed = id * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
  std::memcpy(k.bytes.data(), &mixed, sizeof(mixed));
  std::memcpy(k.bytes.data() + 8, &id, sizeof(id));
  return k;
}

// Fraction of the hot set still in L2 after: a hot set of 20 prompts x 10 pages matched 3 times,
// then a one-pass scan of 300 new prompts x 10 pages (3x the 1000-page cache), each inserted and
// then evicted back down to capacity, as the server does under pressure.
double HotSetKeptAfterScan(EvictionPolicyKind kind) {
  constexpr int kCapacityPages = 1000;
  constexpr int kPagesPerPrompt = 10;
  constexpr int kHotPrompts = 20;
  constexpr int kScanPrompts = 300;
  RadixIndexOptions o;
  o.object_bytes = 1;
  o.policy = kind;
  auto index = std::move(*RadixIndex::Create(o));
  uint32_t slot = 0;
  auto insert_prompt = [&](uint64_t base) {
    std::vector<PageKey> keys;
    std::optional<PageKey> parent;
    for (int i = 0; i < kPagesPerPrompt; ++i) {
      const PageKey k = ScanKey(base + i);
      EXPECT_TRUE(index->BeginWrite(WriteRequest{k, parent, 0, SlotRef{0, 0, slot++}}).ok());
      EXPECT_TRUE(index->Commit({k, 0}).ok());
      keys.push_back(k);
      parent = k;
    }
    std::vector<ReleasedObject> evicted;
    const uint64_t pages = index->Stats().l2_pages;
    if (pages > kCapacityPages) index->EvictPages(pages - kCapacityPages, &evicted);
    return keys;
  };
  std::vector<std::vector<PageKey>> hot;
  for (int p = 0; p < kHotPrompts; ++p) hot.push_back(insert_prompt(1'000'000 + p * 100));
  for (int round = 0; round < 3; ++round) {
    for (const auto& keys : hot) EXPECT_EQ(index->Match(keys, MatchOptions{})->l2_pages, 10u);
  }
  for (int p = 0; p < kScanPrompts; ++p) insert_prompt(5'000'000 + p * 100);
  EXPECT_TRUE(index->CheckInvariants().ok());
  EXPECT_LE(index->Stats().l2_pages, static_cast<uint64_t>(kCapacityPages));
  int kept = 0;
  for (const auto& keys : hot) {
    for (const PageKey& k : keys) {
      auto info = index->Inspect(k);
      kept += info.has_value() && info->shards[0].l2 == L2State::kResident;
    }
  }
  return static_cast<double>(kept) / (kHotPrompts * kPagesPerPrompt);
}

TEST(ScanResistanceTest, S3FifoKeepsTheHotSetAndLruLosesIt) {
  const double s3fifo = HotSetKeptAfterScan(EvictionPolicyKind::kS3Fifo);
  const double lru = HotSetKeptAfterScan(EvictionPolicyKind::kLru);
  const double adaptive = HotSetKeptAfterScan(EvictionPolicyKind::kAdaptive);
  std::printf("hot set kept after a 3x scan: s3fifo=%.3f lru=%.3f adaptive=%.3f\n", s3fifo, lru,
              adaptive);
  EXPECT_GE(s3fifo, 0.9) << "S3-FIFO lost the hot set to a one-pass scan";
  EXPECT_GE(adaptive, 0.9) << "the adaptive policy lost the hot set to a one-pass scan";
  EXPECT_LE(lru, 0.1) << "LRU unexpectedly kept the hot set through a scan 3x the cache";
}

}  // namespace
}  // namespace kvcellar::core
