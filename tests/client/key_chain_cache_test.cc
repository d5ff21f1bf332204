// Tests client/key_chain_cache.h: every key it hands out is the key core::ComputePageKeys gives,
// whatever was cached before; a growing conversation hashes only its new pages.
#include "client/key_chain_cache.h"

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcellar::client {
namespace {

constexpr uint32_t kPage = 16;

core::PageKey Root() {
  core::PageKey k;
  for (size_t i = 0; i < k.bytes.size(); ++i) k.bytes[i] = static_cast<uint8_t>(i * 7 + 1);
  return k;
}

std::vector<uint32_t> Random(size_t n, std::mt19937& rng) {
  std::vector<uint32_t> t(n);
  for (uint32_t& v : t) v = rng() % 128256;
  return t;
}

std::vector<core::PageKey> Reference(const std::vector<uint32_t>& tokens) {
  return core::ComputePageKeys(Root(), tokens, kPage);
}

TEST(KeyChainCacheTest, AGrowingConversationHashesOnlyItsNewPages) {
  KeyChainCache cache(Root(), kPage, size_t{16} << 20);
  std::mt19937 rng(1);
  std::vector<uint32_t> conversation = Random(100 * kPage + 5, rng);  // Plus a partial page.
  size_t reused = 99;
  EXPECT_EQ(cache.Keys(conversation, &reused), Reference(conversation));
  EXPECT_EQ(reused, 0u);
  for (int turn = 0; turn < 5; ++turn) {
    const size_t before_pages = conversation.size() / kPage;
    const std::vector<uint32_t> more = Random(37 * kPage + 3, rng);
    conversation.insert(conversation.end(), more.begin(), more.end());
    EXPECT_EQ(cache.Keys(conversation, &reused), Reference(conversation)) << "turn " << turn;
    EXPECT_EQ(reused, before_pages) << "every full page of the previous turn is reused";
  }
  const KeyChainCache::Stats s = cache.stats();
  EXPECT_EQ(s.entries, 1u) << "each turn replaced the previous one";
  EXPECT_EQ(s.pages_hashed, conversation.size() / kPage);
  // The previous turn, asked again (a retry), is a prefix: all reused, nothing added.
  std::vector<uint32_t> earlier(conversation.begin(), conversation.begin() + 120 * kPage);
  EXPECT_EQ(cache.Keys(earlier, &reused), Reference(earlier));
  EXPECT_EQ(reused, 120u);
  EXPECT_EQ(cache.stats().entries, 1u);
}

TEST(KeyChainCacheTest, ReuseStopsAtTheFirstPageWhoseTokensDiffer) {
  KeyChainCache cache(Root(), kPage, size_t{16} << 20);
  std::mt19937 rng(2);
  const std::vector<uint32_t> a = Random(50 * kPage, rng);
  std::vector<uint32_t> b = a;
  b[20 * kPage + 9] ^= 1;  // One token of page 20.
  size_t reused = 0;
  EXPECT_EQ(cache.Keys(a), Reference(a));
  EXPECT_EQ(cache.Keys(b, &reused), Reference(b));
  EXPECT_EQ(reused, 20u);
  EXPECT_NE(Reference(a)[20], Reference(b)[20]);
  // Both branches are kept: each is found again whole.
  EXPECT_EQ(cache.Keys(a, &reused), Reference(a));
  EXPECT_EQ(reused, 50u);
  EXPECT_EQ(cache.Keys(b, &reused), Reference(b));
  EXPECT_EQ(reused, 50u);
  EXPECT_EQ(cache.stats().entries, 2u);
  // A different first page shares nothing, even with the same later pages.
  std::vector<uint32_t> c = a;
  c[0] ^= 1;
  EXPECT_EQ(cache.Keys(c, &reused), Reference(c));
  EXPECT_EQ(reused, 0u);
}

TEST(KeyChainCacheTest, TheBudgetEvictsTheLeastRecentlyUsed) {
  std::mt19937 rng(3);
  // One 10-page sequence holds 10 * (16 * 4 + 32) = 960 bytes: the budget holds two.
  KeyChainCache cache(Root(), kPage, 2000);
  const std::vector<uint32_t> a = Random(10 * kPage, rng), b = Random(10 * kPage, rng),
                              c = Random(10 * kPage, rng);
  size_t reused = 0;
  cache.Keys(a);
  cache.Keys(b);
  cache.Keys(a);  // a is now the most recent.
  cache.Keys(c);  // b leaves.
  EXPECT_EQ(cache.stats().entries, 2u);
  EXPECT_LE(cache.stats().bytes, 2000u);
  EXPECT_EQ(cache.Keys(a, &reused), Reference(a));
  EXPECT_EQ(reused, 10u);
  EXPECT_EQ(cache.Keys(b, &reused), Reference(b));
  EXPECT_EQ(reused, 0u) << "b was evicted";
  // A sequence larger than the whole budget is keyed but not kept.
  const std::vector<uint32_t> big = Random(100 * kPage, rng);
  EXPECT_EQ(cache.Keys(big), Reference(big));
  EXPECT_EQ(cache.Keys(big, &reused), Reference(big));
  EXPECT_EQ(reused, 0u);
  EXPECT_LE(cache.stats().bytes, 2000u);
}

TEST(KeyChainCacheTest, ZeroBytesCachesNothingAndShortInputsHaveNoKeys) {
  std::mt19937 rng(4);
  KeyChainCache off(Root(), kPage, 0);
  const std::vector<uint32_t> a = Random(30 * kPage, rng);
  size_t reused = 7;
  EXPECT_EQ(off.Keys(a), Reference(a));
  EXPECT_EQ(off.Keys(a, &reused), Reference(a));
  EXPECT_EQ(reused, 0u);
  EXPECT_EQ(off.stats().entries, 0u);
  KeyChainCache on(Root(), kPage, 1 << 20);
  EXPECT_TRUE(on.Keys(std::vector<uint32_t>(kPage - 1, 5)).empty());
  EXPECT_TRUE(on.Keys({}).empty());
  EXPECT_EQ(on.stats().entries, 0u);
}

TEST(KeyChainCacheTest, ConcurrentConversationsAllGetExactKeys) {
  KeyChainCache cache(Root(), kPage, 64 << 10);  // Small: evictions race with lookups.
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t % 2);  // Two pairs of threads share their conversations.
      std::vector<uint32_t> conversation;
      for (int turn = 0; turn < 40; ++turn) {
        const std::vector<uint32_t> more = Random((1 + rng() % 20) * kPage, rng);
        conversation.insert(conversation.end(), more.begin(), more.end());
        if (conversation.size() > 300 * kPage) conversation.resize(3 * kPage);
        if (cache.Keys(conversation) != Reference(conversation)) ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(cache.stats().bytes, size_t{64} << 10);
}

}  // namespace
}  // namespace kvcellar::client
