// Tests server/rpc/cache_service.h end to end: a real CacheServiceImpl behind a gRPC server on a temp
// Unix socket, the sim device, and engines whose KV memory is shared memory in this process
// (cache_test_harness.h). Bytes are checked byte for byte against the pattern each engine wrote.
#include "server/rpc/cache_service.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "server/rpc/api_revision.h"
#include "tests/server/cache_test_harness.h"
#include "tests/server/fake_cuda_device.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::LoadRequest LoadOf(uint64_t session, const std::vector<core::PageKey>& keys, size_t begin,
                       size_t end, const std::vector<uint32_t>& blocks) {
  v1::LoadRequest req;
  req.set_session_id(session);
  v1::LoadSequence* seq = req.add_sequences();
  seq->set_page_keys(KeyBlob(keys, begin, end));
  for (uint32_t b : blocks) seq->add_device_blocks(b);
  return req;
}

TEST(CacheServiceTest, RegisterReturnsSessionGeometryAndLimits) {
  CacheHarness h;
  TestEngine e(16, /*mla=*/false, 1);
  v1::RegisterEngineResponse r = h.Register(e, "inst-a", 1, Spec(/*tp=*/2));
  EXPECT_NE(r.session_id(), 0u);
  EXPECT_EQ(r.lease_ms(), 10000u);
  EXPECT_EQ(r.heartbeat_interval_ms(), 3333u);
  EXPECT_EQ(r.shard_index(), 1u);
  EXPECT_EQ(r.num_shards(), 2u);
  EXPECT_TRUE(r.is_shard_writer());
  EXPECT_EQ(r.page_object_bytes(), kObjectBytes);
  EXPECT_EQ(r.daemon_epoch(), 42u);
  EXPECT_EQ(r.api_revision(), kApiRevision);
  EXPECT_EQ(r.limits().max_batch_pages(), 64u);
  EXPECT_GT(r.limits().max_wait_ms(), 0u);
  EXPECT_EQ(r.default_write_policy(), v1::WRITE_POLICY_L2_ONLY);
  EXPECT_EQ(r.default_prefetch_policy(), v1::PREFETCH_POLICY_NONE);
  // The daemon's digest is the client's (core::NamespaceSpec::Digest, docs/keys.md).
  std::vector<core::PageKey> keys = CacheHarness::Keys(Spec(2), Tokens(1, 1));
  core::PageKey digest;
  std::memcpy(digest.bytes.data(), r.ns_digest().data(), 32);
  EXPECT_EQ(keys[0], core::ChainPageKey(digest, Tokens(1, 1)));

  EXPECT_EQ(h.cache().GetCounts().sessions, 1u);
  EXPECT_EQ(h.cache().GetCounts().instances, 1u);
  EXPECT_EQ(h.cache().GetCounts().namespaces, 1u);
}

TEST(CacheServiceTest, BackupFromOneInstanceLoadsByteForByteIntoAnother) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, /*seed=*/1);
  TestEngine b(16, false, /*seed=*/2);
  h.Register(a, "inst-a", 0, spec);
  h.Register(b, "inst-b", 0, spec);
  const std::vector<uint32_t> tokens = Tokens(7, 3);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, tokens);

  v1::BackupResponse backup = h.Backup(a.session, keys, 0, 3, {3, 4, 5});
  ASSERT_EQ(backup.op().sequences_size(), 1);
  v1::OpResult done = h.Wait(a.session, backup.op().op_id());
  EXPECT_EQ(done.state(), v1::OP_STATE_DONE);
  EXPECT_EQ(done.kind(), v1::OP_KIND_BACKUP);
  EXPECT_THAT(Statuses(done.sequences(0)),
              ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  EXPECT_EQ(done.sequences(0).leading_ok_pages(), 3u);

  // Another instance finds the pages by token ids (the daemon computes the same keys) ...
  v1::MatchRequest match;
  match.set_session_id(b.session);
  match.set_return_keys(true);
  match.add_sequences()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  v1::MatchResponse m;
  ASSERT_TRUE(h.Match(match, &m).ok());
  ASSERT_EQ(m.results_size(), 1);
  EXPECT_EQ(m.results(0).l2_hit_pages(), 3u);
  EXPECT_EQ(m.results(0).l3_hit_pages(), 0u);
  EXPECT_EQ(m.results(0).total_pages(), 3u);
  EXPECT_EQ(m.results(0).page_keys(), KeyBlob(keys));
  EXPECT_EQ(m.prefetch_op_id(), 0u);

  // ... and loads them into other blocks, with per-layer signals.
  v1::LoadRequest load = LoadOf(b.session, keys, 0, 3, {10, 11, 12});
  load.set_signal_layers(true);
  load.set_completion_slot(1);
  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(load, &l).ok());
  EXPECT_EQ(l.op().sequences(0).leading_ok_pages(), 3u);
  v1::OpResult loaded = h.Wait(b.session, l.op().op_id());
  EXPECT_EQ(loaded.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(loaded.sequences(0)),
              ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(b.CheckBlock(10 + i, a.seed(), 3 + i), "") << "page " << i;
  }
  EXPECT_EQ(b.CheckBlock(13, b.seed(), 13), "");  // Untouched neighbour.
  // The SIM counters: every layer word and the op word (op id << 1, not failed).
  const uint64_t op = l.op().op_id();
  for (uint32_t layer = 0; layer < kLayers; ++layer) EXPECT_EQ(b.LayerWord(1, layer), op);
  EXPECT_EQ(b.OpWord(1), op << 1);

  const std::string metrics = h.registry().Scrape();
  EXPECT_THAT(metrics, HasSubstr("kvcellar_match_pages_total{tier=\"l2\",result=\"hit\"} 3"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("kvcellar_moved_bytes_total{direction=\"h2d\"} ",
                                              3 * kObjectBytes)));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("kvcellar_moved_bytes_total{direction=\"d2h\"} ",
                                              3 * kObjectBytes)));
  EXPECT_THAT(metrics, HasSubstr("kvcellar_ops_total{kind=\"load\",outcome=\"done\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvcellar_sessions{role=\"worker\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("kvcellar_l2_pages 3"));
}

TEST(CacheServiceTest, BackupDedupsAndSkipsAfterParentMissing) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(3, 4));
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());

  // Pages 0-1 present, 2-3 new: dedup, then copy (the reply may already show the copy done).
  v1::BackupResponse again = h.Backup(a.session, keys, 0, 4, {4, 5, 6, 7});
  const auto copied = AnyOf(v1::PAGE_STATUS_PENDING, v1::PAGE_STATUS_OK);
  EXPECT_THAT(Statuses(again.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT, copied,
                          copied));
  v1::OpResult done = h.Wait(a.session, again.op().op_id());
  EXPECT_THAT(Statuses(done.sequences(0)),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  EXPECT_EQ(done.sequences(0).leading_ok_pages(), 4u);

  // A chain whose parent is not indexed would leave a hole: refused, the rest skipped.
  const std::vector<core::PageKey> other = CacheHarness::Keys(spec, Tokens(4, 3));
  v1::BackupResponse orphan = h.Backup(a.session, other, 1, 3, {8, 9});
  EXPECT_EQ(orphan.op().state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(orphan.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_PARENT_MISSING, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(h.IndexStats().l2_objects, 4u);
  EXPECT_EQ(h.PoolSlotsUsed(), 4u);
}

TEST(CacheServiceTest, TensorParallelMhaNeedsEveryShardBeforeMatchCounts) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec(/*tp=*/2);
  TestEngine r0(16, false, 10);
  TestEngine r1(16, false, 11);
  h.Register(r0, "inst-a", 0, spec);
  h.Register(r1, "inst-a", 1, spec);
  const uint64_t scheduler = h.RegisterScheduler("inst-b", spec);
  const std::vector<uint32_t> tokens = Tokens(1, 2);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, tokens);

  h.Wait(r0.session, h.Backup(r0.session, keys, 0, 2, {0, 1}).op().op_id());
  EXPECT_EQ(h.L2Hits(scheduler, tokens), 0u) << "one shard of two is not a hit";
  h.Wait(r1.session, h.Backup(r1.session, keys, 0, 2, {2, 3}).op().op_id());
  EXPECT_EQ(h.L2Hits(scheduler, tokens), 2u);

  // Another TP=2 instance: each rank loads its own shard.
  TestEngine s0(16, false, 20);
  TestEngine s1(16, false, 21);
  h.Register(s0, "inst-b", 0, spec);
  h.Register(s1, "inst-b", 1, spec);
  v1::LoadResponse l0, l1;
  ASSERT_TRUE(h.Load(LoadOf(s0.session, keys, 0, 2, {8, 9}), &l0).ok());
  ASSERT_TRUE(h.Load(LoadOf(s1.session, keys, 0, 2, {8, 9}), &l1).ok());
  EXPECT_EQ(h.Wait(s0.session, l0.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(h.Wait(s1.session, l1.op().op_id()).state(), v1::OP_STATE_DONE);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(s0.CheckBlock(8 + i, r0.seed(), i), "");
    EXPECT_EQ(s1.CheckBlock(8 + i, r1.seed(), 2 + i), "");
  }
  EXPECT_EQ(h.IndexStats().l2_objects, 4u);
}

TEST(CacheServiceTest, MlaRanksShareOneObject) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec(/*tp=*/2, /*mla=*/true);
  TestEngine r0(16, true, 30);
  TestEngine r1(16, true, 31);
  v1::RegisterEngineResponse g0 = h.Register(r0, "inst-a", 0, spec);
  v1::RegisterEngineResponse g1 = h.Register(r1, "inst-a", 1, spec);
  EXPECT_EQ(g0.shard_index(), 0u);
  EXPECT_EQ(g1.shard_index(), 0u);
  EXPECT_EQ(g0.num_shards(), 1u);
  EXPECT_TRUE(g0.is_shard_writer());
  EXPECT_FALSE(g1.is_shard_writer());
  const std::vector<uint32_t> tokens = Tokens(2, 2);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, tokens);

  h.Wait(r0.session, h.Backup(r0.session, keys, 0, 2, {0, 1}).op().op_id());
  EXPECT_EQ(h.L2Hits(r1.session, tokens), 2u);
  v1::BackupResponse dup = h.Backup(r1.session, keys, 0, 2, {2, 3});
  EXPECT_THAT(Statuses(dup.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT));
  EXPECT_EQ(dup.op().state(), v1::OP_STATE_DONE);

  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(LoadOf(r1.session, keys, 0, 2, {5, 6}), &l).ok());
  EXPECT_EQ(h.Wait(r1.session, l.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(r1.CheckBlock(5, r0.seed(), 0), "");
  EXPECT_EQ(r1.CheckBlock(6, r0.seed(), 1), "");
  EXPECT_EQ(h.IndexStats().l2_objects, 2u) << "one object per page, shared by the ranks";
}

TEST(CacheServiceTest, LoadRacingAnUnfinishedBackupMissesAndNeverSeesPartialBytes) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  TestEngine b(16, false, 2);
  h.Register(a, "inst-a", 0, spec);
  h.Register(b, "inst-b", 0, spec);
  const std::vector<uint32_t> tokens = Tokens(5, 2);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, tokens);

  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, keys, {0, 1}, 1, 7);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());
  EXPECT_EQ(pending.op().state(), v1::OP_STATE_PENDING);
  EXPECT_THAT(Statuses(pending.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_PENDING, v1::PAGE_STATUS_PENDING));
  absl::SleepFor(absl::Milliseconds(30));  // The gather must wait for the ready word.
  EXPECT_EQ(h.IndexStats().l2_inflight_objects, 2u);

  EXPECT_EQ(h.L2Hits(b.session, tokens), 0u) << "in-flight pages are invisible";
  const std::string before = b.Snapshot();
  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(LoadOf(b.session, keys, 0, 2, {4, 5}), &l).ok());
  EXPECT_THAT(Statuses(l.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_IN_FLIGHT, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(l.op().sequences(0).leading_ok_pages(), 0u);
  EXPECT_EQ(h.Wait(b.session, l.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(b.Snapshot(), before) << "a miss copies nothing";

  // The engine publishes the token: the gather runs and the pages become visible.
  a.PublishReady(1, 7);
  v1::OpResult done = h.Wait(a.session, pending.op().op_id());
  EXPECT_EQ(done.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(done.sequences(0)), ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  EXPECT_EQ(h.L2Hits(b.session, tokens), 2u);
  ASSERT_TRUE(h.Load(LoadOf(b.session, keys, 0, 2, {4, 5}), &l).ok());
  EXPECT_EQ(h.Wait(b.session, l.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(b.CheckBlock(4, a.seed(), 0), "");
  EXPECT_EQ(b.CheckBlock(5, a.seed(), 1), "");
}

TEST(CacheServiceTest, ReadySignalTimeoutAbortsAndFreesSlots) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(6, 2));
  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, keys, {0, 1}, 0, 3);
  req.set_ready_timeout_ms(50);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());
  v1::OpResult done = h.Wait(a.session, pending.op().op_id());
  EXPECT_EQ(done.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(done.sequences(0)),
              ElementsAre(v1::PAGE_STATUS_TIMEOUT, v1::PAGE_STATUS_TIMEOUT));
  EXPECT_EQ(h.IndexStats().l2_inflight_objects, 0u);
  EXPECT_EQ(h.IndexStats().l2_objects, 0u);
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
  // A late token changes nothing: the gather was never submitted.
  a.PublishReady(0, 3);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

TEST(CacheServiceTest, BlocksOfAnUnfinishedOpAreBusy) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(8, 2));
  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, keys, {2, 3}, 0, 1);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());

  v1::LoadResponse l;
  Rpc r = h.Load(LoadOf(a.session, keys, 0, 1, {3}), &l);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "ERROR_REASON_BLOCK_BUSY");
  EXPECT_EQ(r.field, "sequences[0].device_blocks[0]");

  a.PublishReady(0, 1);
  EXPECT_EQ(h.Wait(a.session, pending.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_TRUE(h.Load(LoadOf(a.session, keys, 0, 1, {3}), &l).ok()) << "free once the op is done";
  h.Wait(a.session, l.op().op_id());
}

TEST(CacheServiceTest, MatchPinsSurviveEvictionAndReleaseDropsThem) {
  HarnessOptions o;
  o.pool_bytes = kRegionBytes;  // 64 slots of 16 KiB.
  o.high_watermark = 1.0;       // Only a full pool evicts here.
  o.low_watermark = 0.99;
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(128, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const uint64_t scheduler = h.RegisterScheduler("inst-s", spec);

  // 8 prompts of 8 pages fill the pool.
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t p = 0; p < 8; ++p) {
    prompts.push_back(Tokens(100 + p, 8));
    const auto keys = CacheHarness::Keys(spec, prompts.back());
    v1::OpResult done =
        h.Wait(a.session, h.Backup(a.session, keys, 0, 8, Blocks(0, 8)).op().op_id());
    ASSERT_EQ(done.sequences(0).leading_ok_pages(), 8u);
  }
  EXPECT_EQ(h.PoolSlotsUsed(), kSlotsPerRegion);

  // Pin the oldest prompt, then push 4 more prompts through the full pool.
  const v1::MatchResponse m = h.MatchTokens(scheduler, prompts[0], /*pin=*/true);
  ASSERT_EQ(m.results(0).l2_hit_pages(), 8u);
  const uint64_t pin = m.results(0).pin_id();
  ASSERT_NE(pin, 0u);
  EXPECT_EQ(h.IndexStats().pinned_pages, 8u);
  for (uint32_t p = 8; p < 12; ++p) {
    const auto keys = CacheHarness::Keys(spec, Tokens(100 + p, 8));
    v1::OpResult done =
        h.Wait(a.session, h.Backup(a.session, keys, 0, 8, Blocks(0, 8)).op().op_id());
    EXPECT_EQ(done.sequences(0).leading_ok_pages(), 8u) << "eviction made room";
  }
  EXPECT_GT(h.IndexStats().evicted_pages, 0u);
  EXPECT_EQ(h.L2Hits(scheduler, prompts[0]), 8u) << "pinned pages are never evicted";
  EXPECT_EQ(h.PoolSlotsUsed(), h.IndexStats().l2_objects) << "every evicted slot was freed";
  EXPECT_THAT(h.registry().Scrape(),
              HasSubstr("kvcellar_evicted_pages_total{reason=\"pool_full\"}"));

  v1::ReleaseRequest release;
  release.set_session_id(scheduler);
  release.add_pin_ids(pin);
  release.add_pin_ids(pin);
  v1::ReleaseResponse rr;
  ASSERT_TRUE(h.Release(release, &rr).ok());
  EXPECT_THAT(std::vector<int>(rr.pin_outcomes().begin(), rr.pin_outcomes().end()),
              ElementsAre(v1::RELEASE_OUTCOME_RELEASED, v1::RELEASE_OUTCOME_UNKNOWN));
  EXPECT_EQ(h.IndexStats().pinned_pages, 0u);

  h.ClearIndexes();
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

TEST(CacheServiceTest, FullPoolOfPinnedPagesIsNoSpace) {
  HarnessOptions o;
  o.pool_bytes = kRegionBytes;
  o.high_watermark = 1.0;
  o.low_watermark = 0.99;
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(128, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const uint64_t scheduler = h.RegisterScheduler("inst-s", spec);
  const std::vector<uint32_t> big = Tokens(1, 64);
  const auto keys = CacheHarness::Keys(spec, big);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 64, Blocks(0, 64)).op().op_id());
  const v1::MatchResponse m = h.MatchTokens(scheduler, big, /*pin=*/true);
  ASSERT_EQ(m.results(0).l2_hit_pages(), 64u);

  const auto other = CacheHarness::Keys(spec, Tokens(2, 2));
  v1::BackupResponse b = h.Backup(a.session, other, 0, 2, {70, 71});
  EXPECT_THAT(Statuses(b.op().sequences(0)),
              ElementsAre(v1::PAGE_STATUS_NO_SPACE, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(h.L2Hits(scheduler, big), 64u);
}

TEST(CacheServiceTest, SessionLeaseExpiryDropsPinsAndClosesTheSession) {
  HarnessOptions o;
  o.lease_ms = 300;
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<uint32_t> tokens = Tokens(9, 2);
  const auto keys = CacheHarness::Keys(spec, tokens);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());
  const v1::MatchResponse m = h.MatchTokens(a.session, tokens, /*pin=*/true);
  EXPECT_EQ(h.IndexStats().pinned_pages, 2u);

  // No heartbeat: the session lapses, its pins go, the pages stay (for the next engine).
  absl::SleepFor(absl::Milliseconds(600));
  v1::HeartbeatRequest hb;
  hb.set_session_id(a.session);
  v1::HeartbeatResponse hr;
  ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
  EXPECT_EQ(hr.state(), v1::SESSION_STATE_UNKNOWN);
  EXPECT_EQ(hr.daemon_epoch(), 42u);
  EXPECT_EQ(h.IndexStats().pinned_pages, 0u);
  EXPECT_EQ(h.IndexStats().l2_objects, 2u);
  EXPECT_EQ(h.cache().GetCounts().sessions, 0u);
  EXPECT_THAT(h.registry().Scrape(), HasSubstr("kvcellar_session_lease_expiries_total 1"));

  v1::LoadResponse l;
  Rpc r = h.Load(LoadOf(a.session, keys, 0, 2, {4, 5}), &l);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "ERROR_REASON_SESSION_UNKNOWN");
  h.ClearIndexes();
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
}

TEST(CacheServiceTest, HeartbeatKeepsTheSessionWhilePinLeasesExpire) {
  HarnessOptions o;
  o.lease_ms = 1000;
  o.pin_lease_ms = 100;
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<uint32_t> tokens = Tokens(9, 2);
  const auto keys = CacheHarness::Keys(spec, tokens);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());
  const v1::MatchResponse m = h.MatchTokens(a.session, tokens, /*pin=*/true);
  const uint64_t pin = m.results(0).pin_id();
  EXPECT_EQ(h.IndexStats().pinned_pages, 2u);

  v1::HeartbeatRequest hb;
  hb.set_session_id(a.session);
  v1::HeartbeatResponse hr;
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
    EXPECT_EQ(hr.state(), v1::SESSION_STATE_ACTIVE);
    EXPECT_EQ(hr.lease_remaining_ms(), 1000u);
  }
  // The pin lapsed after 100 ms although the session lives.
  EXPECT_EQ(h.IndexStats().pinned_pages, 0u);
  hb.add_renew_pin_ids(pin);
  ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
  EXPECT_EQ(hr.state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_THAT(std::vector<uint64_t>(hr.unknown_pin_ids().begin(), hr.unknown_pin_ids().end()),
              ElementsAre(pin));
  EXPECT_THAT(h.registry().Scrape(), HasSubstr("kvcellar_pin_lease_expiries_total 1"));
}

TEST(CacheServiceTest, HeartbeatRenewsPins) {
  HarnessOptions o;
  o.pin_lease_ms = 150;
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const std::vector<uint32_t> tokens = Tokens(9, 2);
  const auto keys = CacheHarness::Keys(spec, tokens);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());
  const v1::MatchResponse m = h.MatchTokens(a.session, tokens, /*pin=*/true);
  v1::HeartbeatRequest hb;
  hb.set_session_id(a.session);
  hb.add_renew_pin_ids(m.results(0).pin_id());
  v1::HeartbeatResponse hr;
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(40));
    ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
    EXPECT_EQ(hr.unknown_pin_ids_size(), 0);
  }
  EXPECT_EQ(h.IndexStats().pinned_pages, 2u) << "renewed past its first lease";
}

TEST(CacheServiceTest, LoadReleasePinDropsThisRanksHold) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec(/*tp=*/2);
  TestEngine r0(16, false, 1);
  TestEngine r1(16, false, 2);
  h.Register(r0, "inst-a", 0, spec);
  h.Register(r1, "inst-a", 1, spec);
  const std::vector<uint32_t> tokens = Tokens(3, 2);
  const auto keys = CacheHarness::Keys(spec, tokens);
  h.Wait(r0.session, h.Backup(r0.session, keys, 0, 2, {0, 1}).op().op_id());
  h.Wait(r1.session, h.Backup(r1.session, keys, 0, 2, {0, 1}).op().op_id());
  const uint64_t scheduler = h.RegisterScheduler("inst-a", spec);
  const v1::MatchResponse m = h.MatchTokens(scheduler, tokens, /*pin=*/true);
  const uint64_t pin = m.results(0).pin_id();
  ASSERT_NE(pin, 0u);

  for (TestEngine* e : {&r0, &r1}) {
    v1::LoadRequest load = LoadOf(e->session, keys, 0, 2, {8, 9});
    load.mutable_sequences(0)->set_pin_id(pin);
    load.mutable_sequences(0)->set_release_pin(true);
    v1::LoadResponse l;
    ASSERT_TRUE(h.Load(load, &l).ok());
    EXPECT_EQ(h.Wait(e->session, l.op().op_id()).state(), v1::OP_STATE_DONE);
    // Rank 0's release leaves rank 1's hold; rank 1's ends the pin.
    EXPECT_EQ(h.IndexStats().pinned_pages, e == &r0 ? 2u : 0u);
  }
  EXPECT_EQ(r0.CheckBlock(8, r0.seed(), 0), "");
  EXPECT_EQ(r1.CheckBlock(9, r1.seed(), 1), "");
}

TEST(CacheServiceTest, StepIdGivesEveryRankTheSameAnswer) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec(/*tp=*/2);
  TestEngine r0(16, false, 1);
  TestEngine r1(16, false, 2);
  h.Register(r0, "inst-a", 0, spec);
  h.Register(r1, "inst-a", 1, spec);
  const std::vector<uint32_t> tokens = Tokens(3, 2);
  const auto keys = CacheHarness::Keys(spec, tokens);
  h.Wait(r0.session, h.Backup(r0.session, keys, 0, 2, {0, 1}).op().op_id());
  h.Wait(r1.session, h.Backup(r1.session, keys, 0, 2, {0, 1}).op().op_id());

  v1::MatchRequest match;
  match.set_step_id(17);
  match.set_pin(true);
  match.add_sequences()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  match.set_session_id(r0.session);
  v1::MatchResponse m0, m1;
  ASSERT_TRUE(h.Match(match, &m0).ok());
  match.set_session_id(r1.session);
  ASSERT_TRUE(h.Match(match, &m1).ok());
  EXPECT_FALSE(m0.memoized());
  EXPECT_TRUE(m1.memoized());
  EXPECT_EQ(m0.results(0).pin_id(), m1.results(0).pin_id());
  EXPECT_EQ(m1.results(0).l2_hit_pages(), 2u);
  EXPECT_EQ(h.IndexStats().pinned_pages, 2u);

  match.set_pin(false);
  v1::MatchResponse bad;
  Rpc r = h.Match(match, &bad);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "ERROR_REASON_STEP_MISMATCH");
  EXPECT_EQ(r.field, "step_id");
}

TEST(CacheServiceTest, WaitOpsReportsUnknownAndReleaseReportsOps) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  TestEngine b(16, false, 2);
  h.Register(a, "inst-a", 0, spec);
  h.Register(b, "inst-b", 0, spec);
  const auto keys = CacheHarness::Keys(spec, Tokens(1, 1));
  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, keys, {0}, 0, 9);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());
  const uint64_t op = pending.op().op_id();

  // Poll: still pending. Another instance does not see the op. ANY returns on the unknown id.
  v1::WaitOpsRequest w;
  w.set_session_id(a.session);
  w.add_op_ids(op);
  w.add_op_ids(12345);
  w.set_mode(v1::WAIT_MODE_ALL);
  w.set_timeout_ms(30);
  v1::WaitOpsResponse wr;
  ASSERT_TRUE(h.WaitOps(w, &wr).ok());
  EXPECT_TRUE(wr.timed_out());
  EXPECT_EQ(wr.ops(0).state(), v1::OP_STATE_PENDING);
  EXPECT_EQ(wr.ops(1).state(), v1::OP_STATE_UNKNOWN);
  w.set_mode(v1::WAIT_MODE_ANY);
  w.set_timeout_ms(5000);
  ASSERT_TRUE(h.WaitOps(w, &wr).ok());
  EXPECT_FALSE(wr.timed_out());
  w.set_session_id(b.session);
  w.clear_op_ids();
  w.add_op_ids(op);
  ASSERT_TRUE(h.WaitOps(w, &wr).ok());
  EXPECT_EQ(wr.ops(0).state(), v1::OP_STATE_UNKNOWN);

  v1::ReleaseRequest rel;
  rel.set_session_id(a.session);
  rel.add_cancel_op_ids(op);
  rel.add_cancel_op_ids(777);
  v1::ReleaseResponse rr;
  ASSERT_TRUE(h.Release(rel, &rr).ok());
  EXPECT_THAT(std::vector<int>(rr.op_outcomes().begin(), rr.op_outcomes().end()),
              ElementsAre(v1::RELEASE_OUTCOME_NOT_CANCELLABLE, v1::RELEASE_OUTCOME_UNKNOWN));

  // A waiter blocked in WaitOps is woken by the completion, not by its timeout.
  std::thread publisher([&] {
    absl::SleepFor(absl::Milliseconds(50));
    a.PublishReady(0, 9);
  });
  const absl::Time start = absl::Now();
  v1::OpResult done = h.Wait(a.session, op);
  publisher.join();
  EXPECT_EQ(done.state(), v1::OP_STATE_DONE);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE(h.Release(rel, &rr).ok());
  EXPECT_EQ(rr.op_outcomes(0), v1::RELEASE_OUTCOME_ALREADY_DONE);
}

TEST(CacheServiceTest, UnregisterEndsTheSessionAfterItsOps) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const auto keys = CacheHarness::Keys(spec, Tokens(1, 2));
  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, keys, {0, 1}, 0, 1);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());

  v1::UnregisterEngineRequest u;
  u.set_session_id(a.session);
  u.set_drain_timeout_ms(20);
  v1::UnregisterEngineResponse ur;
  ASSERT_TRUE(h.UnregisterEngine(u, &ur).ok());
  EXPECT_EQ(ur.ops_cancelled(), 1u);
  EXPECT_EQ(ur.ops_completed(), 0u);
  EXPECT_EQ(h.IndexStats().l2_inflight_objects, 0u);
  EXPECT_EQ(h.PoolSlotsUsed(), 0u);
  // The engine's memory is no longer touched: a late token copies nothing anywhere.
  a.PublishReady(0, 1);
  Rpc again = h.UnregisterEngine(u, &ur);
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(again.reason, "ERROR_REASON_SESSION_UNKNOWN");
  EXPECT_EQ(h.cache().GetCounts().sessions, 0u);
}

// Issue #24: several engines draining at once used to hold every gRPC callback thread (two on a
// two-core machine) for their whole drain, and a bystander's Heartbeat waited for them.
TEST(CacheServiceTest, UnregisterDrainsHoldNoServerThread) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  constexpr int kDrainers = 4;
  constexpr uint32_t kDrainMs = 1500;
  std::vector<std::unique_ptr<TestEngine>> engines;
  for (int i = 0; i < kDrainers; ++i) {
    engines.push_back(std::make_unique<TestEngine>(16, false, 1));
    h.Register(*engines[i], absl::StrCat("drainer-", i), 0, spec);
    const auto keys = CacheHarness::Keys(spec, Tokens(20 + i, 2));
    v1::BackupResponse pending;
    ASSERT_TRUE(
        h.Backup(CacheHarness::GatedBackup(engines[i]->session, keys, {0, 1}, 0, 1), &pending)
            .ok());
    ASSERT_EQ(pending.op().state(), v1::OP_STATE_PENDING);
  }
  const uint64_t bystander = h.RegisterScheduler("bystander", spec);

  std::vector<v1::UnregisterEngineResponse> replies(kDrainers);
  std::vector<absl::Duration> took(kDrainers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kDrainers; ++i) {
    threads.emplace_back([&, i] {
      v1::UnregisterEngineRequest u;
      u.set_session_id(engines[i]->session);
      u.set_drain_timeout_ms(kDrainMs);
      const absl::Time start = absl::Now();
      EXPECT_TRUE(h.UnregisterEngine(u, &replies[i]).ok());
      took[i] = absl::Now() - start;
    });
  }
  absl::SleepFor(absl::Milliseconds(200));  // The drains are under way.
  // Engine 0's op ends within its drain: its reply comes then, counting it completed.
  engines[0]->PublishReady(0, 1);
  absl::Duration worst;
  for (int k = 0; k < 5; ++k) {
    v1::HeartbeatRequest hb;
    hb.set_session_id(bystander);
    v1::HeartbeatResponse hr;
    const absl::Time start = absl::Now();
    ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
    worst = std::max(worst, absl::Now() - start);
    EXPECT_EQ(hr.state(), v1::SESSION_STATE_ACTIVE);
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LT(worst, absl::Milliseconds(250)) << "a bystander waited for others' drains";

  EXPECT_EQ(replies[0].ops_completed(), 1u);
  EXPECT_EQ(replies[0].ops_cancelled(), 0u);
  EXPECT_LT(took[0], absl::Milliseconds(kDrainMs - 500));
  for (int i = 1; i < kDrainers; ++i) {
    EXPECT_EQ(replies[i].ops_completed(), 0u) << i;
    EXPECT_EQ(replies[i].ops_cancelled(), 1u) << i;
    EXPECT_GE(took[i], absl::Milliseconds(kDrainMs - 50)) << i << ": the drain is honoured";
  }
  EXPECT_EQ(h.cache().GetCounts().sessions, 1u);
  EXPECT_EQ(h.IndexStats().l2_inflight_objects, 0u);
}

TEST(CacheServiceTest, ReplaceExistingEndsTheOldSession) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const uint64_t old = a.session;
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(a.Register("inst-a", 0, spec), &resp);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(r.reason, "ERROR_REASON_SESSION_EXISTS");
  v1::RegisterEngineRequest again = a.Register("inst-a", 0, spec);
  again.set_replace_existing(true);
  ASSERT_TRUE(h.RegisterEngine(again, &resp).ok());
  EXPECT_NE(resp.session_id(), old);
  v1::HeartbeatRequest hb;
  hb.set_session_id(old);
  v1::HeartbeatResponse hr;
  ASSERT_TRUE(h.Heartbeat(hb, &hr).ok());
  EXPECT_EQ(hr.state(), v1::SESSION_STATE_UNKNOWN);
  EXPECT_EQ(h.cache().GetCounts().sessions, 1u);
}

TEST(CacheServiceTest, AnExpiredSeatHolderIsReplacedBeforeItIsReaped) {
  HarnessOptions o;
  o.lease_ms = 100;
  o.housekeeping_interval = absl::Hours(1);  // Nothing reaps it.
  CacheHarness h(o);
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, Spec());
  const uint64_t old = a.session;
  absl::SleepFor(absl::Milliseconds(150));
  v1::RegisterEngineResponse resp;
  ASSERT_TRUE(h.RegisterEngine(a.Register("inst-a", 0, Spec()), &resp).ok());
  EXPECT_NE(resp.session_id(), old);
  EXPECT_EQ(h.cache().GetCounts().sessions, 1u);
}

TEST(CacheServiceTest, WatermarkEvictionBringsThePoolDown) {
  HarnessOptions o;
  o.pool_bytes = kRegionBytes;
  o.high_watermark = 0.5;
  o.low_watermark = 0.25;
  o.housekeeping_interval = absl::Hours(1);  // Run by hand.
  CacheHarness h(o);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(64, false, 1);
  h.Register(a, "inst-a", 0, spec);
  for (uint32_t p = 0; p < 5; ++p) {
    const auto keys = CacheHarness::Keys(spec, Tokens(200 + p, 8));
    h.Wait(a.session, h.Backup(a.session, keys, 0, 8, Blocks(0, 8)).op().op_id());
  }
  EXPECT_EQ(h.PoolSlotsUsed(), 40u);  // 62.5% of 64 slots.
  h.cache().Housekeep();
  EXPECT_LE(h.PoolSlotsUsed(), 16u);  // 25%.
  EXPECT_EQ(h.PoolSlotsUsed(), h.IndexStats().l2_objects);
  EXPECT_THAT(h.registry().Scrape(),
              HasSubstr("kvcellar_evicted_pages_total{reason=\"watermark\"}"));
}

TEST(CacheServiceTest, OpaqueNamespaceScopesEngineKeys) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec(1, false, /*opaque=*/true);
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, spec);
  std::vector<core::PageKey> keys(2);
  keys[0].bytes.fill(1);
  keys[1].bytes.fill(2);
  h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {0, 1}).op().op_id());
  v1::MatchRequest match;
  match.set_session_id(a.session);
  match.add_sequences()->set_page_keys(KeyBlob(keys));
  v1::MatchResponse m;
  ASSERT_TRUE(h.Match(match, &m).ok());
  EXPECT_EQ(m.results(0).l2_hit_pages(), 2u);
  // The same engine keys in another (chained) namespace are different pages.
  TestEngine b(16, false, 2);
  h.Register(b, "inst-b", 0, Spec());
  match.set_session_id(b.session);
  ASSERT_TRUE(h.Match(match, &m).ok());
  EXPECT_EQ(m.results(0).l2_hit_pages(), 0u);
}

// A host-memory engine whose KV lives in a memfd (SGLang's HiCache host pool) registers it by
// /proc path; Backup reads from it and Load writes into it.
TEST(CacheServiceTest, MemfdRegionByProcPathRoundTripsBytes) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  // The engine's KV: a memfd holding the bytes a TestEngine seeded 1 has in its shm object.
  TestEngine a(16, false, /*seed=*/1);
  const uint64_t bytes = a.kv().memory().size();
  const int fd = memfd_create("kvc-hicache-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0) << strerror(errno);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  uint8_t* memfd = static_cast<uint8_t*>(p);
  std::memcpy(memfd, a.kv().memory().data(), bytes);
  const std::string shm_before = a.Snapshot();

  v1::RegisterEngineRequest req = a.Register("inst-memfd", 0, spec);
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  for (v1::MemoryRegion& r : *req.mutable_layout()->mutable_regions()) r.set_sim_shm_name(path);
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(req, &resp);
  ASSERT_TRUE(r.ok()) << r.status.error_message();
  const uint64_t session = resp.session_id();

  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(3, 3));
  v1::OpResult backup = h.Wait(session, h.Backup(session, keys, 0, 3, {3, 4, 5}).op().op_id());
  ASSERT_EQ(backup.state(), v1::OP_STATE_DONE);
  EXPECT_EQ(backup.sequences(0).leading_ok_pages(), 3u);

  // Load the pages into blocks 10..12 of the memfd, zeroed first.
  auto at = [&](uint32_t layer, uint32_t buffer, uint32_t block) {
    return memfd + (a.kv().Block(layer, buffer, block) - a.kv().memory().data());
  };
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    for (uint32_t buffer = 0; buffer < 2; ++buffer) {
      for (uint32_t block = 10; block < 13; ++block) {
        std::memset(at(layer, buffer, block), 0, kBytesPerBlock);
      }
    }
  }
  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(LoadOf(session, keys, 0, 3, {10, 11, 12}), &l).ok());
  v1::OpResult loaded = h.Wait(session, l.op().op_id());
  ASSERT_EQ(loaded.state(), v1::OP_STATE_DONE);
  EXPECT_THAT(Statuses(loaded.sequences(0)),
              ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK));
  for (uint32_t i = 0; i < 3; ++i) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (uint32_t buffer = 0; buffer < 2; ++buffer) {
        // The memfd's block 10+i now holds what the engine's block 3+i held.
        EXPECT_EQ(std::memcmp(at(layer, buffer, 10 + i), a.kv().Block(layer, buffer, 3 + i),
                              kBytesPerBlock),
                  0)
            << "page " << i << " layer " << layer << " buffer " << buffer;
      }
    }
  }
  // The daemon used the memfd, never the shm object the engine would have registered by name.
  EXPECT_EQ(a.Snapshot(), shm_before);

  v1::UnregisterEngineRequest unreg;
  unreg.set_session_id(session);
  v1::UnregisterEngineResponse unreg_resp;
  EXPECT_TRUE(h.UnregisterEngine(unreg, &unreg_resp).ok());
  munmap(p, bytes);
  close(fd);
}

// An engine that truncates its KV object under the daemon's mapping: the op under way fails, and
// every later Load and Backup answers one code, FAILED_PRECONDITION (HANDLE_OPEN_FAILED): the
// engine's doing, fixed by registering again. Before issue #24 Load answered INTERNAL (a daemon
// bug, by the API's table) where Backup's op failed with the device's FAILED_PRECONDITION.
TEST(CacheServiceTest, LoadAndBackupAfterTheEngineTruncatedItsMemoryAreFailedPrecondition) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, 1);
  h.Register(a, "inst-trunc", 0, spec);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(7, 3));
  ASSERT_EQ(h.Wait(a.session, h.Backup(a.session, keys, 0, 3, {0, 1, 2}).op().op_id()).state(),
            v1::OP_STATE_DONE);

  // The engine shrinks its object to nothing; it does not touch its own mapping afterwards.
  const int fd = shm_open(a.kv().memory().name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << strerror(errno);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);

  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(LoadOf(a.session, keys, 0, 3, {5, 6, 7}), &l).ok());
  const v1::OpResult faulted = h.Wait(a.session, l.op().op_id());
  EXPECT_EQ(faulted.state(), v1::OP_STATE_FAILED);
  EXPECT_THAT(faulted.error_message(), HasSubstr("truncated"));

  Rpc load = h.Load(LoadOf(a.session, keys, 0, 3, {8, 9, 10}), &l);
  EXPECT_EQ(load.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << load.status.error_message();
  EXPECT_EQ(load.reason, "ERROR_REASON_HANDLE_OPEN_FAILED");
  EXPECT_EQ(load.field, "session_id");
  EXPECT_THAT(load.status.error_message(), HasSubstr("register again"));

  Rpc backup;
  const std::vector<core::PageKey> fresh = CacheHarness::Keys(spec, Tokens(8, 2));
  h.Backup(a.session, fresh, 0, 2, {11, 12}, &backup);
  EXPECT_EQ(backup.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << backup.status.error_message();
  EXPECT_EQ(backup.reason, "ERROR_REASON_HANDLE_OPEN_FAILED");
  EXPECT_EQ(backup.field, "session_id");
}

// A SIM registration whose memfd the daemon cannot find is refused, naming the region.
TEST(CacheServiceTest, MissingMemfdIsRefusedNamingTheRegion) {
  CacheHarness h;
  TestEngine a(16, false, 1);
  v1::RegisterEngineRequest req = a.Register("inst-memfd", 0, Spec());
  req.mutable_layout()->mutable_regions(0)->set_sim_shm_name(
      absl::StrCat("/proc/", getpid(), "/fd/999999"));
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(req, &resp);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.field, "layout.regions[0]");
  EXPECT_THAT(r.status.error_message(), HasSubstr("no such process or fd"));
  EXPECT_EQ(h.cache().GetCounts().sessions, 0u);
}

// A's registration as a CUDA engine would send it (IPC handles instead of shm names).
v1::RegisterEngineRequest AsCuda(v1::RegisterEngineRequest r) {
  r.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  for (v1::MemoryRegion& region : *r.mutable_layout()->mutable_regions()) {
    region.set_cuda_ipc_handle(std::string(gpu::kCudaIpcHandleBytes, 'h'));
  }
  r.clear_completion();
  return r;
}

// CUDA primary plus the host-memory sim device: each session's calls reach its kind's backend.
TEST(CacheServiceTest, EachSessionUsesTheBackendOfItsDeviceKind) {
  FakeCudaDevice cuda;
  HarnessOptions o;
  o.primary = &cuda;
  CacheHarness h(o);
  EXPECT_EQ(h.cache().device_kind(), v1::DEVICE_KIND_CUDA);
  EXPECT_THAT(h.cache().devices().kinds(),
              ElementsAre(v1::DEVICE_KIND_CUDA, v1::DEVICE_KIND_SIM));

  // Host-memory engines: the sim device maps and copies, byte for byte.
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(16, false, /*seed=*/1);
  TestEngine b(16, false, /*seed=*/2);
  h.Register(a, "inst-a", 0, spec);
  h.Register(b, "inst-b", 0, spec);
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(5, 2));
  EXPECT_EQ(h.Wait(a.session, h.Backup(a.session, keys, 0, 2, {6, 7}).op().op_id()).state(),
            v1::OP_STATE_DONE);
  v1::LoadResponse l;
  ASSERT_TRUE(h.Load(LoadOf(b.session, keys, 0, 2, {1, 2}), &l).ok());
  EXPECT_EQ(h.Wait(b.session, l.op().op_id()).state(), v1::OP_STATE_DONE);
  EXPECT_EQ(b.CheckBlock(1, a.seed(), 6), "");
  EXPECT_EQ(b.CheckBlock(2, a.seed(), 7), "");
  EXPECT_EQ(cuda.open_calls.load(), 0);

  // A CUDA engine goes to the CUDA backend (which, being a fake, cannot open it).
  TestEngine c(16, false, 3);
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(AsCuda(c.Register("inst-c", 0, spec)), &resp);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(r.status.error_message(), HasSubstr(FakeCudaDevice::kOpenError));
  EXPECT_EQ(cuda.open_calls.load(), 1);
  EXPECT_EQ(h.cache().GetCounts().sessions, 2u);
}

TEST(CacheServiceTest, UnservedDeviceKindListsTheServedKinds) {
  FakeCudaDevice cuda;
  HarnessOptions o;
  o.primary = &cuda;
  o.serve_sim = false;  // device.host_memory_engines: false.
  CacheHarness h(o);
  TestEngine a(16, false, 1);
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(a.Register("inst-a", 0, Spec()), &resp);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "ERROR_REASON_DEVICE_UNAVAILABLE");
  EXPECT_EQ(r.field, "device.kind");
  EXPECT_THAT(r.status.error_message(),
              HasSubstr("device.kind DEVICE_KIND_SIM is not served: this daemon serves "
                        "DEVICE_KIND_CUDA"));
  EXPECT_EQ(cuda.open_calls.load(), 0);
}

// A namespace's page geometry binds only while a session or a page holds it: a stray
// registration with another block size, once gone, does not lock the namespace for the daemon's
// life (the audit's reproduction: 8192-byte blocks, unregistered, then 4096-byte engines refused).
TEST(NamespaceGeometryTest, HeldOnlyWhileSessionsOrPagesRemain) {
  CacheHarness h;
  const v1::NamespaceSpec spec = Spec();
  auto unregister = [&](uint64_t session) {
    v1::UnregisterEngineRequest u;
    u.set_session_id(session);
    v1::UnregisterEngineResponse ur;
    ASSERT_TRUE(h.UnregisterEngine(u, &ur).ok());
  };
  auto refused = [&](TestEngine& e, const std::string& instance) {
    v1::RegisterEngineResponse resp;
    Rpc r = h.RegisterEngine(e.Register(instance, 0, spec), &resp);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(r.reason, "ERROR_REASON_GROUP_MISMATCH");
    EXPECT_THAT(r.status.error_message(), HasSubstr("held while"));
  };
  TestEngine big(16, false, 1, 2 * kBytesPerBlock);
  TestEngine small(16, false, 2);
  h.Register(big, "big", 0, spec);
  refused(small, "small");  // while `big` is registered
  unregister(big.session);
  h.Register(small, "small", 0, spec);  // nothing holds 8192 any more: 4096 is adopted

  // `small` stores pages and leaves: the pages hold the geometry.
  const std::vector<core::PageKey> keys = CacheHarness::Keys(spec, Tokens(3, 4));
  h.Wait(small.session, h.Backup(small.session, keys, 0, 4, {0, 1, 2, 3}).op().op_id());
  unregister(small.session);
  TestEngine big2(16, false, 4, 2 * kBytesPerBlock);
  refused(big2, "big2");
  // The pages go (as an admin Clear takes them): the next engine's geometry is adopted, and it
  // stores and loads at that size.
  h.ClearIndexes();
  h.Register(big2, "big2", 0, spec);
  h.Wait(big2.session, h.Backup(big2.session, keys, 0, 2, {5, 6}).op().op_id());
  EXPECT_EQ(h.L2Hits(big2.session, Tokens(3, 4)), 2u);
}


// Sessions and tenants bound to who connects (#13 defect 2). The harness serves its socket
// through UnixListener, as the daemon does, so the identities are the kernel's.
TEST(CacheServiceTest, ASessionBelongsToTheProcessThatRegisteredIt) {
  CacheHarness h;
  TestEngine e(16, /*mla=*/false, 1);
  v1::RegisterEngineResponse r = h.Register(e, "inst-a", 0, Spec());
  absl::StatusOr<std::shared_ptr<Session>> s = h.cache().FindSession(r.session_id());
  ASSERT_TRUE(s.ok()) << s.status();
  const SessionInfo& info = (*s)->info();
  EXPECT_EQ(info.owner.kind, PeerIdentity::Kind::kUnix);
  EXPECT_EQ(info.owner.uid, ::getuid());
  EXPECT_EQ(info.owner.gid, ::getgid());
  EXPECT_EQ(info.owner.pid, ::getpid());
  // The owner's calls go through (another process's are refused: tests/integration/
  // test_security.py, which needs a second process).
  v1::HeartbeatRequest hb;
  hb.set_session_id(r.session_id());
  v1::HeartbeatResponse hr;
  EXPECT_TRUE(h.Heartbeat(hb, &hr).ok());
  EXPECT_EQ(hr.state(), v1::SESSION_STATE_ACTIVE);
}

TEST(CacheServiceTest, ATenantNotGrantedToThePeerIsRefusedAndLeavesNothing) {
  HarnessOptions o;
  o.tenants_allow = absl::StrCat("team-a=uid:", ::getuid() + 1, ";team-b=gid:", ::getgid());
  CacheHarness h(o);
  TestEngine e(16, /*mla=*/false, 1);
  v1::RegisterEngineResponse resp;
  Rpc r = h.RegisterEngine(e.Register("inst-a", 0, Spec()), &resp);  // Spec(): tenant team-a.
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(r.reason, "ERROR_REASON_TENANT_DENIED");
  EXPECT_EQ(r.field, "namespace_spec.tenant");
  EXPECT_THAT(r.status.error_message(),
              HasSubstr(absl::StrCat("'team-a' is not granted to uid ", ::getuid())));
  // Refused before anything was made: no namespace, no session, no geometry held.
  EXPECT_EQ(h.cache().GetCounts().namespaces, 0u);
  EXPECT_EQ(h.cache().GetCounts().sessions, 0u);

  v1::NamespaceSpec b = Spec();
  b.set_tenant("team-b");
  h.Register(e, "inst-b", 0, b);  // Granted to this process's group.
  EXPECT_EQ(h.cache().GetCounts().sessions, 1u);
}

}  // namespace
}  // namespace kvcellar::server::testing
