// Tests for core/adaptive_policy.h, through the index and core/eviction_sim.h: the learner moves
// to MRU in a cycle larger than the cache, and loses nothing to S3-FIFO under skewed reuse.
#include "core/adaptive_policy.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include "core/eviction_sim.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

// Sequences of `pages` pages asked in turn, `rounds` times.
Trace Cycle(uint64_t sequences, uint32_t pages, int rounds) {
  Trace trace;
  for (int r = 0; r < rounds; ++r) {
    for (uint64_t s = 0; s < sequences; ++s) {
      TraceRequest request;
      for (uint32_t p = 0; p < pages; ++p) request.pages.push_back(s << 16 | p);
      request.tokens = pages;
      trace.requests.push_back(std::move(request));
    }
  }
  return trace;
}

// Requests for 50 sequences of `pages` pages by Zipf popularity (s = 1.2).
Trace Skewed(uint32_t pages, int requests) {
  std::mt19937_64 rng(3);
  std::vector<double> w;
  for (int k = 0; k < 50; ++k) w.push_back(1.0 / std::pow(k + 1, 1.2));
  std::discrete_distribution<uint64_t> pick(w.begin(), w.end());
  Trace trace;
  for (int i = 0; i < requests; ++i) {
    const uint64_t s = pick(rng);
    TraceRequest request;
    for (uint32_t p = 0; p < pages; ++p) request.pages.push_back(s << 16 | p);
    request.tokens = pages;
    trace.requests.push_back(std::move(request));
  }
  return trace;
}

// The index owns its policy; the test keeps the AdaptivePolicy alive past the replay through this.
// Its queues link the index's nodes, so they are checked here, while the nodes still exist (the
// index destroys its policy before its nodes); after the replay only the counters may be read.
class Shared final : public EvictionPolicy {
 public:
  explicit Shared(std::shared_ptr<AdaptivePolicy> p) : p_(std::move(p)) {}
  ~Shared() override { EXPECT_TRUE(p_->CheckConsistency().ok()) << p_->CheckConsistency(); }
  absl::string_view Name() const override { return p_->Name(); }
  void OnInsert(EvictionHook* h, uint64_t fp) override { p_->OnInsert(h, fp); }
  void OnAccess(EvictionHook* h) override { p_->OnAccess(h); }
  void OnEligible(EvictionHook* h) override { p_->OnEligible(h); }
  void OnRemove(EvictionHook* h) override { p_->OnRemove(h); }
  EvictionHook* PickVictim(const EvictionCandidates& c) override { return p_->PickVictim(c); }
  size_t Tracked() const override { return p_->Tracked(); }
  bool Parked(const EvictionHook& h) const override { return p_->Parked(h); }
  size_t MemoryBytes() const override { return p_->MemoryBytes(); }
  absl::Status CheckConsistency() const override { return p_->CheckConsistency(); }

 private:
  std::shared_ptr<AdaptivePolicy> p_;
};

SimResult Replay(const Trace& trace, uint64_t capacity, std::shared_ptr<AdaptivePolicy>* out) {
  *out = std::make_shared<AdaptivePolicy>();
  absl::StatusOr<SimResult> r =
      SimulateIndex(trace, [p = *out] { return std::make_unique<Shared>(p); }, {capacity});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : SimResult{};
}

TEST(AdaptivePolicyTest, ACycleLargerThanTheCacheTeachesItMru) {
  // 40 sequences of 8 pages in turn, room for 3/4 of them: the queues lose most of every round,
  // MRU keeps a fixed part of the cycle.
  const Trace trace = Cycle(40, 8, 30);
  const uint64_t capacity = 240;
  std::shared_ptr<AdaptivePolicy> policy;
  const SimResult adaptive = Replay(trace, capacity, &policy);
  // The larger weight evicts, and the weights swing around 0.5 as each expert errs in turn; MRU
  // errs less here and makes more of the evictions (1744 of 2904).
  EXPECT_GT(policy->mru_evictions(), policy->queue_evictions());
  const SimResult s3fifo = *SimulateIndex(trace, EvictionPolicyKind::kS3Fifo, {capacity});
  const SimResult bound = SimulateBelady(trace, capacity);
  std::printf("cycle: adaptive %.3f (MRU evicted %llu, the queues %llu), s3fifo %.3f, bound %.3f\n",
              adaptive.HitRate(), static_cast<unsigned long long>(policy->mru_evictions()),
              static_cast<unsigned long long>(policy->queue_evictions()), s3fifo.HitRate(),
              bound.HitRate());
  EXPECT_GT(adaptive.HitRate(), s3fifo.HitRate() + 0.1)
      << adaptive.HitRate() << " vs " << s3fifo.HitRate();
  EXPECT_GE(adaptive.HitRate(), 0.85 * bound.HitRate());
}

TEST(AdaptivePolicyTest, SkewedReuseLosesNothingAgainstS3Fifo) {
  // Popular sequences come back soon: the page just used is often the wrong victim, and the
  // learner must not let MRU cost what the queues keep.
  const Trace trace = Skewed(8, 4000);
  const uint64_t capacity = 120;
  std::shared_ptr<AdaptivePolicy> policy;
  const SimResult adaptive = Replay(trace, capacity, &policy);
  const SimResult s3fifo = *SimulateIndex(trace, EvictionPolicyKind::kS3Fifo, {capacity});
  const SimResult lru = *SimulateIndex(trace, EvictionPolicyKind::kLru, {capacity});
  std::printf("skewed: adaptive %.3f (MRU evicted %llu, the queues %llu), s3fifo %.3f, lru %.3f\n",
              adaptive.HitRate(), static_cast<unsigned long long>(policy->mru_evictions()),
              static_cast<unsigned long long>(policy->queue_evictions()), s3fifo.HitRate(),
              lru.HitRate());
  EXPECT_GT(adaptive.HitRate(), lru.HitRate());
  EXPECT_GE(adaptive.HitRate(), s3fifo.HitRate() - 0.02)
      << adaptive.HitRate() << " vs " << s3fifo.HitRate();
}

}  // namespace
}  // namespace kvcellar::core
