// Tests server/datapath/matcher.h on real indexes, pins, op table and (for L3) a file tier with
// the real prefetcher and writer: group-consistent L2 hits, keys from tokens or as sent, pins with
// one hold per rank, the step_id memo, and the L3 side (index marks, backend lookups, prefetch).
#include "server/datapath/matcher.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;

v1::MatchRequest TokensRequest(const std::vector<uint32_t>& tokens, uint32_t computed = 0) {
  v1::MatchRequest r;
  v1::MatchSequence* seq = r.add_sequences();
  seq->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  seq->set_num_computed_pages(computed);
  seq->set_request_id("req-1");
  return r;
}

class MatcherTest : public ::testing::Test {
 protected:
  MatcherTest()
      : ops_(&world_.metrics(), absl::Seconds(60)),
        limits_(CacheLimits::FromConfig(DefaultConfig())),
        matcher_(&pins_, &ops_, &world_.metrics(), &limits_, MatcherL3{}),
        spec_(NsSpec(2)),
        ns_(world_.Adopted(spec_)),
        keys_(PromptKeys(spec_, 1, 5)),
        rank0_(WorkerInfo(ns_, "inst", 0, 11)),
        rank1_(WorkerInfo(ns_, "inst", 1, 12)) {}

  v1::MatchResponse Match(const SessionInfo& session, const v1::MatchRequest& request) {
    v1::MatchResponse response;
    absl::Status s = matcher_.Match(session, request, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response;
  }

  // Commits shard 0 only of `key` (child of `parent`): half a TP-2 page.
  void CommitShard0(const core::PageKey& key, const core::PageKey& parent) {
    absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns_, key, 0, 0);
    ASSERT_TRUE(slot.ok());
    ASSERT_TRUE(ns_->index()->BeginWrite({key, parent, 0, *slot}).ok());
    ASSERT_TRUE(ns_->index()->Commit({key, 0}).ok());
  }

  L2World world_;
  OpTable ops_;
  PinTable pins_;
  const CacheLimits limits_;
  Matcher matcher_;
  const core::NamespaceSpec spec_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  SessionInfo rank0_;
  SessionInfo rank1_;
};

TEST_F(MatcherTest, HitCountsLeadingPagesWhoseWholeGroupIsInL2) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1], keys_[2]}), 3u);
  CommitShard0(keys_[3], keys_[2]);  // Only rank 0's shard: no hit for the group.
  v1::MatchResponse r = Match(rank0_, TokensRequest(Tokens(1, 5)));
  ASSERT_EQ(r.results_size(), 1);
  EXPECT_EQ(r.results(0).l2_hit_pages(), 3u);
  EXPECT_EQ(r.results(0).total_pages(), 5u);
  EXPECT_EQ(r.results(0).request_id(), "req-1");
  EXPECT_EQ(r.results(0).pin_id(), 0u);
  EXPECT_EQ(r.results(0).l3_hit_pages(), 0u);
  EXPECT_FALSE(r.memoized());
  const CacheCountersSnapshot m = world_.metrics().Snapshot();
  EXPECT_EQ(m.l2_hit_pages, 3u);
  EXPECT_EQ(m.l2_miss_pages, 2u);
  EXPECT_EQ(m.l2_hit_tokens, 3u * kPageSize);
  EXPECT_EQ(NamespaceCounters::Get(ns_->counters().lookup_pages), 5u);
  EXPECT_EQ(NamespaceCounters::Get(ns_->counters().l2_hit_pages), 3u);
  EXPECT_EQ(NamespaceCounters::Get(ns_->counters().match_calls), 1u);
}

TEST_F(MatcherTest, PartialPagesAndComputedPagesAreNotLookedUp) {
  ASSERT_EQ(world_.Commit(*ns_, keys_), 5u);
  std::vector<uint32_t> tokens = Tokens(1, 5);
  tokens.resize(tokens.size() - 1);  // The last page is partial: not keyed.
  v1::MatchRequest request = TokensRequest(tokens, /*computed=*/1);
  request.set_return_keys(true);
  v1::MatchResponse r = Match(rank0_, request);
  EXPECT_EQ(r.results(0).total_pages(), 3u);
  EXPECT_EQ(r.results(0).l2_hit_pages(), 3u);
  EXPECT_EQ(r.results(0).page_keys(), KeyBlob(keys_, 1, 4)) << "the keys looked up";
}

TEST_F(MatcherTest, KeysSentInAnOpaqueNamespaceAreScopedToIt) {
  core::NamespaceSpec opaque = spec_;
  opaque.opaque_keys = true;
  std::shared_ptr<Namespace> ns = world_.Adopted(opaque);
  const std::vector<core::PageKey> engine_keys = PromptKeys(spec_, 7, 3);  // The engine's own.
  std::vector<core::PageKey> scoped;
  ns->AppendIndexKeys(KeyBlob(engine_keys), &scoped);
  ASSERT_EQ(world_.Commit(*ns, {scoped[0], scoped[1]}), 2u);

  v1::MatchRequest request;
  request.add_sequences()->set_page_keys(KeyBlob(engine_keys));
  request.set_return_keys(true);
  v1::MatchResponse r = Match(WorkerInfo(ns), request);
  EXPECT_EQ(r.results(0).l2_hit_pages(), 2u);
  EXPECT_EQ(r.results(0).page_keys(), KeyBlob(engine_keys)) << "echoed as sent";
  // The same raw keys in the chained namespace name other pages.
  EXPECT_EQ(Match(rank0_, request).results(0).l2_hit_pages(), 0u);
}

TEST_F(MatcherTest, NamespaceWithoutGeometryMissesEverything) {
  std::shared_ptr<Namespace> bare = world_.namespaces().GetOrCreate(NsSpec(1, false, "bare"));
  v1::MatchResponse r = Match(WorkerInfo(bare), TokensRequest(Tokens(1, 3)));
  EXPECT_EQ(r.results(0).l2_hit_pages(), 0u);
  EXPECT_EQ(r.results(0).total_pages(), 3u);
}

TEST_F(MatcherTest, WritesInFlightAreInvisible) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0]}), 1u);
  for (uint16_t s = 0; s < 2; ++s) {
    absl::StatusOr<core::SlotRef> slot = world_.l2().Allocate(*ns_, keys_[1], s, 0);
    ASSERT_TRUE(slot.ok());
    ASSERT_TRUE(ns_->index()->BeginWrite({keys_[1], keys_[0], s, *slot}).ok());
  }
  EXPECT_EQ(Match(rank0_, TokensRequest(Tokens(1, 5))).results(0).l2_hit_pages(), 1u);
}

TEST_F(MatcherTest, PinHoldsTheHitForEveryRankOfTheGroup) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1]}), 2u);
  v1::MatchRequest request = TokensRequest(Tokens(1, 5));
  request.set_pin(true);
  v1::MatchResponse r = Match(rank0_, request);
  const uint64_t pin = r.results(0).pin_id();
  ASSERT_NE(pin, 0u);
  EXPECT_EQ(ns_->index()->Stats().pinned_pages, 2u) << "pinned in the lookup itself";
  EXPECT_EQ(pins_.UsageBySession()[rank0_.id].pages, 2u);
  EXPECT_FALSE(pins_.DropHold(pin, "inst", 0)) << "one hold per rank: tp_size 2";
  EXPECT_TRUE(pins_.DropHold(pin, "inst", 1));
  EXPECT_EQ(ns_->index()->Stats().pinned_pages, 0u);

  // Nothing hit: nothing to pin, no pin.
  v1::MatchRequest miss = TokensRequest(Tokens(2, 3));
  miss.set_pin(true);
  EXPECT_EQ(Match(rank0_, miss).results(0).pin_id(), 0u);
  EXPECT_EQ(pins_.size(), 0u);
}

TEST_F(MatcherTest, StepMemoGivesEveryRankTheSameAnswer) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1]}), 2u);
  v1::MatchRequest request = TokensRequest(Tokens(1, 5));
  request.set_step_id(7);
  request.set_pin(true);
  v1::MatchResponse first = Match(rank0_, request);
  EXPECT_FALSE(first.memoized());

  // Meanwhile page 2 lands: rank 1 still gets rank 0's answer, and no second pin.
  ASSERT_EQ(world_.Commit(*ns_, {keys_[2]}, keys_[1]), 1u);
  v1::MatchResponse second = Match(rank1_, request);
  EXPECT_TRUE(second.memoized());
  EXPECT_EQ(second.results(0).l2_hit_pages(), 2u);
  EXPECT_EQ(second.results(0).pin_id(), first.results(0).pin_id());
  EXPECT_EQ(pins_.size(), 1u);

  v1::MatchRequest different = request;
  different.mutable_sequences(0)->set_num_computed_pages(1);
  v1::MatchResponse none;
  absl::Status mismatch = matcher_.Match(rank1_, different, &none);
  EXPECT_TRUE(IsCacheError(mismatch, absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_STEP_MISMATCH, "step_id"));
  EXPECT_EQ(none.results_size(), 0);

  // Another instance's step 7 is its own.
  v1::MatchResponse other = Match(WorkerInfo(ns_, "other-inst"), different);
  EXPECT_FALSE(other.memoized());
  EXPECT_EQ(other.results(0).l2_hit_pages(), 2u) << "pages 1 and 2";

  EXPECT_EQ(matcher_.Prune(absl::Now()), 0u) << "within the window";
  EXPECT_EQ(matcher_.Prune(absl::Now() + absl::Milliseconds(kGroupMatchWindowMs)), 2u);
  v1::MatchResponse fresh = Match(rank1_, request);
  EXPECT_FALSE(fresh.memoized());
  EXPECT_EQ(fresh.results(0).l2_hit_pages(), 3u);
}

// ---- L3 -----------------------------------------------------------------------------------------

StorageConfig Selective() {
  StorageConfig s = DefaultConfig().storage;
  s.write_policy = L3WritePolicy::kWriteThroughSelective;
  s.selective_hits = 1;
  s.max_lookup_ms = 1000;
  return s;
}

class MatcherL3Test : public ::testing::Test {
 protected:
  MatcherL3Test()
      : world_({""}, Selective()),
        ops_(&world_.metrics(), absl::Seconds(60)),
        limits_(CacheLimits::FromConfig(DefaultConfig())),
        writer_(
            &world_.tiers(), &world_.l2(), [this] { return ops_.NextId(); }, &world_.metrics(),
            world_.storage()),
        prefetcher_(&world_.tiers(), &world_.l2(), &ops_, &pins_, &world_.metrics(), &limits_,
                    world_.storage()),
        matcher_(&pins_, &ops_, &world_.metrics(), &limits_,
                 MatcherL3{&world_.tiers(), &prefetcher_, &writer_, absl::Milliseconds(1000)}),
        spec_(NsSpec(1)),
        ns_(world_.Adopted(spec_)),
        keys_(PromptKeys(spec_, 1, 5)),
        session_(WorkerInfo(ns_)) {}

  v1::MatchResponse Match(const v1::MatchRequest& request) {
    v1::MatchResponse response;
    EXPECT_TRUE(matcher_.Match(session_, request, &response).ok());
    return response;
  }

  L3World world_;
  OpTable ops_;
  PinTable pins_;
  const CacheLimits limits_;
  L3Writer writer_;
  L3Prefetcher prefetcher_;
  Matcher matcher_;
  const core::NamespaceSpec spec_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  SessionInfo session_;
};

TEST_F(MatcherL3Test, L3HitFollowsTheL2HitAndOnePrefetchOpBringsIt) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1]}), 2u);
  world_.StoreInL3(*ns_, 0, {keys_[2], keys_[3], keys_[4]}, keys_[1]);
  v1::MatchRequest request = TokensRequest(Tokens(1, 5));
  request.set_prefetch_policy(v1::PREFETCH_POLICY_WAIT_COMPLETE);
  request.set_pin(true);
  v1::MatchResponse r = Match(request);
  const v1::MatchResult& result = r.results(0);
  EXPECT_EQ(result.l2_hit_pages(), 2u);
  EXPECT_EQ(result.l3_hit_pages(), 3u);
  EXPECT_THAT(result.l3_hit_pages_by_tier(), ElementsAre(3));
  EXPECT_EQ(result.prefetch_pages(), 3u);
  ASSERT_NE(r.prefetch_op_id(), 0u);
  EXPECT_EQ(world_.metrics().Snapshot().l3_hit_pages, 3u);

  prefetcher_.Drain();  // Every read has landed (committed, or freed).
  EXPECT_EQ(L2World::L2Hits(*ns_, keys_), 5u) << "the prefetched pages are L2 hits";
  EXPECT_EQ(pins_.UsageBySession()[session_.id].pages, 5u) << "the pin grew over them";
  for (size_t i = 2; i < 5; ++i) EXPECT_TRUE(world_.HoldsPayload(*ns_, keys_[i]));
}

TEST_F(MatcherL3Test, BackendsAreAskedAboutPagesTheIndexDoesNotKnowWithinTheBudget) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0]}), 1u);
  // Another node wrote pages 1..3 to the shared tier: this index knows nothing of them.
  for (size_t i = 1; i < 4; ++i) {
    ASSERT_EQ(storage::testing::PutOne(world_.backend(0), ns_->digest(), keys_[i], 0,
                                       ns_->object_bytes()),
              storage::ObjectStatus::kOk);
  }
  v1::MatchRequest request = TokensRequest(Tokens(1, 5));
  request.set_prefetch_policy(v1::PREFETCH_POLICY_NONE);
  EXPECT_EQ(Match(request).results(0).l3_hit_pages(), 0u) << "no lookup budget: the index only";
  request.set_l3_lookup_timeout_ms(500);
  v1::MatchResponse asked = Match(request);
  EXPECT_EQ(asked.results(0).l3_hit_pages(), 3u);
  EXPECT_EQ(asked.prefetch_op_id(), 0u) << "policy NONE";
  EXPECT_EQ(ns_->index()->Stats().l3_objects[0], 3u) << "recorded for the next Match";
  request.set_l3_lookup_timeout_ms(0);
  EXPECT_EQ(Match(request).results(0).l3_hit_pages(), 3u);
}

TEST_F(MatcherL3Test, L2HitsAreReportedToTheWriter) {
  ASSERT_EQ(world_.Commit(*ns_, {keys_[0], keys_[1]}), 2u);
  world_.FillPayloads(*ns_, {keys_[0], keys_[1]});
  const std::vector<core::ObjectId> objects = {{keys_[0], 0}, {keys_[1], 0}};
  writer_.OnCommitted(*ns_, objects, v1::WRITE_POLICY_WRITE_THROUGH_SELECTIVE);
  writer_.Drain();
  ASSERT_EQ(ns_->index()->Stats().l3_objects[0], 0u) << "selective: waits for a hit";
  v1::MatchRequest request = TokensRequest(Tokens(1, 1));  // Page 0 only.
  request.set_prefetch_policy(v1::PREFETCH_POLICY_NONE);
  Match(request);
  writer_.Drain();
  EXPECT_EQ(world_.Read(*ns_, 0, keys_[0]), storage::ObjectStatus::kOk);
  EXPECT_EQ(world_.Read(*ns_, 0, keys_[1]), storage::ObjectStatus::kNotFound) << "not hit";
}

}  // namespace
}  // namespace kvcellar::server::testing
