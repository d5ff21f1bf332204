// A randomized stress test of the data path with consistency checking: several engines of one
// namespace back up, match, pin, load and release concurrently through a pool too small for their
// prompts, so evictions race with every other operation. Every page's bytes are a function of its
// key; every block a Load reports OK must hold exactly those bytes (never another page's, never a
// torn mix), and at the end the index invariants hold and every pool slot is accounted for.
#include <random>
#include <thread>

#include "tests/server/cache_test_harness.h"

namespace kvcellar::server::testing {
namespace {

constexpr uint32_t kEngines = 3;
constexpr uint32_t kPrompts = 24;
constexpr uint32_t kMaxPages = 6;
constexpr int kIterations = 400;
constexpr uint32_t kBlocksPerEngine = 32;

uint32_t PageSeed(uint32_t prompt, uint32_t page) { return 1000 + prompt * 16 + page; }

// Writes page (prompt, page)'s bytes into `block` of `kv`, as the engine's forward pass would.
void WritePage(platform::SimEngineKvCache& kv, uint32_t block, uint32_t prompt, uint32_t page) {
  for (const core::PageSegment& s : core::PageSegments(kv.layout())) {
    gpu::testing::FillPattern(kv.Block(s.layer, s.buffer, block), s.bytes, PageSeed(prompt, page),
                              s.layer, s.buffer, 0);
  }
}

bool HoldsPage(platform::SimEngineKvCache& kv, uint32_t block, uint32_t prompt, uint32_t page) {
  for (const core::PageSegment& s : core::PageSegments(kv.layout())) {
    if (!gpu::testing::HoldsPattern(kv.Block(s.layer, s.buffer, block), s.bytes,
                                    PageSeed(prompt, page), s.layer, s.buffer, 0)) {
      return false;
    }
  }
  return true;
}

TEST(CacheStressTest, ConcurrentEnginesNeverLoadWrongBytes) {
  HarnessOptions o;
  o.pool_bytes = kRegionBytes;  // 64 slots for 24 prompts of up to 6 pages.
  o.high_watermark = 0.9;
  o.low_watermark = 0.7;
  o.housekeeping_interval = absl::Milliseconds(5);
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  std::vector<std::unique_ptr<TestEngine>> engines;
  for (uint32_t e = 0; e < kEngines; ++e) {
    engines.push_back(std::make_unique<TestEngine>(kBlocksPerEngine, false, e + 1));
    h.Register(*engines.back(), absl::StrCat("inst-", e), 0, spec);
  }
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<std::vector<core::PageKey>> keys;
  for (uint32_t p = 0; p < kPrompts; ++p) {
    tokens.push_back(Tokens(p, kMaxPages));
    keys.push_back(CacheHarness::Keys(spec, tokens.back()));
  }

  std::atomic<uint64_t> loaded_ok{0};
  std::atomic<uint64_t> wrong{0};
  std::atomic<uint64_t> rpc_errors{0};
  auto run = [&](uint32_t e) {
    TestEngine& engine = *engines[e];
    std::mt19937 rng(e * 7919 + 1);
    for (int it = 0; it < kIterations; ++it) {
      const uint32_t p = rng() % kPrompts;
      const uint32_t pages = 1 + rng() % kMaxPages;
      const uint32_t base = (rng() % 2) * 16;  // Two block ranges, alternating.
      if (rng() % 2 == 0) {
        for (uint32_t i = 0; i < pages; ++i) WritePage(engine.kv(), base + i, p, i);
        std::vector<uint32_t> blocks;
        for (uint32_t i = 0; i < pages; ++i) blocks.push_back(base + i);
        Rpc r;
        v1::BackupResponse b = h.Backup(engine.session, keys[p], 0, pages, blocks, &r);
        if (!r.ok()) {
          ++rpc_errors;
          continue;
        }
        h.Wait(engine.session, b.op().op_id());
        continue;
      }
      v1::MatchRequest match;
      match.set_session_id(engine.session);
      match.set_pin(rng() % 2 == 0);
      match.add_sequences()->mutable_token_ids()->Add(tokens[p].begin(),
                                                      tokens[p].begin() + pages * kPageSize);
      v1::MatchResponse m;
      if (!h.Match(match, &m).ok()) {
        ++rpc_errors;
        continue;
      }
      const uint32_t hit = m.results(0).l2_hit_pages();
      if (hit == 0) continue;
      v1::LoadRequest load;
      load.set_session_id(engine.session);
      load.set_signal_layers(true);
      load.set_completion_slot(it % TestEngine::kLoadSlots);
      v1::LoadSequence* seq = load.add_sequences();
      seq->set_page_keys(KeyBlob(keys[p], 0, hit));
      for (uint32_t i = 0; i < hit; ++i) seq->add_device_blocks(base + i);
      seq->set_pin_id(m.results(0).pin_id());
      seq->set_release_pin(true);
      v1::LoadResponse l;
      if (!h.Load(load, &l).ok()) {
        ++rpc_errors;
        continue;
      }
      v1::OpResult done = h.Wait(engine.session, l.op().op_id());
      if (done.state() != v1::OP_STATE_DONE) continue;
      // With a pin nothing may have been evicted in between; without one a page may miss.
      if (m.results(0).pin_id() != 0 && done.sequences(0).leading_ok_pages() != hit) ++wrong;
      for (uint32_t i = 0; i < done.sequences(0).leading_ok_pages(); ++i) {
        if (HoldsPage(engine.kv(), base + i, p, i)) {
          ++loaded_ok;
        } else {
          ++wrong;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (uint32_t e = 0; e < kEngines; ++e) threads.emplace_back(run, e);
  for (std::thread& t : threads) t.join();

  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(rpc_errors.load(), 0u);
  EXPECT_GT(loaded_ok.load(), 0u);
  EXPECT_GT(h.IndexStats().evicted_pages, 0u) << "the pool was meant to be under pressure";
  for (const auto& ns : h.cache().namespaces().Snapshot()) {
    ASSERT_NE(ns->index(), nullptr);
    EXPECT_TRUE(ns->index()->CheckInvariants().ok()) << ns->index()->CheckInvariants();
  }
  const core::RadixIndexStats stats = h.IndexStats();
  EXPECT_EQ(stats.l2_inflight_objects, 0u);
  EXPECT_EQ(stats.pinned_pages, 0u) << "every pin was released by its Load";
  EXPECT_EQ(h.PoolSlotsUsed(), stats.l2_objects);
  h.ClearIndexes();
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
