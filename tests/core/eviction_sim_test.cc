// Tests for core/eviction_sim.h: the bound against an exhaustive search, the index's policies
// against the bound, and the replay's own accounting.
#include "core/eviction_sim.h"

#include <algorithm>
#include <bit>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

// A random forest of `pages` ids (each page's parent an earlier page or none) and requests that
// each name the chain from a root to a random page.
Trace RandomForestTrace(std::mt19937& rng, int pages, int requests) {
  std::vector<int> parent(pages);
  for (int p = 0; p < pages; ++p) parent[p] = p == 0 ? -1 : static_cast<int>(rng() % (p + 1)) - 1;
  Trace trace;
  for (int r = 0; r < requests; ++r) {
    TraceRequest request;
    for (int p = static_cast<int>(rng() % pages); p >= 0; p = parent[p]) {
      request.pages.push_back(static_cast<uint64_t>(p));
    }
    std::reverse(request.pages.begin(), request.pages.end());
    request.tokens = request.pages.size();
    trace.requests.push_back(std::move(request));
  }
  return trace;
}

// The most hit pages any choice of what to keep after each request gets, over every subset of
// at most `capacity` pages (prefix-closed or not): a search over cache states.
uint64_t ExhaustiveBest(const Trace& trace, uint32_t capacity) {
  absl::flat_hash_map<uint32_t, uint64_t> best = {{0, 0}};  // Cache state -> most hits so far.
  for (const TraceRequest& request : trace.requests) {
    absl::flat_hash_map<uint32_t, uint64_t> next;
    uint32_t mask = 0;
    for (uint64_t id : request.pages) mask |= 1u << id;
    for (const auto& [state, hits] : best) {
      uint64_t hit = 0;
      while (hit < request.pages.size() && (state >> request.pages[hit] & 1) != 0) ++hit;
      const uint32_t all = state | mask;
      // Every subset of `all` that fits.
      for (uint32_t keep = all;; keep = (keep - 1) & all) {
        if (static_cast<uint32_t>(std::popcount(keep)) <= capacity) {
          uint64_t& h = next[keep];
          h = std::max(h, hits + hit);
        }
        if (keep == 0) break;
      }
    }
    best.swap(next);
  }
  uint64_t most = 0;
  for (const auto& [state, hits] : best) most = std::max(most, hits);
  return most;
}

TEST(EvictionSimTest, BeladyIsTheBestAnyEvictionOrderGetsOnSmallTraces) {
  std::mt19937 rng(11);
  int evicting = 0;
  for (int round = 0; round < 400; ++round) {
    const int pages = 2 + static_cast<int>(rng() % 7);  // Up to 8 ids.
    const Trace trace = RandomForestTrace(rng, pages, 2 + static_cast<int>(rng() % 7));
    const uint32_t capacity = 1 + rng() % 4;
    const SimResult belady = SimulateBelady(trace, capacity);
    ASSERT_EQ(belady.hit_tokens, ExhaustiveBest(trace, capacity)) << "round " << round;
    evicting += belady.evicted_pages > 0;
  }
  EXPECT_GE(evicting, 200);  // The bound is exercised under pressure, not only when all fits.
}

TEST(EvictionSimTest, NoPolicyBeatsTheBoundAndAllMeetTheBestCaseWhenEverythingFits) {
  std::mt19937 rng(5);
  for (int round = 0; round < 50; ++round) {
    const Trace trace = RandomForestTrace(rng, 60, 300);
    const uint64_t distinct = trace.DistinctPages();
    const SimResult best = SimulateUnbounded(trace);
    for (const uint64_t capacity : {distinct / 4, distinct / 2, distinct}) {
      const SimResult belady = SimulateBelady(trace, capacity);
      EXPECT_LE(belady.hit_tokens, best.hit_tokens);
      for (const EvictionPolicyKind kind :
           {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo}) {
        absl::StatusOr<SimResult> r = SimulateIndex(trace, kind, {capacity});
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_LE(r->hit_tokens, belady.hit_tokens) << "round " << round;
        EXPECT_EQ(r->tokens, best.tokens);
        if (capacity == distinct) {
          EXPECT_EQ(r->hit_tokens, best.hit_tokens);
          EXPECT_EQ(r->evicted_pages, 0u);
        }
      }
      if (capacity == distinct) {
        EXPECT_EQ(belady.hit_tokens, best.hit_tokens);
      }
    }
  }
}

TEST(EvictionSimTest, ACycleOneLargerThanTheCacheIsLrusWorstCaseAndNotBeladys) {
  // Five one-page sequences asked in turn, ten times, with room for four: LRU always evicts the
  // page asked next, so nothing ever hits. Belady gives up the page asked farthest ahead: 36 of
  // the 45 requests after the first round hit, the most any order gets.
  Trace trace;
  trace.page_size = 16;
  for (int round = 0; round < 10; ++round) {
    for (uint64_t s = 0; s < 5; ++s) trace.requests.push_back({{s}, 20});
  }
  absl::StatusOr<SimResult> lru = SimulateIndex(trace, EvictionPolicyKind::kLru, {4});
  ASSERT_TRUE(lru.ok()) << lru.status();
  EXPECT_EQ(lru->hit_tokens, 0u);
  EXPECT_EQ(lru->tokens, 50u * 20);
  EXPECT_EQ(lru->evicted_pages, 46u);
  const SimResult belady = SimulateBelady(trace, 4);
  EXPECT_EQ(belady.hit_tokens, 36u * 16);
  EXPECT_EQ(ExhaustiveBest(trace, 4), 36u);
  EXPECT_NEAR(belady.HitRate(), 36.0 * 16 / 1000, 1e-12);
}

TEST(EvictionSimTest, APageUnderTwoParentsIsRefusedNamingIt) {
  Trace trace;
  trace.requests = {{{1, 2}, 2}, {{3, 2}, 2}};
  absl::StatusOr<SimResult> r = SimulateIndex(trace, EvictionPolicyKind::kS3Fifo, {10});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr("requests[1].pages[1]"));
}

}  // namespace
}  // namespace kvcellar::core
