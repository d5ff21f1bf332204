// Tests server/l3/l3_prefetcher.h on a real file tier, L2 and op table: per-page statuses along a
// chain (OK, ALREADY_PRESENT, MISS then SKIPPED, THROTTLED, NO_SPACE), the bytes that land in L2,
// marks cleared for copies that are gone, pins grown over landed pages, and the deadlines.
#include "server/l3/l3_prefetcher.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;

constexpr uint32_t kPages = 4;

StorageConfig Storage(uint64_t max_pending_prefetch_bytes = 1 << 30) {
  StorageConfig s = DefaultConfig().storage;
  s.max_pending_prefetch_bytes = max_pending_prefetch_bytes;
  s.prefetch_timeout_base_ms = 20;
  s.prefetch_timeout_per_1k_tokens_ms = 5;
  return s;
}

// The prefetcher and what it works on, wired as the Cache (server/cache/cache.h) wires them.
class PrefetcherTest : public ::testing::Test {
 protected:
  explicit PrefetcherTest(StorageConfig storage = Storage(),
                          L2World::Options l2 = L2World::Options())
      : world_({""}, storage, l2),
        ops_(&world_.metrics(), absl::Seconds(60)),
        limits_(CacheLimits::FromConfig(DefaultConfig())),
        prefetcher_(&world_.tiers(), &world_.l2(), &ops_, &pins_, &world_.metrics(), &limits_,
                    world_.storage()),
        ns_(world_.Adopted(NsSpec(2))),
        keys_(PromptKeys(NsSpec(2), 1, kPages)),
        session_(WorkerInfo(ns_)) {}

  PrefetchChain Chain(size_t begin = 0, size_t end = kPages, uint64_t pin = 0) {
    PrefetchChain c;
    if (begin > 0) c.parent = keys_[begin - 1];
    c.keys.assign(keys_.begin() + begin, keys_.begin() + end);
    c.pin_id = pin;
    return c;
  }

  L3Prefetcher::Started Start(std::vector<PrefetchChain> chains, bool always_op = false) {
    return prefetcher_.Start(session_, std::move(chains), v1::PREFETCH_POLICY_WAIT_COMPLETE,
                             absl::Seconds(10), always_op);
  }

  // The op's final per-page statuses (one chain).
  std::vector<int> Finished(const L3Prefetcher::Started& started) {
    EXPECT_NE(started.op, nullptr);
    if (started.op == nullptr) return {};
    const v1::OpResult r = AwaitOp(ops_, *started.op);
    EXPECT_EQ(r.state(), v1::OP_STATE_DONE);
    EXPECT_EQ(r.kind(), v1::OP_KIND_PREFETCH);
    return r.sequences_size() == 1 ? Statuses(r.sequences(0)) : std::vector<int>{};
  }

  L3World world_;
  OpTable ops_;
  PinTable pins_;
  const CacheLimits limits_;
  L3Prefetcher prefetcher_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  SessionInfo session_;
};

TEST_F(PrefetcherTest, PoliciesAndDeadlines) {
  EXPECT_EQ(prefetcher_.Resolve(v1::PREFETCH_POLICY_UNSPECIFIED), v1::PREFETCH_POLICY_BEST_EFFORT);
  EXPECT_EQ(prefetcher_.Resolve(v1::PREFETCH_POLICY_TIMEOUT), v1::PREFETCH_POLICY_TIMEOUT);
  const absl::Duration max = absl::Milliseconds(kMaxPrefetchTimeoutMs);
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_BEST_EFFORT, 50, 1024), max);
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_WAIT_COMPLETE, 50, 1024), max);
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_TIMEOUT, 50, 1024), absl::Milliseconds(50));
  // No timeout in the request: base 20 ms + 5 ms per 1K tokens.
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_TIMEOUT, 0, 2048), absl::Milliseconds(30));
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_TIMEOUT, 3'600'000, 0), max) << "capped";
  EXPECT_EQ(prefetcher_.Deadline(v1::PREFETCH_POLICY_TIMEOUT, 0, 1u << 30), max);
}

TEST_F(PrefetcherTest, PagesInL3LandInL2WithTheirBytes) {
  world_.StoreInL3(*ns_, 0, keys_);
  L3Prefetcher::Started started = Start({Chain()});
  EXPECT_THAT(started.fetching, ElementsAre(kPages));
  EXPECT_THAT(Finished(started), Each(v1::PAGE_STATUS_OK));
  prefetcher_.Drain();
  EXPECT_EQ(L2World::L2Hits(*ns_, keys_), kPages) << "committed: visible to Match";
  for (const core::PageKey& key : keys_) EXPECT_TRUE(world_.HoldsPayload(*ns_, key));
  EXPECT_EQ(prefetcher_.pending_bytes(), 0u);
  EXPECT_EQ(world_.metrics().Snapshot().l3_to_l2_bytes, 2 * kPages * kObjectBytes);
  EXPECT_EQ(world_.metrics().Snapshot().pages[2][v1::PAGE_STATUS_OK], kPages);
}

TEST_F(PrefetcherTest, ChainEndsAtTheFirstMissAndTheRestIsSkipped) {
  world_.StoreInL3(*ns_, 0, {keys_[0], keys_[1]});
  L3Prefetcher::Started started = Start({Chain()});
  EXPECT_THAT(started.fetching, ElementsAre(2));
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK,
                                             v1::PAGE_STATUS_MISS, v1::PAGE_STATUS_SKIPPED));
  prefetcher_.Drain();
  EXPECT_EQ(L2World::L2Hits(*ns_, keys_), 2u);
  EXPECT_EQ(SlotsUsed(world_.pool()), 4u) << "no slot was taken for the missed pages";
}

TEST_F(PrefetcherTest, PagesAlreadyInL2AreNotReadAgain) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1]}), 2u);
  world_.StoreInL3(*ns_, 0, keys_);
  L3Prefetcher::Started started = Start({Chain()});
  EXPECT_THAT(started.fetching, ElementsAre(2));
  EXPECT_THAT(Finished(started),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  prefetcher_.Drain();

  // Nothing left to fetch: no op unless the caller always wants one.
  L3Prefetcher::Started none = Start({Chain()});
  EXPECT_EQ(none.op, nullptr);
  EXPECT_THAT(none.fetching, ElementsAre(0));
  L3Prefetcher::Started always = Start({Chain()}, /*always_op=*/true);
  EXPECT_THAT(Finished(always), Each(v1::PAGE_STATUS_ALREADY_PRESENT));
}

TEST_F(PrefetcherTest, MarkedCopyThatIsGoneIsAMissAndItsMarkIsCleared) {
  world_.StoreInL3(*ns_, 0, keys_);
  // Another node (or an operator) removed page 2's objects behind the index's back.
  const std::vector<storage::ObjectRef> refs = {{keys_[2], 0}, {keys_[2], 1}};
  storage::testing::DeleteSync(world_.backend(0), {ns_->digest(), refs, absl::ZeroDuration()});

  L3Prefetcher::Started started = Start({Chain()});
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK,
                                             v1::PAGE_STATUS_MISS, v1::PAGE_STATUS_OK));
  prefetcher_.Drain();
  std::optional<core::PageInfo> info = ns_->index()->Inspect(keys_[2]);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->shards[0].l3_tiers, 0) << "the copy is gone: no Match counts it again";
  EXPECT_EQ(info->shards[0].l2, core::L2State::kAbsent) << "its slot was freed";
  EXPECT_EQ(SlotsUsed(world_.pool()), 6u);
}

TEST_F(PrefetcherTest, UnknownFirstPageOfAChainFromTheMiddleIsAMiss) {
  world_.StoreInL3(*ns_, 0, keys_);
  PrefetchChain chain;
  chain.parent_known = false;
  chain.keys = {PromptKeys(NsSpec(2), 9, 2)[1]};  // Not indexed.
  L3Prefetcher::Started started = Start({chain}, /*always_op=*/true);
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_MISS));

  chain.keys = {keys_[2], keys_[3]};  // Indexed: its parent comes from the index.
  started = Start({chain});
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
}

TEST_F(PrefetcherTest, LandedPagesJoinTheMatchPin) {
  world_.StoreInL3(*ns_, 0, keys_);
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0]}), 1u);
  ns_->index()->Pin(500, {keys_[0]}, absl::Now() + absl::Seconds(30));
  pins_.Add(500, "inst", ns_, {keys_[0]}, 1, absl::Seconds(30), absl::Now() + absl::Seconds(30),
            session_.id);
  L3Prefetcher::Started started = Start({Chain(1, kPages, /*pin=*/500)});
  EXPECT_THAT(Finished(started), Each(v1::PAGE_STATUS_OK));
  prefetcher_.Drain();
  EXPECT_EQ(pins_.UsageBySession()[session_.id].pages, kPages);
  EXPECT_EQ(ns_->index()->Inspect(keys_[3])->pins, 1u);
  EXPECT_TRUE(pins_.Release(500, "inst"));
  EXPECT_EQ(ns_->index()->Stats().pinned_pages, 0u);
}

class ThrottledPrefetcherTest : public PrefetcherTest {
 protected:
  ThrottledPrefetcherTest() : PrefetcherTest(Storage(/*max_pending_prefetch_bytes=*/0)) {}
};

TEST_F(ThrottledPrefetcherTest, PagesPastThePendingLimitAreThrottled) {
  world_.StoreInL3(*ns_, 0, keys_);
  L3Prefetcher::Started started = Start({Chain(0, 2)}, /*always_op=*/true);
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_THROTTLED, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(SlotsUsed(world_.pool()), 0u);
}

L2World::Options OneRegion() {
  L2World::Options o;
  o.pool_bytes = kRegionBytes;
  return o;
}

class FullPoolPrefetcherTest : public PrefetcherTest {
 protected:
  FullPoolPrefetcherTest() : PrefetcherTest(Storage(), OneRegion()) {}
};

TEST_F(FullPoolPrefetcherTest, NoSlotIsNoSpaceAndNothingLeaks) {
  world_.StoreInL3(*ns_, 0, keys_);
  // Fill the pool with pinned pages of another namespace of the same size class.
  std::shared_ptr<Namespace> other = world_.Adopted(NsSpec(1, false, "other"));
  const std::vector<core::PageKey> filler = PromptKeys(NsSpec(1, false, "other"), 1, 64);
  ASSERT_EQ(world_.Commit(*other, filler), 64u);
  other->index()->Pin(7, filler, absl::InfiniteFuture());
  L3Prefetcher::Started started = Start({Chain(0, 2)}, /*always_op=*/true);
  EXPECT_THAT(Finished(started), ElementsAre(v1::PAGE_STATUS_NO_SPACE, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(SlotsUsed(world_.pool()), 64u);
  EXPECT_EQ(ns_->index()->Stats().l2_inflight_objects, 0u) << "the half-begun page was aborted";
  EXPECT_EQ(prefetcher_.pending_bytes(), 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
