// Tests the L3 side of server/rpc/cache_service.h (Match L3 hits, the Prefetch RPC, write-through
// and the prefetch statuses) with a real file tier in a temp directory, on the harness of
// cache_test_harness.h. Bytes are checked against the pattern the writing engine filled in.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cache_test_harness.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;

std::string TempDir() {
  std::string t = absl::StrCat(::testing::TempDir(), "/kvc-l3-XXXXXX");
  char* d = ::mkdtemp(t.data());
  EXPECT_NE(d, nullptr);
  return t;
}

HarnessOptions WithFileTier(const std::string& dir, uint64_t max_prefetch_bytes = 1 << 30) {
  HarnessOptions o;
  o.storage.tiers = absl::StrCat("file:", dir, "?name=nvme&io=threads");
  o.storage.max_pending_prefetch_bytes = max_prefetch_bytes;
  return o;
}

std::vector<int> Statuses(const v1::OpResult& op, int seq = 0) {
  const v1::SequenceResult& r = op.sequences(seq);
  return std::vector<int>(r.page_status().begin(), r.page_status().end());
}

// Backs up pages [0, n) of `keys` from blocks [0, n), waits for the op and for the L3 writes,
// then evicts every page from L2 so that only the L3 copies remain.
void StoreInL3Only(CacheHarness& h, TestEngine& e, const std::vector<core::PageKey>& keys,
                   size_t n) {
  std::vector<uint32_t> blocks;
  for (uint32_t b = 0; b < n; ++b) blocks.push_back(b);
  v1::OpResult op = h.Wait(e.session, h.Backup(e.session, keys, 0, n, blocks).op().op_id());
  ASSERT_EQ(op.state(), v1::OP_STATE_DONE);
  h.cache().l3_writer().Drain();
  for (const auto& ns : h.cache().namespaces().Snapshot()) {
    std::vector<core::ReleasedObject> evicted;
    ns->index()->EvictBytes(~uint64_t{0} >> 1, &evicted);
    for (const core::ReleasedObject& r : evicted) {
      EXPECT_NE(r.l3_tiers, 0) << "evicted before its L3 copy was written";
      ASSERT_TRUE(h.pool().Free(r.slot).ok());
    }
  }
}

v1::PrefetchRequest PrefetchOf(uint64_t session, const std::vector<core::PageKey>& keys,
                               size_t begin, size_t end, v1::PrefetchPolicy policy) {
  v1::PrefetchRequest req;
  req.set_session_id(session);
  v1::PrefetchSequence* seq = req.add_sequences();
  if (begin > 0) seq->set_parent_key(std::string(keys[begin - 1].AsBytes()));
  seq->set_page_keys(KeyBlob(keys, begin, end));
  req.set_policy(policy);
  return req;
}

TEST(L3CacheTest, RegistrationNamesTheTiersAndDefaultPolicies) {
  CacheHarness h(WithFileTier(TempDir()));
  TestEngine e(16, false, 1);
  v1::RegisterEngineResponse r = h.Register(e, "inst", 0, Spec());
  EXPECT_THAT(r.l3_tier_names(), ElementsAre("nvme"));
  EXPECT_EQ(r.default_write_policy(), v1::WRITE_POLICY_WRITE_THROUGH);
  EXPECT_EQ(r.default_prefetch_policy(), v1::PREFETCH_POLICY_BEST_EFFORT);
}

TEST(L3CacheTest, WriteThroughThenMatchPrefetchesAndLoadIsByteExact) {
  CacheHarness h(WithFileTier(TempDir()));
  TestEngine a(16, false, 7);
  TestEngine b(16, false, 8);
  h.Register(a, "writer", 0, Spec());
  h.Register(b, "reader", 0, Spec());
  const std::vector<uint32_t> tokens = Tokens(1, 6);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), tokens);
  StoreInL3Only(h, a, keys, 6);

  v1::MatchRequest m;
  m.set_session_id(b.session);
  m.add_sequences()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  m.set_prefetch_policy(v1::PREFETCH_POLICY_WAIT_COMPLETE);
  m.set_pin(true);
  v1::MatchResponse mr;
  ASSERT_TRUE(h.Match(m, &mr).ok());
  ASSERT_EQ(mr.results_size(), 1);
  EXPECT_EQ(mr.results(0).l2_hit_pages(), 0u);
  EXPECT_EQ(mr.results(0).l3_hit_pages(), 6u);
  EXPECT_THAT(mr.results(0).l3_hit_pages_by_tier(), ElementsAre(6u));
  EXPECT_EQ(mr.results(0).prefetch_pages(), 6u);
  ASSERT_NE(mr.prefetch_op_id(), 0u);
  ASSERT_NE(mr.results(0).pin_id(), 0u);
  v1::OpResult op = h.Wait(b.session, mr.prefetch_op_id());
  EXPECT_EQ(op.state(), v1::OP_STATE_DONE);
  EXPECT_EQ(op.kind(), v1::OP_KIND_PREFETCH);
  EXPECT_THAT(Statuses(op), ElementsAre(1, 1, 1, 1, 1, 1));  // PAGE_STATUS_OK

  // The pin grew over the landed pages: eviction cannot take them before the Load.
  for (const auto& ns : h.cache().namespaces().Snapshot()) {
    std::vector<core::ReleasedObject> evicted;
    ns->index()->EvictBytes(~uint64_t{0} >> 1, &evicted);
    EXPECT_TRUE(evicted.empty());
  }
  v1::LoadRequest load;
  load.set_session_id(b.session);
  v1::LoadSequence* seq = load.add_sequences();
  seq->set_page_keys(KeyBlob(keys));
  for (uint32_t i = 0; i < 6; ++i) seq->add_device_blocks(8 + i);
  seq->set_pin_id(mr.results(0).pin_id());
  seq->set_release_pin(true);
  v1::LoadResponse lr;
  ASSERT_TRUE(h.Load(load, &lr).ok());
  v1::OpResult loaded = h.Wait(b.session, lr.op().op_id());
  ASSERT_EQ(loaded.state(), v1::OP_STATE_DONE);
  for (uint32_t i = 0; i < 6; ++i) {
    EXPECT_EQ(b.CheckBlock(8 + i, a.seed(), i), "") << "page " << i;
  }
}

TEST(L3CacheTest, PrefetchRpcReportsEveryPageOutcome) {
  CacheHarness h(WithFileTier(TempDir()));
  TestEngine a(16, false, 3);
  h.Register(a, "writer", 0, Spec());
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), Tokens(2, 5));
  StoreInL3Only(h, a, keys, 4);  // Page 4 is in no tier.

  // Pages 0-1 back into L2 first.
  v1::PrefetchResponse first;
  ASSERT_TRUE(h.Prefetch(PrefetchOf(a.session, keys, 0, 2, v1::PREFETCH_POLICY_WAIT_COMPLETE),
                         &first)
                  .ok());
  EXPECT_THAT(Statuses(h.Wait(a.session, first.op().op_id())), ElementsAre(1, 1));

  // 0-1 ALREADY_PRESENT, 2-3 fetched (OK), 4 MISS.
  v1::PrefetchResponse all;
  ASSERT_TRUE(
      h.Prefetch(PrefetchOf(a.session, keys, 0, 5, v1::PREFETCH_POLICY_BEST_EFFORT), &all).ok());
  // A best-effort read may land before the reply is built (a loaded machine deschedules the
  // handler): then the page's submission status is already OK.
  const auto pending_or_ok = AnyOf(v1::PAGE_STATUS_PENDING, v1::PAGE_STATUS_OK);
  EXPECT_THAT(Statuses(all.op()),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          pending_or_ok, pending_or_ok, v1::PAGE_STATUS_MISS));
  EXPECT_THAT(Statuses(h.Wait(a.session, all.op().op_id())),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK, v1::PAGE_STATUS_MISS));
  EXPECT_EQ(h.L2Hits(a.session, Tokens(2, 5)), 4u);
}

TEST(L3CacheTest, PrefetchUnderAForeignParentIsParentMissing) {
  CacheHarness h(WithFileTier(TempDir()));
  TestEngine a(16, false, 4);
  h.Register(a, "writer", 0, Spec());
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), Tokens(3, 3));
  StoreInL3Only(h, a, keys, 3);
  v1::PrefetchRequest req = PrefetchOf(a.session, keys, 2, 3, v1::PREFETCH_POLICY_WAIT_COMPLETE);
  req.mutable_sequences(0)->set_parent_key(std::string(32, 'x'));  // Not page 2's parent.
  v1::PrefetchResponse r;
  ASSERT_TRUE(h.Prefetch(req, &r).ok());
  EXPECT_THAT(Statuses(r.op()), ElementsAre(v1::PAGE_STATUS_PARENT_MISSING));
  EXPECT_EQ(h.PoolSlotsUsed(), 0u) << "a refused page keeps no slot";
}

TEST(L3CacheTest, PrefetchPastThePendingByteLimitIsThrottled) {
  CacheHarness h(WithFileTier(TempDir(), /*max_prefetch_bytes=*/0));
  TestEngine a(16, false, 5);
  h.Register(a, "writer", 0, Spec());
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), Tokens(4, 3));
  StoreInL3Only(h, a, keys, 3);
  v1::PrefetchResponse r;
  ASSERT_TRUE(
      h.Prefetch(PrefetchOf(a.session, keys, 0, 3, v1::PREFETCH_POLICY_BEST_EFFORT), &r).ok());
  EXPECT_THAT(Statuses(r.op()), ElementsAre(v1::PAGE_STATUS_THROTTLED, v1::PAGE_STATUS_SKIPPED,
                                            v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

TEST(L3CacheTest, PrefetchValidationNamesTheField) {
  CacheHarness h(WithFileTier(TempDir()));
  TestEngine a(16, false, 6);
  h.Register(a, "writer", 0, Spec());
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), Tokens(5, 2));
  v1::PrefetchResponse r;
  Rpc none = h.Prefetch(PrefetchOf(a.session, keys, 0, 2, v1::PREFETCH_POLICY_NONE), &r);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(none.field, "policy");
  v1::PrefetchRequest bad = PrefetchOf(a.session, keys, 0, 2, v1::PREFETCH_POLICY_BEST_EFFORT);
  bad.mutable_sequences(0)->set_page_keys("short");
  Rpc blob = h.Prefetch(bad, &r);
  EXPECT_EQ(blob.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(blob.field, "sequences[0].page_keys");
  bad = PrefetchOf(a.session, keys, 0, 2, v1::PREFETCH_POLICY_BEST_EFFORT);
  bad.mutable_sequences(0)->set_parent_key("xyz");
  Rpc parent = h.Prefetch(bad, &r);
  EXPECT_EQ(parent.field, "sequences[0].parent_key");
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

TEST(L3CacheTest, WithoutTiersPrefetchAnswersFromL2Alone) {
  CacheHarness h;
  TestEngine a(16, false, 9);
  h.Register(a, "writer", 0, Spec());
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), Tokens(6, 3));
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());
  v1::PrefetchResponse r;
  ASSERT_TRUE(
      h.Prefetch(PrefetchOf(a.session, keys, 0, 3, v1::PREFETCH_POLICY_UNSPECIFIED), &r).ok());
  EXPECT_THAT(Statuses(h.Wait(a.session, r.op().op_id())),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          v1::PAGE_STATUS_MISS));
}

// A TCP listener that never accepts: connections complete in its backlog and no command is ever
// answered, so a Redis tier pointed at it is an L3 that hangs until its own timeout.
class BlackHole {
 public:
  BlackHole() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 64), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~BlackHole() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Marks keys[0, n) as held by tier 0, as a Match lookup would have.
void MarkInTier0(CacheHarness& h, const std::vector<core::PageKey>& keys) {
  std::vector<core::L3Update> updates;
  for (size_t i = 0; i < keys.size(); ++i) {
    updates.push_back({keys[i], i > 0 ? std::optional(keys[i - 1]) : std::nullopt, 0, 0, true});
  }
  std::vector<absl::Status> statuses(updates.size());
  ASSERT_EQ(h.cache().namespaces().Snapshot()[0]->index()->UpdateL3(updates,
                                                                        absl::MakeSpan(statuses)),
            updates.size());
}

TEST(L3CacheTest, TimeoutPolicyEndsAtItsDeadlineAndReleaseCancelsAPrefetch) {
  BlackHole hole;
  HarnessOptions o;
  o.storage.tiers = absl::StrCat("redis:127.0.0.1:", hole.port(), "?name=slow&timeout_ms=1500");
  CacheHarness h(o);
  TestEngine a(16, false, 11);
  h.Register(a, "eng", 0, Spec());
  const std::vector<core::PageKey> first = CacheHarness::Keys(Spec(), Tokens(8, 3));
  const std::vector<core::PageKey> second = CacheHarness::Keys(Spec(), Tokens(9, 3));
  MarkInTier0(h, first);
  MarkInTier0(h, second);

  // timeout: DONE at the deadline, every page TIMEOUT, long before the tier's own 1.5 s.
  v1::PrefetchRequest req = PrefetchOf(a.session, first, 0, 3, v1::PREFETCH_POLICY_TIMEOUT);
  req.set_timeout_ms(100);
  const absl::Time t0 = absl::Now();
  v1::PrefetchResponse r;
  ASSERT_TRUE(h.Prefetch(req, &r).ok());
  v1::OpResult done = h.Wait(a.session, r.op().op_id());
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(1000));
  EXPECT_EQ(done.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(done), ElementsAre(v1::PAGE_STATUS_TIMEOUT, v1::PAGE_STATUS_TIMEOUT,
                                          v1::PAGE_STATUS_TIMEOUT));

  // Release(cancel_op_ids) ends a pending prefetch at once.
  ASSERT_TRUE(
      h.Prefetch(PrefetchOf(a.session, second, 0, 3, v1::PREFETCH_POLICY_BEST_EFFORT), &r).ok());
  EXPECT_THAT(Statuses(r.op()), ElementsAre(v1::PAGE_STATUS_PENDING, v1::PAGE_STATUS_PENDING,
                                            v1::PAGE_STATUS_PENDING));
  v1::ReleaseRequest cancel;
  cancel.set_session_id(a.session);
  cancel.add_cancel_op_ids(r.op().op_id());
  v1::ReleaseResponse cancelled;
  ASSERT_TRUE(h.Release(cancel, &cancelled).ok());
  EXPECT_THAT(cancelled.op_outcomes(), ElementsAre(v1::RELEASE_OUTCOME_CANCELLED));
  v1::OpResult c = h.Wait(a.session, r.op().op_id());
  EXPECT_EQ(c.state(), v1::OP_STATE_CANCELLED);
  EXPECT_THAT(Statuses(c), ElementsAre(v1::PAGE_STATUS_CANCELLED, v1::PAGE_STATUS_CANCELLED,
                                       v1::PAGE_STATUS_CANCELLED));
  // Cancelling again: already done. A Backup cannot be cancelled.
  ASSERT_TRUE(h.Release(cancel, &cancelled).ok());
  EXPECT_THAT(cancelled.op_outcomes(), ElementsAre(v1::RELEASE_OUTCOME_ALREADY_DONE));

  // A BEST_EFFORT prefetch started by Match is abandoned when the engine releases the pin.
  const std::vector<uint32_t> third_tokens = Tokens(10, 2);
  MarkInTier0(h, CacheHarness::Keys(Spec(), third_tokens));
  v1::MatchRequest m;
  m.set_session_id(a.session);
  m.add_sequences()->mutable_token_ids()->Add(third_tokens.begin(), third_tokens.end());
  m.set_prefetch_policy(v1::PREFETCH_POLICY_BEST_EFFORT);
  m.set_pin(true);
  v1::MatchResponse mr;
  ASSERT_TRUE(h.Match(m, &mr).ok());
  ASSERT_NE(mr.prefetch_op_id(), 0u);
  ASSERT_NE(mr.results(0).pin_id(), 0u);
  v1::ReleaseRequest drop;
  drop.set_session_id(a.session);
  drop.add_pin_ids(mr.results(0).pin_id());
  ASSERT_TRUE(h.Release(drop, &cancelled).ok());
  EXPECT_THAT(cancelled.pin_outcomes(), ElementsAre(v1::RELEASE_OUTCOME_RELEASED));
  v1::OpResult abandoned = h.Wait(a.session, mr.prefetch_op_id());
  EXPECT_EQ(abandoned.state(), v1::OP_STATE_CANCELLED);
  EXPECT_THAT(Statuses(abandoned), ElementsAre(v1::PAGE_STATUS_CANCELLED, v1::PAGE_STATUS_CANCELLED));

  // The reads end at the tier's timeout: their slots are freed, nothing was committed.
  EXPECT_GT(h.PoolSlotsUsed(), 0u);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (h.PoolSlotsUsed() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
  EXPECT_EQ(h.L2Hits(a.session, Tokens(8, 3)), 0u);
}

TEST(L3CacheTest, SelectiveWritesAfterTheConfiguredHits) {
  HarnessOptions o = WithFileTier(TempDir());
  o.storage.write_policy = L3WritePolicy::kWriteThroughSelective;
  o.storage.selective_hits = 2;
  CacheHarness h(o);
  TestEngine a(16, false, 10);
  h.Register(a, "writer", 0, Spec());
  const std::vector<uint32_t> tokens = Tokens(7, 3);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(), tokens);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 3, {0, 1, 2}).op().op_id());
  auto l3_objects = [&] {
    h.cache().l3_writer().Drain();
    uint64_t n = 0;
    for (const auto& ns : h.cache().namespaces().Snapshot()) n += ns->index()->Stats().l3_objects[0];
    return n;
  };
  EXPECT_EQ(l3_objects(), 0u);
  EXPECT_EQ(h.L2Hits(a.session, tokens), 3u);
  EXPECT_EQ(l3_objects(), 0u);
  EXPECT_EQ(h.L2Hits(a.session, tokens), 3u);
  EXPECT_EQ(l3_objects(), 3u);
}

}  // namespace
}  // namespace kvcellar::server::testing
