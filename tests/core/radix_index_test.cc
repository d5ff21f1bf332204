// Unit tests for core/radix_index.h: every operation and invariant, under both policies.
#include "core/radix_index.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::UnorderedElementsAreArray;

// A deterministic key: distinct first 8 bytes (what the hash and fingerprints read).
PageKey Key(uint64_t id) {
  PageKey k;
  const uint64_t mixed = id * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  std::memcpy(k.bytes.data(), &mixed, sizeof(mixed));
  std::memcpy(k.bytes.data() + 8, &id, sizeof(id));
  return k;
}

std::vector<PageKey> Chain(uint64_t base, int n) {
  std::vector<PageKey> keys;
  for (int i = 0; i < n; ++i) keys.push_back(Key(base + i));
  return keys;
}

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

class RadixIndexTest : public ::testing::TestWithParam<EvictionPolicyKind> {
 protected:
  std::unique_ptr<RadixIndex> Make(int shards = 1, int tiers = 2, uint64_t capacity = 0) {
    RadixIndexOptions o;
    o.shards_per_page = shards;
    o.l3_tiers = tiers;
    o.object_bytes = 1000;
    o.capacity_bytes = capacity;
    o.high_watermark = 0.8;
    o.low_watermark = 0.5;
    o.policy = GetParam();
    auto index = RadixIndex::Create(o);
    EXPECT_TRUE(index.ok()) << index.status();
    return std::move(*index);
  }

  SlotRef NextSlot() { return SlotRef{0, 0, next_slot_++}; }

  WriteRequest Write(const PageKey& key, std::optional<PageKey> parent, uint16_t shard) {
    return WriteRequest{key, parent, shard, NextSlot(), WriteKind::kBackup};
  }

  // Writes and commits `keys` as a chain under `parent` for the shards in `shards`.
  void Put(RadixIndex& index, const std::vector<PageKey>& keys,
           std::optional<PageKey> parent = std::nullopt, ShardMask shards = 1) {
    for (const PageKey& k : keys) {
      for (ShardMask m = shards; m != 0; m &= m - 1) {
        const auto s = static_cast<uint16_t>(__builtin_ctzll(m));
        ASSERT_TRUE(index.BeginWrite(Write(k, parent, s)).ok());
        ASSERT_TRUE(index.Commit({k, s}).ok());
      }
      parent = k;
    }
    ASSERT_TRUE(index.CheckInvariants().ok()) << index.CheckInvariants();
  }

  void MarkL3(RadixIndex& index, const std::vector<PageKey>& keys, uint8_t tier,
              ShardMask shards = 1, bool present = true) {
    for (const PageKey& k : keys) {
      for (ShardMask m = shards; m != 0; m &= m - 1) {
        L3Update u{k, std::nullopt, static_cast<uint16_t>(__builtin_ctzll(m)), tier, present};
        absl::Status st;
        ASSERT_EQ(index.UpdateL3({&u, 1}, {&st, 1}), 1u) << st;
      }
    }
  }

  MatchResult MatchOk(RadixIndex& index, const std::vector<PageKey>& keys, ShardMask shards = 1,
                      std::optional<PinLease> pin = std::nullopt) {
    auto r = index.Match(keys, MatchOptions{shards, pin});
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(index.CheckInvariants().ok()) << index.CheckInvariants();
    return r.ok() ? *r : MatchResult{};
  }

  uint32_t next_slot_ = 0;
};

INSTANTIATE_TEST_SUITE_P(Policies, RadixIndexTest,
                         ::testing::Values(EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                           EvictionPolicyKind::kAdaptive),
                         [](const auto& info) {
                           return std::string(EvictionPolicyKindName(info.param));
                         });

TEST_P(RadixIndexTest, CreateRejectsBadOptions) {
  RadixIndexOptions o;
  o.object_bytes = 1;
  o.shards_per_page = 0;
  EXPECT_EQ(RadixIndex::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shards_per_page = 65;
  EXPECT_EQ(RadixIndex::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shards_per_page = 64;
  o.l3_tiers = 9;
  EXPECT_EQ(RadixIndex::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.l3_tiers = 8;
  o.object_bytes = 0;
  EXPECT_EQ(RadixIndex::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.object_bytes = 1;
  o.low_watermark = 0.9;
  o.high_watermark = 0.8;
  EXPECT_EQ(RadixIndex::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.low_watermark = 0.5;
  EXPECT_TRUE(RadixIndex::Create(o).ok());
}

TEST_P(RadixIndexTest, InsertCommitAndMatchChain) {
  auto index = Make();
  const auto keys = Chain(100, 5);
  Put(*index, keys);
  EXPECT_EQ(MatchOk(*index, keys).l2_pages, 5u);
  // A longer query stops at the end of what is indexed; a suffix matches from its first key.
  auto longer = keys;
  longer.push_back(Key(999));
  EXPECT_EQ(MatchOk(*index, longer).l2_pages, 5u);
  EXPECT_EQ(MatchOk(*index, {keys.begin() + 2, keys.end()}).l2_pages, 3u);
  EXPECT_EQ(MatchOk(*index, {}).l2_pages, 0u);
  const RadixIndexStats s = index->Stats();
  EXPECT_EQ(s.pages, 5u);
  EXPECT_EQ(s.l2_pages, 5u);
  EXPECT_EQ(s.l2_objects, 5u);
  EXPECT_EQ(s.l2_bytes, 5000u);
  EXPECT_GT(s.memory_bytes, 0u);
}

TEST_P(RadixIndexTest, MatchOnScatteredNodesSwitchesToProbesAndAgrees) {
  // 40 prompts grown page by page in turn: consecutive pages of a prompt lie 40 nodes apart,
  // farther than Match's near distance, so it switches from child links to hash probes. The
  // last 10 pages of each prompt exist only in tier 1.
  auto index = Make(/*shards=*/1, /*tiers=*/2);
  constexpr int kPrompts = 40, kPages = 64, kInL2 = 54;
  std::vector<std::vector<PageKey>> prompts;
  for (int p = 0; p < kPrompts; ++p) prompts.push_back(Chain(100'000 * (p + 1), kPages));
  for (int i = 0; i < kPages; ++i) {
    for (int p = 0; p < kPrompts; ++p) {
      const std::optional<PageKey> parent =
          i == 0 ? std::nullopt : std::optional<PageKey>(prompts[p][i - 1]);
      if (i < kInL2) {
        ASSERT_TRUE(index->BeginWrite(Write(prompts[p][i], parent, 0)).ok());
        ASSERT_TRUE(index->Commit({prompts[p][i], 0}).ok());
      } else {
        L3Update u{prompts[p][i], parent, 0, 1, true};
        absl::Status st;
        ASSERT_EQ(index->UpdateL3({&u, 1}, {&st, 1}), 1u) << st;
      }
    }
  }
  ASSERT_TRUE(index->CheckInvariants().ok());
  const uint64_t probed_before = index->Stats().matches_probed;
  for (int p = 0; p < kPrompts; ++p) {
    MatchResult r = MatchOk(*index, prompts[p]);
    EXPECT_EQ(r.l2_pages, uint32_t{kInL2});
    EXPECT_EQ(r.l3_pages[1], uint32_t{kPages - kInL2});
    // A foreign page after the switch ends the chain, in L2 and in L3.
    auto broken = prompts[p];
    broken[40] = prompts[(p + 1) % kPrompts][40];
    EXPECT_EQ(MatchOk(*index, broken).l2_pages, 40u);
    broken = prompts[p];
    broken[60] = prompts[(p + 1) % kPrompts][60];
    r = MatchOk(*index, broken);
    EXPECT_EQ(r.l2_pages, uint32_t{kInL2});
    EXPECT_EQ(r.l3_pages[1], 6u);
    // Unknown key.
    broken = prompts[p];
    broken[20] = Key(7);
    EXPECT_EQ(MatchOk(*index, broken).l2_pages, 20u);
  }
  EXPECT_GE(index->Stats().matches_probed - probed_before, uint64_t{kPrompts});
}

TEST_P(RadixIndexTest, MatchFollowsAWideFanOut) {
  // A shared first page with many continuations: past a few children, the child is found by
  // hash probe; the chain check still holds.
  auto index = Make();
  Put(*index, {Key(1)});
  for (int c = 0; c < 50; ++c) Put(*index, Chain(1000 * (c + 1), 3), Key(1));
  for (int c = 0; c < 50; ++c) {
    std::vector<PageKey> keys = {Key(1)};
    for (const PageKey& k : Chain(1000 * (c + 1), 3)) keys.push_back(k);
    EXPECT_EQ(MatchOk(*index, keys).l2_pages, 4u);
    keys[1] = Key(1000 * (c + 1) + 1);  // A grandchild right after the root: not a chain.
    EXPECT_EQ(MatchOk(*index, keys).l2_pages, 1u);
  }
}

TEST_P(RadixIndexTest, MatchStopsWhereTheKeysStopBeingAChain) {
  auto index = Make();
  const auto a = Chain(100, 3);
  const auto b = Chain(200, 3);
  Put(*index, a);
  Put(*index, b);
  // Both pages exist, but b[0] is not a's child: no hole-jumping across sequences.
  EXPECT_EQ(MatchOk(*index, {a[0], a[1], b[0], b[1]}).l2_pages, 2u);
}

TEST_P(RadixIndexTest, PrefixClosedRejectsPageWhoseParentIsNotIndexed) {
  auto index = Make();
  absl::Status st = index->BeginWrite(Write(Key(2), Key(1), 0));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(index->Stats().pages, 0u);
  EXPECT_EQ(index->Stats().l2_inflight_objects, 0u);

  // Same for an L3 copy reported for a page with an unknown parent.
  L3Update u{Key(2), Key(1), 0, 0, true};
  EXPECT_EQ(index->UpdateL3({&u, 1}, {&st, 1}), 0u);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index->Stats().pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, ParentMismatchAndSelfParentAreRejected) {
  auto index = Make();
  Put(*index, Chain(100, 2));
  Put(*index, {Key(300)});
  // Key(101) is indexed under Key(100); claiming another parent (or none) is refused.
  EXPECT_EQ(index->BeginWrite(Write(Key(101), Key(300), 0)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index->BeginWrite(Write(Key(101), std::nullopt, 0)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index->BeginWrite(Write(Key(5), Key(5), 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index->BeginWrite(Write(Key(5), std::nullopt, 1)).code(),
            absl::StatusCode::kInvalidArgument);  // Shard beyond shards_per_page.
  EXPECT_EQ(index->BeginWrite(WriteRequest{Key(5), std::nullopt, 0, SlotRef{}}).code(),
            absl::StatusCode::kInvalidArgument);  // Invalid slot.
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, InFlightPagesAreInvisibleUntilCommit) {
  auto index = Make();
  const auto keys = Chain(100, 3);
  // A whole chain begun in one batch: each page's parent is in flight, which is allowed.
  std::vector<WriteRequest> reqs = {Write(keys[0], std::nullopt, 0), Write(keys[1], keys[0], 0),
                                    Write(keys[2], keys[1], 0)};
  std::vector<absl::Status> st(3);
  EXPECT_EQ(index->BeginWrite(reqs, absl::MakeSpan(st)), 3u);
  EXPECT_EQ(MatchOk(*index, keys).l2_pages, 0u);
  EXPECT_EQ(index->Stats().l2_inflight_objects, 3u);
  EXPECT_EQ(index->Stats().l2_objects, 0u);

  // Children committed before their parent stay unreachable.
  ASSERT_TRUE(index->Commit({keys[2], 0}).ok());
  ASSERT_TRUE(index->Commit({keys[1], 0}).ok());
  EXPECT_EQ(MatchOk(*index, keys).l2_pages, 0u);
  ASSERT_TRUE(index->Commit({keys[0], 0}).ok());
  EXPECT_EQ(MatchOk(*index, keys).l2_pages, 3u);
  EXPECT_EQ(index->Commit({keys[0], 0}).code(), absl::StatusCode::kFailedPrecondition);

  // A second writer of the same object is told it exists (and frees its own slot).
  EXPECT_EQ(index->BeginWrite(Write(keys[0], std::nullopt, 0)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, AbortReturnsTheSlotAndDropsTheEmptyPage) {
  auto index = Make();
  Put(*index, {Key(1)});
  const WriteRequest w = Write(Key(2), Key(1), 0);
  ASSERT_TRUE(index->BeginWrite(w).ok());
  EXPECT_EQ(index->Stats().pages, 2u);
  std::vector<ReleasedObject> released;
  const ObjectId objs[] = {{Key(2), 0}, {Key(3), 0}};  // The second is not in flight: skipped.
  EXPECT_EQ(index->Abort(objs, &released), 1u);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].key, Key(2));
  EXPECT_EQ(released[0].slot, w.slot);
  EXPECT_EQ(index->Stats().pages, 1u);
  EXPECT_EQ(index->Stats().l2_inflight_objects, 0u);
  EXPECT_FALSE(index->Inspect(Key(2)).has_value());
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, GroupMatchNeedsEveryShard) {
  auto index = Make(/*shards=*/4);
  const auto keys = Chain(100, 4);
  const ShardMask all = AllShards(4);
  Put(*index, {keys[0], keys[1]}, std::nullopt, all);
  Put(*index, {keys[2]}, keys[1], 0b0111);  // Shard 3 missing.
  Put(*index, {keys[3]}, keys[2], all);
  EXPECT_EQ(MatchOk(*index, keys, all).l2_pages, 2u);
  EXPECT_EQ(MatchOk(*index, keys, 0b0111).l2_pages, 4u);
  EXPECT_EQ(MatchOk(*index, keys, 0b1000).l2_pages, 2u);
  // A shard being written does not count either.
  ASSERT_TRUE(index->BeginWrite(Write(keys[2], keys[1], 3)).ok());
  EXPECT_EQ(MatchOk(*index, keys, all).l2_pages, 2u);
  ASSERT_TRUE(index->Commit({keys[2], 3}).ok());
  EXPECT_EQ(MatchOk(*index, keys, all).l2_pages, 4u);
  EXPECT_EQ(index->Stats().l2_objects, 16u);
}

// --- Groups (hybrid models) --------------------------------------------------------------------

std::unique_ptr<RadixIndex> MakeHybrid(std::vector<GroupRule> groups, int tp,
                                       EvictionPolicyKind policy) {
  RadixIndexOptions o;
  o.shards_per_page = static_cast<int>(groups.size()) * tp;
  o.l3_tiers = 1;
  o.groups = std::move(groups);
  o.object_bytes = 1000;
  o.policy = policy;
  auto index = RadixIndex::Create(o);
  EXPECT_TRUE(index.ok()) << index.status();
  return index.ok() ? std::move(*index) : nullptr;
}

TEST_P(RadixIndexTest, GroupsAreCheckedAtCreate) {
  RadixIndexOptions o;
  o.object_bytes = 1;
  o.shards_per_page = 3;
  o.groups = {GroupRule{}, GroupRule{GroupKind::kWindow, 2}};
  auto bad = RadixIndex::Create(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              ::testing::HasSubstr("not a multiple of the number of groups"));
  o.shards_per_page = 4;
  o.groups = {GroupRule{GroupKind::kState, 3}, GroupRule{}};
  bad = RadixIndex::Create(o);
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("groups[0].window_pages is 3"));
  o.groups = {GroupRule{}, GroupRule{static_cast<GroupKind>(7)}};
  EXPECT_THAT(RadixIndex::Create(o).status().message(), ::testing::HasSubstr("groups[1].kind 7"));
  o.groups = {GroupRule{}, GroupRule{GroupKind::kWindow, 2}};
  auto ok = RadixIndex::Create(o);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->groups().size(), 2u);
  // Every group's objects must be asked for: a Match naming only the full group's is refused.
  auto r = (*ok)->Match(Chain(1, 2), MatchOptions{0b0011, std::nullopt});
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr("no object of group 1"));
}

TEST_P(RadixIndexTest, HybridHitIsTheLongestBoundaryEveryGroupServes) {
  // Full attention (objects 0, 1 at TP 2), a window of 2 pages (2, 3), a recurrent state (4, 5).
  auto index = MakeHybrid(
      {GroupRule{}, GroupRule{GroupKind::kWindow, 2}, GroupRule{GroupKind::kState}}, 2, GetParam());
  const auto keys = Chain(100, 6);
  const ShardMask full = 0b000011, window = 0b001100, state = 0b110000;
  const ShardMask all = full | window | state;
  // Full KV on every page; the window's pages from page 2 on (0 and 1 were dropped); states
  // saved at boundaries 3 and 5 (pages 2 and 4), the one at 5 by rank 0 only so far.
  Put(*index, {keys[0], keys[1]}, std::nullopt, full);
  Put(*index, {keys[2]}, keys[1], full | window | state);
  Put(*index, {keys[3]}, keys[2], full | window);
  Put(*index, {keys[4]}, keys[3], full | window | 0b010000);
  Put(*index, {keys[5]}, keys[4], full | window);
  // Boundary 3 lacks the window's page 1, 5 rank 1's state, 6 any state: no hit at all.
  EXPECT_EQ(MatchOk(*index, keys, all).l2_pages, 0u);
  // Rank 0 alone (a group of its objects) hits at 5: window pages 3 and 4, the state at page 4.
  EXPECT_EQ(MatchOk(*index, keys, 0b010101).l2_pages, 5u);
  Put(*index, {keys[4]}, keys[3], 0b100000);
  const MatchResult hit = MatchOk(*index, keys, all, PinLease{7, kT0 + absl::Seconds(10)});
  EXPECT_EQ(hit.l2_pages, 5u);
  EXPECT_EQ(hit.pinned_pages, 5u);
  EXPECT_EQ(index->Inspect(keys[0])->pins, 1u);
  EXPECT_EQ(index->Inspect(keys[5])->pins, 0u);
  // A Load copies the full group everywhere, the window on pages 3 and 4, the state on page 4.
  EXPECT_EQ(index->NeededObjects(all, 5, 0), full);
  EXPECT_EQ(index->NeededObjects(all, 5, 2), full);
  EXPECT_EQ(index->NeededObjects(all, 5, 3), full | window);
  EXPECT_EQ(index->NeededObjects(all, 5, 4), all);
  EXPECT_EQ(index->NeededObjects(all, 5, 5), 0u);
  // A boundary shorter than the window needs every page before it: 1 is no hit (no state there).
  EXPECT_EQ(MatchOk(*index, {keys[0]}, all).l2_pages, 0u);
  EXPECT_EQ(index->ReleaseOwner(7), 5u);
  // Without a full group (a model whose every layer is windowed) only the window counts.
  auto swa = MakeHybrid({GroupRule{GroupKind::kWindow, 2}}, 1, GetParam());
  Put(*swa, keys, std::nullopt, 1);
  EXPECT_EQ(MatchOk(*swa, keys, 1).l2_pages, 6u);
  EXPECT_EQ(swa->NeededObjects(1, 6, 3), 0u);
  EXPECT_EQ(swa->NeededObjects(1, 6, 4), 1u);
}

// Events of a hybrid page are per group: stored when a group's first object arrives, removed for
// every group the page held when it leaves (vLLM's events carry group_idx the same way).
class RecordedEvents : public IndexEventSink {
 public:
  void OnIndexEvent(const IndexEvent& e) override {
    seen.push_back({e.kind == IndexEvent::Kind::kStored ? 'S' : 'R', e.group});
  }
  std::vector<std::pair<char, int16_t>> seen;
};

TEST_P(RadixIndexTest, HybridEventsNameTheGroup) {
  auto index = MakeHybrid({GroupRule{}, GroupRule{GroupKind::kWindow, 2}}, 2, GetParam());
  RecordedEvents events;
  index->SetEventSink(&events);
  const auto keys = Chain(300, 1);
  Put(*index, keys, std::nullopt, 0b0001);  // Rank 0's full-attention object: group 0 stored.
  Put(*index, keys, std::nullopt, 0b0010);  // Rank 1's: group 0 already there.
  Put(*index, keys, std::nullopt, 0b1100);  // The window's: group 1 stored once.
  using E = std::pair<char, int16_t>;
  EXPECT_THAT(events.seen, ::testing::ElementsAre(E{'S', 0}, E{'S', 1}));
  std::vector<ReleasedObject> evicted;
  ASSERT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_EQ(evicted.size(), 4u);
  EXPECT_THAT(events.seen, ::testing::ElementsAre(E{'S', 0}, E{'S', 1}, E{'R', 0}, E{'R', 1}));
  // A namespace without groups: one event per page, no group.
  auto plain = Make(2);
  RecordedEvents plain_events;
  plain->SetEventSink(&plain_events);
  Put(*plain, keys, std::nullopt, 0b11);
  EXPECT_THAT(plain_events.seen, ::testing::ElementsAre(E{'S', -1}));
}

// Labels: a page's tokens and engine hash reach its events in every medium, and live exactly as
// long as the page is indexed.
class LabelledEvents : public IndexEventSink {
 public:
  void OnIndexEvent(const IndexEvent& e) override { seen.push_back(e); }
  std::vector<IndexEvent> seen;
};

TEST_P(RadixIndexTest, LabelsReachEveryEventOfTheirPageAndGoWithIt) {
  auto index = Make(1, 1);
  LabelledEvents events;
  index->SetEventSink(&events);
  const auto keys = Chain(500, 3);
  // Pages 0 and 1 begin their writes, get labels (1: with an engine hash), then commit.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        index->BeginWrite(Write(keys[i], i == 0 ? std::nullopt : std::optional(keys[0]), 0)).ok());
  }
  auto with_tokens = std::make_shared<PageLabel>();
  with_tokens->tokens = {1, 2, 3};
  auto with_hash = std::make_shared<PageLabel>();
  with_hash->tokens = {4, 5, 6};
  with_hash->engine_hash = 0xabcdef;
  with_hash->has_engine_hash = true;
  const std::vector<std::shared_ptr<const PageLabel>> labels = {with_tokens, with_hash, nullptr};
  // keys[2] is not indexed: not labelled.
  EXPECT_EQ(index->Label(keys, labels, 0), 2u);
  EXPECT_EQ(index->Stats().labelled_pages, 2u);
  EXPECT_GT(index->Stats().label_bytes, 2 * 3 * sizeof(uint32_t));
  // A label is never replaced.
  auto other = std::make_shared<PageLabel>();
  other->tokens = {9, 9, 9};
  EXPECT_EQ(index->Label({keys[0]}, {other}, 0), 0u);
  EXPECT_EQ(index->LabelOf(keys[0])->tokens, (std::vector<uint32_t>{1, 2, 3}));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(index->Commit({keys[i], 0}).ok());
  ASSERT_EQ(events.seen.size(), 2u);
  EXPECT_EQ(events.seen[0].label, with_tokens);
  EXPECT_EQ(events.seen[0].hash, IntBlockHash(keys[0]));
  EXPECT_EQ(events.seen[1].hash, 0xabcdefu);
  EXPECT_EQ(events.seen[1].parent_hash, IntBlockHash(keys[0]));
  // In L3 too; and after L2 eviction the page keeps its label while L3 holds it.
  MarkL3(*index, {keys[0], keys[1]}, 0);
  ASSERT_EQ(events.seen.size(), 4u);
  EXPECT_EQ(events.seen[3].label, with_hash);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(2, &evicted), 2u);
  EXPECT_EQ(index->Stats().labelled_pages, 2u);
  // Removed from L2 under its engine hash.
  const auto removed = std::find_if(events.seen.begin(), events.seen.end(), [&](const auto& e) {
    return e.kind == IndexEvent::Kind::kRemoved && e.key == keys[1];
  });
  ASSERT_NE(removed, events.seen.end());
  EXPECT_EQ(removed->hash, 0xabcdefu);
  // Gone from every medium: the label goes with the node.
  MarkL3(*index, {keys[1]}, 0, 1, /*present=*/false);
  EXPECT_EQ(index->Stats().labelled_pages, 1u);
  EXPECT_EQ(index->LabelOf(keys[1]), nullptr);
  std::vector<ReleasedObject> released;
  index->Clear(&released);
  EXPECT_EQ(index->Stats().labelled_pages, 0u);
  EXPECT_EQ(index->Stats().label_bytes, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, LabelsStopAtTheirMemoryLimit) {
  auto index = Make();
  const auto keys = Chain(600, 4);
  Put(*index, keys);
  std::vector<std::shared_ptr<const PageLabel>> labels;
  for (int i = 0; i < 4; ++i) {
    auto l = std::make_shared<PageLabel>();
    l->tokens.assign(16, static_cast<uint32_t>(i));
    labels.push_back(l);
  }
  ASSERT_EQ(index->Label({keys[0]}, {labels[0]}, 0), 1u);
  const uint64_t one = index->Stats().label_bytes;
  // Room for two more labels: the third is not kept.
  EXPECT_EQ(index->Label(keys, labels, 3 * one), 2u);
  EXPECT_EQ(index->Stats().label_bytes, 3 * one);
  EXPECT_EQ(index->LabelOf(keys[3]), nullptr);
}

TEST_P(RadixIndexTest, HybridMatchAgreesWithTheRuleOnRandomPages) {
  // Against the definition, on random object sets: boundary b is a hit when pages [0, b) are
  // indexed and hold L2 data, every full group holds [0, b), every window group its last
  // min(b, W) pages, every state group page b - 1.
  std::mt19937 rng(7);
  const std::vector<GroupRule> rules = {GroupRule{}, GroupRule{GroupKind::kWindow, 3},
                                        GroupRule{GroupKind::kState},
                                        GroupRule{GroupKind::kWindow, 1}};
  const int tp = 2;
  int hits = 0;
  int l3_hits = 0;
  for (int round = 0; round < 300; ++round) {
    auto index = MakeHybrid(rules, tp, GetParam());
    const int n = static_cast<int>(rng() % 10);
    const auto keys = Chain(1000 * round, n);
    std::vector<ShardMask> have(n);
    std::vector<ShardMask> l3(n);  // Copies in tier 0: half the objects, on pages of 2 in 3.
    std::optional<PageKey> parent;
    for (int i = 0; i < n; ++i) {
      l3[i] = 0;
      const bool copied = rng() % 3 != 0;
      for (int b = 0; b < 8 && copied; ++b) l3[i] |= rng() % 2 != 0 ? ShardMask{1} << b : 0;
      // Each object present 7 times in 8; one page in 10 with none in L2.
      have[i] = 0;
      for (int b = 0; b < 8; ++b) have[i] |= rng() % 8 != 0 ? ShardMask{1} << b : 0;
      if (rng() % 10 == 0) have[i] = 0;
      if (have[i] == 0) {
        // Indexed without L2 (a copy in L3 only): such a page ends every hit.
        l3[i] |= 1;
      } else {
        Put(*index, {keys[i]}, parent, have[i]);
      }
      for (ShardMask m = l3[i]; m != 0; m &= m - 1) {
        L3Update u{keys[i], parent, static_cast<uint16_t>(std::countr_zero(m)), 0, true};
        absl::Status st;
        ASSERT_EQ(index->UpdateL3({&u, 1}, {&st, 1}), 1u) << st;
      }
      parent = keys[i];
    }
    // The longest boundary over the objects in `in`.
    auto rule = [&](ShardMask ask, const std::vector<ShardMask>& in) {
      for (int b = n; b >= 1; --b) {
        bool ok = true;
        for (int i = 0; i < b; ++i) ok = ok && in[i] != 0;
        for (size_t g = 0; g < rules.size(); ++g) {
          const ShardMask need = ask & (AllShards(tp) << (g * tp));
          int from = 0, to = b;  // Pages [from, to) need the group's objects.
          if (rules[g].kind == GroupKind::kWindow)
            from = std::max(0, b - int(rules[g].window_pages));
          if (rules[g].kind == GroupKind::kState) from = b - 1;
          for (int i = from; i < to; ++i) ok = ok && (in[i] & need) == need;
        }
        if (ok) return static_cast<uint32_t>(b);
      }
      return 0u;
    };
    std::vector<ShardMask> either(n);
    for (int i = 0; i < n; ++i) either[i] = have[i] | l3[i];
    for (const ShardMask ask : {AllShards(8), ShardMask{0b01010101}}) {
      const uint32_t want = rule(ask, have);
      const uint32_t reach = std::max(want, rule(ask, either));
      const MatchResult m = MatchOk(*index, keys, ask);
      EXPECT_EQ(m.l2_pages, want) << "round " << round;
      // L3 extends the boundary over L2 and the tier's copies together.
      EXPECT_EQ(m.l3_pages[0], reach - want) << "round " << round;
      EXPECT_EQ(m.best_l3_pages, reach - want) << "round " << round;
      EXPECT_EQ(m.best_l3_tier, reach > want ? 0 : -1) << "round " << round;
      hits += want > 0;
      l3_hits += reach > want;
    }
  }
  EXPECT_GE(hits, 150);  // The rule is exercised, not only its misses.
  EXPECT_GE(l3_hits, 50);
}

TEST_P(RadixIndexTest, HybridL3ReachesPastTheL2BoundaryWithTheObjectsItLacks) {
  // Full attention (object 0), a window of 2 pages (1), a recurrent state (2); two tiers.
  RadixIndexOptions o;
  o.shards_per_page = 3;
  o.l3_tiers = 2;
  o.groups = {GroupRule{}, GroupRule{GroupKind::kWindow, 2}, GroupRule{GroupKind::kState}};
  o.object_bytes = 1000;
  o.policy = GetParam();
  auto created = RadixIndex::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  RadixIndex& index = **created;
  RecordedEvents events;
  index.SetEventSink(&events);
  const auto keys = Chain(500, 6);
  // L2: full pages 0-3, the window on 2-3, the state at page 3 (a hit at boundary 4).
  Put(index, {keys[0], keys[1]}, std::nullopt, 0b001);
  Put(index, {keys[2]}, keys[1], 0b011);
  Put(index, {keys[3]}, keys[2], 0b111);
  auto copy = [&](int page, uint16_t shard, uint8_t tier, bool present = true) {
    L3Update u{keys[page], page > 0 ? std::optional(keys[page - 1]) : std::nullopt, shard, tier,
               present};
    absl::Status st;
    ASSERT_EQ(index.UpdateL3({&u, 1}, {&st, 1}), 1u) << st;
  };
  // Tier 0 (a written-through copy): every full page, the window on 4-5, the state at page 5.
  for (int p = 0; p < 6; ++p) copy(p, 0, 0);
  copy(4, 1, 0);
  copy(5, 1, 0);
  copy(5, 2, 0);
  // Tier 1: full pages 4 and 5 and the state at page 4, but the window only on page 4.
  copy(4, 0, 1);
  copy(5, 0, 1);
  copy(4, 1, 1);
  copy(4, 2, 1);
  MatchResult m = MatchOk(index, keys, 0b111);
  EXPECT_EQ(m.l2_pages, 4u);
  EXPECT_EQ(m.l3_pages[0], 2u);  // Boundary 6: L2's full pages 0-3, the tier's 4-5.
  EXPECT_EQ(m.l3_pages[1], 1u);  // Boundary 5: window pages 3 (L2) and 4, state at 4.
  EXPECT_EQ(m.best_l3_tier, 0);
  EXPECT_EQ(m.best_l3_pages, 2u);
  // What a prefetch of pages 4-5 for boundary 6 reads: the full group, window and state of 5.
  EXPECT_EQ(index.NeededObjects(0b111, 6, 4), 0b011u);
  EXPECT_EQ(index.NeededObjects(0b111, 6, 5), 0b111u);
  EXPECT_EQ(index.NeededObjects(0b111, 2, 0), 0b011u);  // The same rule on a chain of 2.
  // The tier's state at page 5 gone: boundary 6 has no state; tier 0 reaches no further.
  copy(5, 2, 0, false);
  m = MatchOk(index, keys, 0b111);
  EXPECT_EQ(m.l3_pages[0], 0u);
  EXPECT_EQ(m.best_l3_tier, 1);
  // Events name the group: tier 0 stored groups 0, 1 and 2 of page 5, then lost group 2's.
  using E = std::pair<char, int16_t>;
  EXPECT_EQ(std::count(events.seen.begin(), events.seen.end(), E{'R', 2}), 1);
  EXPECT_EQ(events.seen.back(), (E{'R', 2}));
}

TEST_P(RadixIndexTest, MlaSingleShard) {
  auto index = Make(/*shards=*/1);
  const auto keys = Chain(100, 3);
  Put(*index, keys);
  EXPECT_EQ(MatchOk(*index, keys, 1).l2_pages, 3u);
  EXPECT_EQ(index->Match(keys, MatchOptions{0b10, std::nullopt}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Match(keys, MatchOptions{0, std::nullopt}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(RadixIndexTest, L3HitsPerTierAfterTheL2Hit) {
  auto index = Make(/*shards=*/2, /*tiers=*/3);
  const auto keys = Chain(100, 7);
  const ShardMask all = 0b11;
  Put(*index, keys, std::nullopt, all);
  // L3 copies first, so that the pages evicted below stay as tombstones.
  MarkL3(*index, {keys.begin() + 2, keys.end()}, 0, all);         // Tier 0: pages 2..6.
  MarkL3(*index, {keys.begin() + 2, keys.begin() + 4}, 1, all);   // Tier 1: pages 2..3.
  MarkL3(*index, {keys.begin() + 2, keys.begin() + 6}, 2, 0b01);  // Tier 2: shard 0 only.
  // Evict the last five pages from L2 (leaf first), keeping pages 0 and 1.
  std::vector<ReleasedObject> evicted;
  ASSERT_EQ(index->EvictPages(5, &evicted), 5u);
  EXPECT_EQ(evicted.size(), 10u);
  MatchResult r = MatchOk(*index, keys, all);
  EXPECT_EQ(r.l2_pages, 2u);
  EXPECT_EQ(r.l3_pages[0], 5u);
  EXPECT_EQ(r.l3_pages[1], 2u);
  EXPECT_EQ(r.l3_pages[2], 0u);  // Shard 1 is missing in tier 2.
  EXPECT_EQ(r.best_l3_tier, 0);
  EXPECT_EQ(r.best_l3_pages, 5u);
  r = MatchOk(*index, keys, 0b01);
  EXPECT_EQ(r.l3_pages[2], 4u);
  EXPECT_EQ(r.best_l3_tier, 0);  // Tie-free: tier 0 holds 5.
  // A hole in tier 0 (page 4) cuts that tier's run there.
  MarkL3(*index, {keys[4]}, 0, 0b10, /*present=*/false);
  r = MatchOk(*index, keys, all);
  EXPECT_EQ(r.l3_pages[0], 2u);
  EXPECT_EQ(r.l3_pages[1], 2u);
  EXPECT_EQ(r.best_l3_tier, 0);  // Ties go to the earlier tier.
  EXPECT_EQ(index->Stats().l3_objects[0], 9u);
}

TEST_P(RadixIndexTest, PrefetchIntoL2IsInvisibleAndKeepsTheL3Hit) {
  auto index = Make();
  const auto keys = Chain(100, 2);
  Put(*index, keys);
  MarkL3(*index, keys, 1);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(10, &evicted), 2u);
  EXPECT_EQ(index->Stats().pages, 2u);  // Tombstones: tier 1 still holds them.
  // Prefetch page 0 back: in flight in L2, still an L3 hit.
  ASSERT_TRUE(
      index->BeginWrite(WriteRequest{keys[0], std::nullopt, 0, NextSlot(), WriteKind::kPrefetch})
          .ok());
  MatchResult r = MatchOk(*index, keys);
  EXPECT_EQ(r.l2_pages, 0u);
  EXPECT_EQ(r.l3_pages[1], 2u);
  EXPECT_EQ(index->Inspect(keys[0])->shards[0].l2, L2State::kWriting);
  EXPECT_EQ(index->Inspect(keys[0])->shards[0].write_kind, WriteKind::kPrefetch);
  ASSERT_TRUE(index->Commit({keys[0], 0}).ok());
  r = MatchOk(*index, keys);
  EXPECT_EQ(r.l2_pages, 1u);
  EXPECT_EQ(r.l3_pages[1], 1u);
}

TEST_P(RadixIndexTest, EvictionIsLeafFirst) {
  auto index = Make();
  const auto keys = Chain(100, 4);
  Put(*index, keys);
  MatchOk(*index, keys);  // Access them all.
  std::vector<ReleasedObject> evicted;
  for (int i = 3; i >= 0; --i) {
    ASSERT_EQ(index->EvictPages(1, &evicted), 1u);
    EXPECT_EQ(evicted.back().key, keys[i]);
    ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  }
  EXPECT_EQ(index->EvictPages(1, &evicted), 0u);
  EXPECT_EQ(index->Stats().pages, 0u);  // No tier holds them: they left the tree.
  EXPECT_EQ(index->Stats().evicted_pages, 4u);
}

TEST_P(RadixIndexTest, EvictionSkipsPagesWithAnL2Child) {
  auto index = Make();
  // Root with a child: the root is older under both policies but must wait for its child.
  Put(*index, {Key(1)});
  Put(*index, {Key(2)}, Key(1));
  EXPECT_FALSE(index->Inspect(Key(1))->evictable);
  std::vector<ReleasedObject> evicted;
  ASSERT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_EQ(evicted[0].key, Key(2));
  EXPECT_TRUE(index->Inspect(Key(1))->evictable);
  ASSERT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_EQ(evicted[1].key, Key(1));
}

TEST_P(RadixIndexTest, InFlightShardBlocksEvictionUntilCommitOrAbort) {
  auto index = Make(/*shards=*/2);
  Put(*index, {Key(1)}, std::nullopt, 0b01);
  ASSERT_TRUE(index->BeginWrite(Write(Key(1), std::nullopt, 1)).ok());
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(1, &evicted), 0u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  ASSERT_TRUE(index->Commit({Key(1), 1}).ok());
  EXPECT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_EQ(evicted.size(), 2u);  // Both shards leave together.

  // An in-flight child also blocks its parent.
  Put(*index, {Key(10)}, std::nullopt, 0b11);
  ASSERT_TRUE(index->BeginWrite(Write(Key(11), Key(10), 0)).ok());
  EXPECT_EQ(index->EvictPages(1, &evicted), 0u);
  std::vector<ReleasedObject> aborted;
  const ObjectId obj{Key(11), 0};
  EXPECT_EQ(index->Abort({&obj, 1}, &aborted), 1u);
  EXPECT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, PinsBlockEvictionAndUnpinReleases) {
  auto index = Make();
  const auto keys = Chain(100, 3);
  Put(*index, keys);
  EXPECT_EQ(index->Pin(7, keys, kT0 + absl::Seconds(30)), 3u);
  EXPECT_EQ(index->Pin(7, {Key(999)}, kT0 + absl::Seconds(30)), 0u);  // Unknown: skipped.
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(3, &evicted), 0u);
  EXPECT_EQ(index->Stats().pinned_pages, 3u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  EXPECT_EQ(index->Unpin(8, keys), 0u);  // Another owner has nothing to drop.
  EXPECT_EQ(index->Unpin(7, {keys[2]}), 1u);
  EXPECT_EQ(index->EvictPages(3, &evicted), 1u);  // Only the unpinned leaf.
  EXPECT_EQ(evicted[0].key, keys[2]);
  EXPECT_EQ(index->Unpin(7, keys), 2u);
  EXPECT_EQ(index->EvictPages(3, &evicted), 2u);
  EXPECT_EQ(index->Stats().pinned_pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, MatchPinsTheL2HitAtomically) {
  auto index = Make();
  const auto keys = Chain(100, 4);
  Put(*index, {keys[0], keys[1]});
  MatchResult r = MatchOk(*index, keys, 1, PinLease{42, kT0 + absl::Seconds(5)});
  EXPECT_EQ(r.l2_pages, 2u);
  EXPECT_EQ(r.pinned_pages, 2u);
  EXPECT_EQ(index->Inspect(keys[0])->pins, 1u);
  EXPECT_EQ(index->Inspect(keys[1])->pins, 1u);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(10, &evicted), 0u);
  // The same owner matching again holds two pins; one unpin leaves one.
  MatchOk(*index, keys, 1, PinLease{42, kT0 + absl::Seconds(9)});
  EXPECT_EQ(index->Stats().pins, 4u);
  EXPECT_EQ(index->Unpin(42, keys), 2u);
  EXPECT_EQ(index->EvictPages(10, &evicted), 0u);
  EXPECT_EQ(index->Unpin(42, keys), 2u);
  EXPECT_EQ(index->EvictPages(10, &evicted), 2u);
}

TEST_P(RadixIndexTest, LeasesExpireWithoutTheOwner) {
  auto index = Make();
  const auto keys = Chain(100, 2);
  Put(*index, keys);
  index->Pin(1, {keys[0]}, kT0 + absl::Seconds(10));
  index->Pin(2, {keys[1]}, kT0 + absl::Seconds(20));
  index->Pin(1, {keys[1]}, kT0 + absl::Seconds(10));
  EXPECT_EQ(index->ExpireLeases(kT0 + absl::Seconds(5)), 0u);
  EXPECT_EQ(index->ExpireLeases(kT0 + absl::Seconds(10)), 2u);  // Owner 1's two leases.
  EXPECT_EQ(index->Stats().pinned_pages, 1u);
  // Owner 2's later lease is its own: owner 1's expiry did not touch it, nor extend 1's.
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(10, &evicted), 0u);  // keys[0] has the pinned keys[1] below it.
  EXPECT_EQ(index->ExpireLeases(kT0 + absl::Seconds(20)), 1u);
  EXPECT_EQ(index->Stats().pins, 0u);
  EXPECT_EQ(index->Stats().expired_pins, 3u);
  EXPECT_EQ(index->EvictPages(10, &evicted), 2u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, ReleaseOwnerDropsOnlyThatOwnersPins) {
  auto index = Make();
  const auto keys = Chain(100, 3);
  Put(*index, keys);
  index->Pin(1, keys, kT0 + absl::Hours(1));
  index->Pin(2, {keys[0]}, kT0 + absl::Hours(1));
  EXPECT_EQ(index->ReleaseOwner(1), 3u);
  EXPECT_EQ(index->Stats().pinned_pages, 1u);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(10, &evicted), 2u);  // keys[2], keys[1]; keys[0] is owner 2's.
  EXPECT_EQ(index->ReleaseOwner(2), 1u);
  EXPECT_EQ(index->EvictPages(10, &evicted), 1u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, EvictedPageWithAnL3CopyStaysAsATombstoneAndStillHitsL3) {
  auto index = Make();
  const auto keys = Chain(100, 3);
  Put(*index, keys);
  MarkL3(*index, keys, 0);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(10, &evicted), 3u);
  for (const ReleasedObject& e : evicted) EXPECT_EQ(e.l3_tiers, 1u);
  const RadixIndexStats s = index->Stats();
  EXPECT_EQ(s.pages, 3u);
  EXPECT_EQ(s.l2_pages, 0u);
  EXPECT_EQ(s.l2_objects, 0u);
  EXPECT_EQ(s.l3_objects[0], 3u);
  const MatchResult r = MatchOk(*index, keys);
  EXPECT_EQ(r.l2_pages, 0u);
  EXPECT_EQ(r.l3_pages[0], 3u);
  EXPECT_EQ(r.best_l3_tier, 0);
  const auto info = index->Inspect(keys[1]);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->shards[0].l2, L2State::kAbsent);
  EXPECT_FALSE(info->shards[0].slot.valid());
}

TEST_P(RadixIndexTest, PageNoTierHoldsLeavesTheTree) {
  auto index = Make();
  const auto keys = Chain(100, 2);
  Put(*index, keys);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_FALSE(index->Inspect(keys[1]).has_value());
  EXPECT_EQ(index->Stats().pages, 1u);
  // Clearing the last L3 copy of a tombstone leaf removes it too.
  MarkL3(*index, {keys[0]}, 1);
  EXPECT_EQ(index->EvictPages(1, &evicted), 1u);
  EXPECT_EQ(index->Stats().pages, 1u);
  MarkL3(*index, {keys[0]}, 1, 1, /*present=*/false);
  EXPECT_EQ(index->Stats().pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, EmptyParentStaysWhileAChildIsHeldInL3) {
  auto index = Make();
  const auto keys = Chain(100, 2);
  Put(*index, keys);
  MarkL3(*index, {keys[1]}, 0);  // Only the child is in L3.
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(2, &evicted), 2u);
  // The parent holds nothing but must stay: its child is indexed in L3 and the tree is
  // prefix-closed. The child is unreachable by Match until the parent is written again.
  EXPECT_EQ(index->Stats().pages, 2u);
  EXPECT_EQ(MatchOk(*index, keys).l3_pages[0], 0u);
  Put(*index, {keys[0]});
  MatchResult r = MatchOk(*index, keys);
  EXPECT_EQ(r.l2_pages, 1u);
  EXPECT_EQ(r.l3_pages[0], 1u);
  EXPECT_EQ(index->EvictPages(2, &evicted), 1u);
  // Dropping the child's copy collects the child, then the empty parent.
  MarkL3(*index, {keys[1]}, 0, 1, /*present=*/false);
  EXPECT_EQ(index->Stats().pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, UpdateL3CreatesPagesFoundInStorage) {
  auto index = Make(/*shards=*/1, /*tiers=*/2);
  const auto keys = Chain(100, 3);
  std::vector<L3Update> ups = {{keys[0], std::nullopt, 0, 1, true},
                               {keys[1], keys[0], 0, 1, true},
                               {keys[2], keys[1], 0, 1, true},
                               {keys[2], keys[1], 0, 2, true}};  // Tier 2 does not exist.
  std::vector<absl::Status> st(ups.size());
  EXPECT_EQ(index->UpdateL3(ups, absl::MakeSpan(st)), 3u);
  EXPECT_EQ(st[3].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MatchOk(*index, keys).l3_pages[1], 3u);
  EXPECT_EQ(index->Stats().l3_objects[1], 3u);
}

TEST_P(RadixIndexTest, RemovePageKeepsDescendantsBehindATombstone) {
  auto index = Make();
  const auto keys = Chain(100, 3);
  Put(*index, keys);
  MarkL3(*index, {keys[1]}, 0);
  std::vector<ReleasedObject> released;
  RemoveCounts c = index->RemovePages({keys[1], Key(999)}, &released);
  EXPECT_EQ(c.removed_pages, 1u);
  EXPECT_EQ(c.missing_keys, 1u);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_TRUE(released[0].slot.valid());
  EXPECT_EQ(released[0].l3_tiers, 1u);  // The caller deletes that L3 copy.
  EXPECT_EQ(MatchOk(*index, keys).l2_pages, 1u);
  EXPECT_EQ(index->Stats().pages, 3u);
  EXPECT_EQ(index->Stats().l3_objects[0], 0u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, RemoveSubtreeSparesBusyPagesAndTheirAncestors) {
  auto index = Make();
  //      1 - 2 - 3 - 4
  //           \- 5 - 6
  Put(*index, {Key(1), Key(2), Key(3), Key(4)});
  Put(*index, {Key(5), Key(6)}, Key(2));
  MarkL3(*index, {Key(3)}, 1);
  index->Pin(9, {Key(6)}, kT0 + absl::Seconds(1));
  std::vector<ReleasedObject> released;
  RemoveCounts c = index->RemoveSubtree(Key(2), &released);
  EXPECT_EQ(c.removed_pages, 4u);  // 2, 3, 4, 5 dropped; 6 pinned.
  EXPECT_EQ(c.busy_pages, 1u);
  EXPECT_EQ(released.size(), 4u);
  // 2 and 5 stay as empty tombstones on the path to the pinned 6; 3 and 4 are gone.
  EXPECT_TRUE(index->Inspect(Key(2)).has_value());
  EXPECT_TRUE(index->Inspect(Key(5)).has_value());
  EXPECT_FALSE(index->Inspect(Key(3)).has_value());
  EXPECT_FALSE(index->Inspect(Key(4)).has_value());
  EXPECT_EQ(index->Stats().pages, 4u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  index->ReleaseOwner(9);
  c = index->RemoveSubtree(Key(2), &released);
  EXPECT_EQ(c.removed_pages, 3u);
  EXPECT_EQ(index->Stats().pages, 1u);  // Key(1) remains, still in L2.
  EXPECT_EQ(index->RemoveSubtree(Key(77), &released).missing_keys, 1u);
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, ClearReleasesEverySlotExactlyOnce) {
  auto index = Make(/*shards=*/2);
  std::vector<SlotRef> given;
  for (int chain = 0; chain < 5; ++chain) {
    std::optional<PageKey> parent;
    for (int i = 0; i < 4; ++i) {
      const PageKey k = Key(chain * 100 + i);
      for (uint16_t s = 0; s < 2; ++s) {
        const WriteRequest w = Write(k, parent, s);
        given.push_back(w.slot);
        ASSERT_TRUE(index->BeginWrite(w).ok());
        if (i != 3) {
          ASSERT_TRUE(index->Commit({k, s}).ok());  // The last page stays in flight.
        }
      }
      parent = k;
    }
  }
  std::vector<ReleasedObject> released;
  RemoveCounts c = index->Clear(&released);
  EXPECT_EQ(c.busy_pages, 5u);
  EXPECT_EQ(index->Stats().l2_objects, 0u);
  std::vector<ObjectId> inflight;
  for (int chain = 0; chain < 5; ++chain) {
    inflight.push_back({Key(chain * 100 + 3), 0});
    inflight.push_back({Key(chain * 100 + 3), 1});
  }
  EXPECT_EQ(index->Abort(inflight, &released), 10u);
  EXPECT_EQ(index->Stats().pages, 0u);
  std::vector<SlotRef> got;
  for (const ReleasedObject& r : released) got.push_back(r.slot);
  EXPECT_THAT(got, UnorderedElementsAreArray(given));
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST_P(RadixIndexTest, WatermarksDriveEvictionDownToLow) {
  auto index = Make(/*shards=*/1, /*tiers=*/0, /*capacity=*/10'000);  // 10 objects.
  Put(*index, Chain(100, 8));
  EXPECT_FALSE(index->NeedsEviction());  // 8000 <= 0.8 * 10000.
  ASSERT_TRUE(index->BeginWrite(Write(Key(200), std::nullopt, 0)).ok());
  EXPECT_TRUE(index->NeedsEviction());  // In-flight slots count: 9000 > 8000.
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictToLowWatermark(&evicted), 4000u);
  EXPECT_EQ(index->Stats().l2_bytes, 5000u);  // Low watermark: 0.5 * 10000.
  EXPECT_FALSE(index->NeedsEviction());
  EXPECT_EQ(index->EvictToLowWatermark(&evicted), 0u);
  index->SetCapacity(0);
  EXPECT_FALSE(index->NeedsEviction());
  EXPECT_EQ(index->EvictBytes(2500, &evicted), 3000u);  // Whole pages.
}

TEST_P(RadixIndexTest, GetL2SlotsForLoad) {
  auto index = Make(/*shards=*/2);
  Put(*index, {Key(1)}, std::nullopt, 0b11);
  Put(*index, {Key(2)}, Key(1), 0b01);
  std::vector<SlotRef> slots(3);
  const PageKey keys[] = {Key(1), Key(2), Key(3)};
  EXPECT_EQ(index->GetL2Slots(keys, 1, absl::MakeSpan(slots)), 1u);
  EXPECT_TRUE(slots[0].valid());
  EXPECT_FALSE(slots[1].valid());
  EXPECT_EQ(index->GetL2Slots(keys, 0, absl::MakeSpan(slots)), 2u);
  EXPECT_EQ(slots[1], index->Inspect(Key(2))->shards[0].slot);
}

TEST_P(RadixIndexTest, LongChainsEvictInLinearTime) {
  // 20k pages in one chain, inserted root first (the worst order for leaf-first eviction): with
  // parking this is linear; with requeueing it would be 2e8 candidate visits.
  auto index = Make(/*shards=*/1, /*tiers=*/0);
  const auto keys = Chain(1, 20'000);
  Put(*index, keys);
  std::vector<ReleasedObject> evicted;
  const absl::Time start = absl::Now();
  EXPECT_EQ(index->EvictPages(keys.size(), &evicted), keys.size());
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(index->Stats().pages, 0u);
  // Leaf first, all the way up.
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(evicted[i].key, keys[keys.size() - 1 - i]);
}

TEST_P(RadixIndexTest, WideFanOutUnlinksInConstantTime) {
  // A shared system prompt with many continuations: removing children must not scan siblings.
  auto index = Make(/*shards=*/1, /*tiers=*/0);
  Put(*index, {Key(1)});
  for (int i = 0; i < 5000; ++i) {
    ASSERT_TRUE(index->BeginWrite(Write(Key(1000 + i), Key(1), 0)).ok());
    ASSERT_TRUE(index->Commit({Key(1000 + i), 0}).ok());
  }
  EXPECT_EQ(index->Inspect(Key(1))->children, 5000u);
  std::vector<ReleasedObject> evicted;
  EXPECT_EQ(index->EvictPages(6000, &evicted), 5001u);
  EXPECT_EQ(evicted.back().key, Key(1));
  EXPECT_TRUE(index->CheckInvariants().ok());
}

TEST(RadixIndexConcurrencyTest, ConcurrentMatchInsertEvictKeepInvariants) {
  RadixIndexOptions o;
  o.shards_per_page = 2;
  o.l3_tiers = 1;
  o.object_bytes = 1;
  auto created = RadixIndex::Create(o);
  ASSERT_TRUE(created.ok());
  RadixIndex& index = **created;
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&index, t] {
      uint32_t slot = t * 1'000'000;
      for (int round = 0; round < 200; ++round) {
        std::vector<PageKey> keys = Chain((t * 1000 + round % 50) * 100, 16);
        std::optional<PageKey> parent;
        for (const PageKey& k : keys) {
          for (uint16_t s = 0; s < 2; ++s) {
            if (index.BeginWrite(WriteRequest{k, parent, s, SlotRef{0, 0, slot++}}).ok()) {
              (void)index.Commit({k, s});
            }
          }
          parent = k;
        }
        auto r = index.Match(keys, MatchOptions{0b11, PinLease{uint64_t(t), kT0}});
        EXPECT_TRUE(r.ok());
        std::vector<ReleasedObject> evicted;
        index.EvictPages(8, &evicted);
        index.Unpin(t, keys);
        index.ExpireLeases(kT0);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_TRUE(index.CheckInvariants().ok()) << index.CheckInvariants();
  EXPECT_EQ(index.Stats().pins, 0u);
}

// --- Admin scope (AdminService Evict / Clear) ----------------------------------------------------

TEST_P(RadixIndexTest, EvictScopeTakesOnlyTheSubtreeLeafFirstAndRestoresTheRest) {
  auto index = Make();
  const std::vector<PageKey> a = Chain(100, 5);
  const std::vector<PageKey> b = Chain(200, 3);
  Put(*index, a);
  Put(*index, b);
  // Dry run: the whole subtree of a[2] (three pages), nothing changes.
  std::vector<ReleasedObject> evicted;
  AdminEvictResult dry = index->EvictScope(a[2], 0, /*dry_run=*/true, &evicted);
  EXPECT_EQ(dry.pages, 3u);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(index->Usage(std::nullopt).l2_pages, 8u);
  // Two objects from the subtree of a[1]: the chain's last two pages, never b.
  AdminEvictResult r = index->EvictScope(a[1], 2, /*dry_run=*/false, &evicted);
  EXPECT_EQ(r.pages, 2u);
  ASSERT_EQ(evicted.size(), 2u);
  EXPECT_EQ(MatchOk(*index, a).l2_pages, 3u);
  EXPECT_EQ(MatchOk(*index, b).l2_pages, 3u);
  EXPECT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  // The pages the policy was refused are still evictable by ordinary eviction.
  EXPECT_EQ(index->EvictPages(100, &evicted), 6u);
  EXPECT_EQ(index->Usage(std::nullopt).l2_pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
}

TEST_P(RadixIndexTest, EvictScopeSkipsPinnedAndInFlightPages) {
  auto index = Make();
  const std::vector<PageKey> a = Chain(300, 3);
  Put(*index, a);
  MatchOk(*index, {a[0]}, 1, PinLease{7, kT0 + absl::Hours(1)});
  ASSERT_TRUE(index->BeginWrite(Write(Key(400), a[2], 0)).ok());  // A child in flight.
  std::vector<ReleasedObject> evicted;
  AdminEvictResult r = index->EvictScope(std::nullopt, 0, false, &evicted);
  EXPECT_EQ(r.skipped_pinned_pages, 1u);
  EXPECT_EQ(r.skipped_in_flight_pages, 1u);
  EXPECT_EQ(r.pages, 0u);  // a[2] has a child writing L2, a[1] then a[2], a[0] is pinned.
  EXPECT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
}

TEST_P(RadixIndexTest, ClearScopeDoomsBusyPagesAndReapsThemWhenTheCopyEnds) {
  auto index = Make();
  const std::vector<PageKey> a = Chain(500, 4);
  Put(*index, a);
  // A Load's copy pins a[0..1]; a write of a child of a[3] is in flight.
  MatchOk(*index, {a[0], a[1]}, 1, PinLease{9, kT0 + absl::Hours(1)});
  WriteRequest child = Write(Key(600), a[3], 0);
  ASSERT_TRUE(index->BeginWrite(child).ok());
  std::vector<ReleasedObject> released;
  RemoveCounts c = index->ClearScope(std::nullopt, /*dry_run=*/false, &released);
  EXPECT_EQ(c.removed_pages, 2u);  // a[2], a[3]
  EXPECT_EQ(c.busy_pages, 3u);     // a[0], a[1] pinned; the child in flight.
  EXPECT_EQ(released.size(), 2u);
  EXPECT_EQ(index->DoomedPages(), 3u);
  // Doomed pages are invisible at once, though their slots are still held.
  EXPECT_EQ(MatchOk(*index, a).l2_pages, 0u);
  ASSERT_TRUE(index->Commit({Key(600), 0}).ok());
  EXPECT_EQ(MatchOk(*index, {Key(600)}).l2_pages, 0u);
  // Nothing is reaped while the pin holds; the committed child goes now.
  released.clear();
  EXPECT_EQ(index->ReapDoomed(&released), 1u);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].slot, child.slot);
  EXPECT_EQ(index->ReleaseOwner(9), 2u);
  released.clear();
  EXPECT_EQ(index->ReapDoomed(&released), 2u);
  EXPECT_EQ(released.size(), 2u);
  EXPECT_EQ(index->DoomedPages(), 0u);
  EXPECT_EQ(index->Stats().pages, 0u);
  EXPECT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  // A page written again after the clear is visible.
  Put(*index, {a[0]});
  EXPECT_EQ(MatchOk(*index, {a[0]}).l2_pages, 1u);
}

// ---- EvictHolders (region release) -------------------------------------------------------------

SlotHolder HolderOf(const RadixIndex& index, const PageKey& key, uint16_t shard = 0) {
  std::optional<PageInfo> info = index.Inspect(key);
  EXPECT_TRUE(info.has_value());
  return SlotHolder{key, shard, info.has_value() ? info->shards[shard].slot : SlotRef{}};
}

TEST_P(RadixIndexTest, EvictHoldersTakesThePagesAndTheirL2DescendantsLeafFirst) {
  auto index = Make(/*shards=*/2);
  const std::vector<PageKey> chain = Chain(100, 5);  // 100 <- 101 <- ... <- 104
  Put(*index, chain, std::nullopt, 0b11);
  const std::vector<PageKey> other = Chain(200, 2);
  Put(*index, other, std::nullopt, 0b11);
  MarkL3(*index, {chain[3]}, 0, 0b11);  // Stays as a tombstone with its L3 copies.

  // The holder is page 102's shard 1: 102, 103 and 104 go (all shards), 100 and 101 stay.
  const SlotHolder h = HolderOf(*index, chain[2], 1);
  std::vector<ReleasedObject> evicted;
  HolderEvictResult dry = index->EvictHolders({&h, 1}, /*dry_run=*/true, &evicted);
  EXPECT_EQ(dry.pages, 3u);
  EXPECT_EQ(dry.objects, 6u);
  EXPECT_EQ(dry.held, 1u);
  EXPECT_EQ(dry.blocked, 0u);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(index->Stats().l2_pages, 7u);

  HolderEvictResult real = index->EvictHolders({&h, 1}, /*dry_run=*/false, &evicted);
  EXPECT_EQ(real.pages, 3u);
  EXPECT_EQ(real.objects, 6u);
  ASSERT_EQ(evicted.size(), 6u);
  EXPECT_EQ(evicted.front().key, chain[4]);  // Children before parents.
  EXPECT_EQ(evicted.back().key, chain[2]);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  EXPECT_EQ(index->Stats().l2_pages, 4u);
  EXPECT_EQ(index->Stats().evicted_pages, 3u);
  EXPECT_EQ(MatchOk(*index, chain).l2_pages, 2u);
  EXPECT_EQ(MatchOk(*index, other).l2_pages, 2u);
  std::optional<PageInfo> tomb = index->Inspect(chain[3]);
  ASSERT_TRUE(tomb.has_value());  // Evicted from L2, still indexed for its L3 copies.
  EXPECT_EQ(tomb->shards[0].l3_tiers, 1);
  EXPECT_FALSE(index->Inspect(chain[4]).has_value());
}

TEST_P(RadixIndexTest, EvictHoldersNeverTakesBusyPagesOrTheirAncestors) {
  auto index = Make();
  const std::vector<PageKey> chain = Chain(100, 3);
  Put(*index, chain);
  const std::vector<PageKey> lone = Chain(300, 1);
  Put(*index, lone);
  ASSERT_EQ(index->Pin(7, {&chain[2], 1}, kT0 + absl::Seconds(30)), 1u);
  // An in-flight write under `lone`.
  const PageKey child = Key(301);
  ASSERT_TRUE(index->BeginWrite(Write(child, lone[0], 0)).ok());

  const std::vector<SlotHolder> holders = {HolderOf(*index, chain[0]), HolderOf(*index, chain[1]),
                                           HolderOf(*index, lone[0])};
  std::vector<ReleasedObject> evicted;
  HolderEvictResult dry = index->EvictHolders(holders, /*dry_run=*/true, &evicted);
  EXPECT_EQ(dry.pages, 0u);
  EXPECT_EQ(dry.blocked, 3u);
  HolderEvictResult real = index->EvictHolders(holders, /*dry_run=*/false, &evicted);
  EXPECT_EQ(real.pages, 0u);
  EXPECT_EQ(real.blocked, 3u);
  EXPECT_TRUE(evicted.empty());
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();

  // Once the pin is gone and the write committed, everything goes.
  ASSERT_EQ(index->Unpin(7, {&chain[2], 1}), 1u);
  ASSERT_TRUE(index->Commit({child, 0}).ok());
  real = index->EvictHolders(holders, /*dry_run=*/false, &evicted);
  EXPECT_EQ(real.pages, 5u);
  EXPECT_EQ(real.blocked, 0u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  EXPECT_EQ(index->Stats().l2_pages, 0u);
}

TEST_P(RadixIndexTest, EvictHoldersSkipsHoldersWhoseSlotTheIndexDoesNotHold) {
  auto index = Make();
  const std::vector<PageKey> chain = Chain(100, 2);
  Put(*index, chain);
  const SlotHolder stale{chain[1], 0, SlotRef{0, 9, 9999}};  // Another slot than the page's.
  const SlotHolder missing{Key(999), 0, SlotRef{0, 0, 1}};
  const SlotHolder bad_shard{chain[1], 5, SlotRef{0, 0, 1}};
  const std::vector<SlotHolder> holders = {stale, missing, bad_shard};
  std::vector<ReleasedObject> evicted;
  HolderEvictResult r = index->EvictHolders(holders, /*dry_run=*/false, &evicted);
  EXPECT_EQ(r.absent, 3u);
  EXPECT_EQ(r.held, 0u);
  EXPECT_EQ(r.pages, 0u);
  EXPECT_EQ(index->Stats().l2_pages, 2u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
}

TEST_P(RadixIndexTest, EvictHoldersWithOverlappingHoldersEvictsEachPageOnce) {
  auto index = Make(/*shards=*/2);
  const std::vector<PageKey> chain = Chain(100, 4);
  Put(*index, chain, std::nullopt, 0b11);
  // Both shards of every page, the deepest first: each page reached twice, and from above.
  std::vector<SlotHolder> holders;
  for (int i = 3; i >= 0; --i) {
    holders.push_back(HolderOf(*index, chain[i], 0));
    holders.push_back(HolderOf(*index, chain[i], 1));
  }
  std::vector<ReleasedObject> evicted;
  HolderEvictResult r = index->EvictHolders(holders, /*dry_run=*/false, &evicted);
  EXPECT_EQ(r.pages, 4u);
  EXPECT_EQ(r.objects, 8u);
  EXPECT_EQ(evicted.size(), 8u);
  EXPECT_EQ(r.held, 8u);
  ASSERT_TRUE(index->CheckInvariants().ok()) << index->CheckInvariants();
  EXPECT_EQ(index->Stats().pages, 0u);
}

}  // namespace
}  // namespace kvcellar::core
