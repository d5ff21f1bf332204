// Region release (server/l2/l2_space.h): two models whose page objects need different host-pool
// size classes share one pool. A real CacheServiceImpl on the sim device, as in
// cache_service_test.cc.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/server/cache_test_harness.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::Each;
using ::testing::Eq;
using ::testing::HasSubstr;

// Model B: 4x the bytes per block, so 64 KiB objects, the harness pool's second class
// (16 slots per 1 MiB region) while model A's 16 KiB objects take the first (64 per region).
constexpr uint64_t kBigBytesPerBlock = 4 * kBytesPerBlock;
constexpr uint32_t kPromptPages = 16;

core::RadixIndex* IndexOf(CacheHarness& h, const std::string& model) {
  for (const auto& ns : h.cache().namespaces().Snapshot()) {
    if (ns->spec().model_id == model) return ns->index();
  }
  return nullptr;
}

class RegionReleaseTest : public ::testing::Test {
 protected:
  RegionReleaseTest() : h_(Options()), a_(64, false, 1), b_(64, false, 2, kBigBytesPerBlock) {
    h_.Register(a_, "inst-a", 0, spec_a_);
    h_.Register(b_, "inst-b", 0, spec_b_);
    scheduler_a_ = h_.RegisterScheduler("sched-a", spec_a_);
    scheduler_b_ = h_.RegisterScheduler("sched-b", spec_b_);
  }

  static HarnessOptions Options() {
    HarnessOptions o;
    o.pool_bytes = 4 * kRegionBytes;
    o.high_watermark = 1.0;  // Only a full pool evicts here.
    o.low_watermark = 0.99;
    return o;
  }

  // Backs up prompt `p` (kPromptPages pages) of `engine`; returns the page statuses.
  std::vector<int> BackupPrompt(TestEngine& engine, const v1::NamespaceSpec& spec, uint32_t p) {
    const auto keys = CacheHarness::Keys(spec, Tokens(p, kPromptPages));
    v1::BackupResponse b =
        h_.Backup(engine.session, keys, 0, kPromptPages, Blocks(0, kPromptPages));
    v1::OpResult done = h_.Wait(engine.session, b.op().op_id());
    return done.sequences_size() == 1 ? Statuses(done.sequences(0)) : std::vector<int>{};
  }

  void ExpectConsistent() {
    for (const char* model : {"model-a", "model-b"}) {
      core::RadixIndex* index = IndexOf(h_, model);
      ASSERT_NE(index, nullptr);
      EXPECT_TRUE(index->CheckInvariants().ok()) << model << ": " << index->CheckInvariants();
    }
    EXPECT_EQ(h_.PoolSlotsUsed(), h_.IndexStats().l2_objects) << "every evicted slot was freed";
  }

  std::vector<uint32_t> RegionsPerClass() {
    std::vector<uint32_t> out;
    for (const core::SizeClassStats& s : h_.pool().Stats()) out.push_back(s.regions);
    return out;
  }

  const v1::NamespaceSpec spec_a_ = Spec(1, false, false, "model-a");
  const v1::NamespaceSpec spec_b_ = Spec(1, false, false, "model-b");
  CacheHarness h_;
  TestEngine a_;
  TestEngine b_;
  uint64_t scheduler_a_ = 0;
  uint64_t scheduler_b_ = 0;
};

TEST_F(RegionReleaseTest, SecondModelGetsWholeRegionsAndPinnedPagesSurvive) {
  // Model A fills the pool: 16 prompts of 16 pages, 4 prompts per region.
  for (uint32_t p = 0; p < 16; ++p) {
    ASSERT_THAT(BackupPrompt(a_, spec_a_, 100 + p), Each(Eq(v1::PAGE_STATUS_OK))) << p;
  }
  ASSERT_EQ(RegionsPerClass(), (std::vector<uint32_t>{4, 0}));
  // Pin prompt 0: its region holds pages that must not go, so it must not be released.
  v1::MatchRequest match;
  match.set_session_id(scheduler_a_);
  match.set_pin(true);
  const std::vector<uint32_t> pinned = Tokens(100, kPromptPages);
  match.add_sequences()->mutable_token_ids()->Add(pinned.begin(), pinned.end());
  v1::MatchResponse m;
  ASSERT_TRUE(h_.Match(match, &m).ok());
  ASSERT_EQ(m.results(0).l2_hit_pages(), kPromptPages);

  // Model B backs up: before region release every page was NO_SPACE.
  EXPECT_THAT(BackupPrompt(b_, spec_b_, 200), Each(Eq(v1::PAGE_STATUS_OK)));
  EXPECT_EQ(RegionsPerClass(), (std::vector<uint32_t>{3, 1}));
  EXPECT_THAT(BackupPrompt(b_, spec_b_, 201), Each(Eq(v1::PAGE_STATUS_OK)));
  // Now at its fair share (2 of 4 regions): B makes room within itself from here on.
  EXPECT_EQ(RegionsPerClass(), (std::vector<uint32_t>{2, 2}));
  EXPECT_THAT(BackupPrompt(b_, spec_b_, 202), Each(Eq(v1::PAGE_STATUS_OK)));
  EXPECT_EQ(RegionsPerClass(), (std::vector<uint32_t>{2, 2}));
  EXPECT_EQ(h_.L2Hits(scheduler_b_, Tokens(202, kPromptPages)), kPromptPages);
  EXPECT_EQ(h_.L2Hits(scheduler_b_, Tokens(201, kPromptPages)), kPromptPages);
  ExpectConsistent();

  // No collateral eviction: exactly two regions' pages of A went (whole prompts, each inside
  // one region), the pinned prompt's region was left alone.
  core::RadixIndex* index_a = IndexOf(h_, "model-a");
  EXPECT_EQ(index_a->Stats().evicted_pages, 2 * kSlotsPerRegion);
  EXPECT_EQ(index_a->Stats().l2_pages, 2 * kSlotsPerRegion);
  for (uint32_t p = 0; p < 4; ++p) {
    EXPECT_EQ(h_.L2Hits(scheduler_a_, Tokens(100 + p, kPromptPages)), kPromptPages) << p;
  }
  uint32_t surviving = 0;
  for (uint32_t p = 0; p < 16; ++p) {
    const uint32_t hits = h_.L2Hits(scheduler_a_, Tokens(100 + p, kPromptPages));
    EXPECT_TRUE(hits == 0 || hits == kPromptPages) << "prompt " << p << " was cut: " << hits;
    surviving += hits == kPromptPages;
  }
  EXPECT_EQ(surviving, 8u);
  EXPECT_THAT(h_.registry().Scrape(),
              HasSubstr("kvcellar_evicted_pages_total{reason=\"region_release\"} 128"));
  EXPECT_EQ(h_.cache().l2().regions_released(), 2u);

  // A, at its share too, evicts its own pages and keeps serving; B keeps its regions.
  EXPECT_THAT(BackupPrompt(a_, spec_a_, 300), Each(Eq(v1::PAGE_STATUS_OK)));
  EXPECT_EQ(RegionsPerClass(), (std::vector<uint32_t>{2, 2}));
  EXPECT_EQ(h_.L2Hits(scheduler_a_, pinned), kPromptPages) << "pinned pages are never evicted";
  ExpectConsistent();
}

TEST_F(RegionReleaseTest, RegionHoldingOnlyBusyPagesIsNotReleased) {
  // A fills one region and pins all of it; the rest of the pool is free.
  for (uint32_t p = 0; p < 4; ++p) {
    ASSERT_THAT(BackupPrompt(a_, spec_a_, 100 + p), Each(Eq(v1::PAGE_STATUS_OK)));
  }
  for (uint32_t p = 0; p < 4; ++p) {
    v1::MatchRequest match;
    match.set_session_id(scheduler_a_);
    match.set_pin(true);
    const std::vector<uint32_t> t = Tokens(100 + p, kPromptPages);
    match.add_sequences()->mutable_token_ids()->Add(t.begin(), t.end());
    v1::MatchResponse m;
    ASSERT_TRUE(h_.Match(match, &m).ok());
  }
  // B takes the three free regions, then (at 3 of 4, above its share) evicts its own pages.
  for (uint32_t p = 0; p < 6; ++p) {
    EXPECT_THAT(BackupPrompt(b_, spec_b_, 200 + p), Each(Eq(v1::PAGE_STATUS_OK))) << p;
  }
  EXPECT_EQ(RegionsPerClass(), (std::vector<uint32_t>{1, 3}));
  for (uint32_t p = 0; p < 4; ++p) {
    EXPECT_EQ(h_.L2Hits(scheduler_a_, Tokens(100 + p, kPromptPages)), kPromptPages);
  }
  EXPECT_EQ(h_.cache().l2().regions_released(), 0u);
  ExpectConsistent();
}

}  // namespace
}  // namespace kvcellar::server::testing
