// Client basics that need no daemon: local key computation, and the failure semantics against a
// daemon that is not there (every call a miss within its deadline, counted, nothing thrown).
#include "client/kvcellar_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "core/page_key.h"
#include "tests/client/test_util.h"

namespace kvcellar::client {
namespace {

using testing::FastOptions;
using testing::kSlack;
using testing::SchedulerRegistration;
using testing::TempDir;
using testing::TestNamespace;
using testing::WorkerRegistration;


TEST(ClientKeysTest, EqualsCoreChain) {
  const core::NamespaceSpec ns = TestNamespace();
  std::vector<uint32_t> tokens(37);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7919 + 3);
  const std::vector<core::PageKey> ours = ComputePageKeys(ns, tokens);
  const std::vector<core::PageKey> theirs =
      core::ComputePageKeys(ns.Digest(), tokens, ns.page_size);
  ASSERT_EQ(ours.size(), 9u);  // 37 tokens, P = 4: 9 full pages, the partial one has no key.
  EXPECT_EQ(ours, theirs);
}

TEST(ClientKeysTest, MatchesDocsWorkedExample) {
  // docs/keys.md, "Worked example".
  core::NamespaceSpec ns = TestNamespace();
  const std::vector<uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const std::vector<core::PageKey> keys = ComputePageKeys(ns, tokens);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(ns.Digest().Hex(), "2eb43a1b297bf3a7e7001fd032c23ee2944a4069f05c73eef4790c49c6475337");
  EXPECT_EQ(keys[0].Hex(), "534bdcdf6b10c50653fb787a2d12602ca43a75cdc5f603a403cfac745ae379a3");
  EXPECT_EQ(keys[1].Hex(), "851048f8af9a397f4ee6cbe6ffaba5b89e4af4f8a6a70ee3f9cb6ad4308dcd81");
}

TEST(ClientKeysTest, SessionKeysAndMatchKeysEqualCore) {
  TempDir dir;
  auto client = Client::Connect(FastOptions(dir.File("none.sock")));
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Register(SchedulerRegistration("keys"));
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const auto expected = core::ComputePageKeys(TestNamespace().Digest(), tokens, 4);
  EXPECT_EQ((*session)->ComputeKeys(tokens), expected);
  // Match returns the keys even when the daemon is away: the engine needs them for Backup.
  MatchSequence seq;
  seq.tokens = tokens;
  const MatchReply m = (*session)->Match({seq});
  EXPECT_EQ(m.results[0].keys, expected);
  EXPECT_EQ(m.results[0].total_pages, 2u);
}

TEST(ClientConnectTest, RejectsBadAddress) {
  ClientOptions o;
  o.addr = "not-a-path-nor-host-port";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientConnectTest, RejectsInvalidRegistration) {
  TempDir dir;
  auto client = Client::Connect(FastOptions(dir.File("none.sock")));
  ASSERT_TRUE(client.ok());
  EngineRegistration reg = SchedulerRegistration("");
  EXPECT_EQ((*client)->Register(reg).status().code(), absl::StatusCode::kInvalidArgument);
  reg = SchedulerRegistration("x");
  reg.ns.kv_dtype = "float33";
  EXPECT_EQ((*client)->Register(reg).status().code(), absl::StatusCode::kInvalidArgument);
}

// The daemon is not there at all: Register still gives a session (the engine must run), and
// every call is an immediate miss, counted.
TEST(MissingDaemonTest, EveryCallIsAMissWithinTheDeadline) {
  TempDir dir;
  const ClientOptions opts = FastOptions(dir.File("missing.sock"));
  auto client = Client::Connect(opts);
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 2, .bytes_per_block = 256, .num_blocks = 8});
  ASSERT_TRUE(sim.ok()) << sim.status();

  absl::Time t0 = absl::Now();
  auto session = (*client)->Register(WorkerRegistration(**sim, "missing"));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_LE(absl::Now() - t0, opts.register_timeout + kSlack);
  EXPECT_EQ((*session)->state(), SessionState::kConnecting);
  EXPECT_EQ((*session)->info().session_id, 0u);

  const std::vector<uint32_t> tokens(64, 7);
  MatchSequence seq;
  seq.tokens = tokens;
  for (int i = 0; i < 20; ++i) {
    t0 = absl::Now();
    const MatchReply m = (*session)->Match({seq}, {.pin = true});
    EXPECT_LE(absl::Now() - t0, opts.rpc_timeout + kSlack);
    ASSERT_EQ(m.results.size(), 1u);
    EXPECT_EQ(m.results[0].l2_hit_pages, 0u);
    EXPECT_EQ(m.results[0].pin_id, 0u);
    EXPECT_EQ(m.results[0].total_pages, 16u);
    EXPECT_EQ(m.status.code(), absl::StatusCode::kUnavailable);
  }

  const std::vector<core::PageKey> keys = (*session)->ComputeKeys(tokens);
  const std::vector<uint32_t> blocks = {0, 1};
  LoadSequence ls;
  ls.keys = absl::MakeConstSpan(keys).subspan(0, 2);
  ls.blocks = blocks;
  t0 = absl::Now();
  const OpResult load = (*session)->Load({ls});
  EXPECT_LE(absl::Now() - t0, opts.rpc_timeout + kSlack);
  EXPECT_EQ(load.state, OpState::kFailed);  // Never sent: the blocks are the engine's at once.
  EXPECT_EQ(load.usable_pages(0), 0u);
  ASSERT_EQ(load.sequences.size(), 1u);
  EXPECT_THAT(load.sequences[0].page_status, ::testing::Each(PageStatus::kMiss));

  BackupSequence bs;
  bs.keys = ls.keys;
  bs.blocks = blocks;
  const OpResult backup = (*session)->Backup({bs});
  EXPECT_EQ(backup.state, OpState::kFailed);

  t0 = absl::Now();
  const std::vector<OpResult> waited =
      (*session)->WaitOps({load.ref, backup.ref}, {.timeout = absl::Milliseconds(100)});
  EXPECT_LE(absl::Now() - t0, absl::Milliseconds(100) + opts.rpc_timeout + kSlack);
  ASSERT_EQ(waited.size(), 2u);
  EXPECT_EQ(waited[0].state, OpState::kFailed);
  EXPECT_EQ(waited[1].state, OpState::kFailed);

  const ReleaseReply rel = (*session)->Release({42});
  EXPECT_FALSE(rel.status.ok());
  EXPECT_THAT(rel.pin_outcomes, ::testing::ElementsAre(ReleaseOutcome::kUnknown));

  const ClientStats st = (*client)->stats();
  EXPECT_GE(st.degraded_calls, 22u);
  EXPECT_EQ(st.match_calls, 20u);
  EXPECT_EQ(st.match_l2_hit_pages, 0u);
  EXPECT_GE(st.registration_failures, 1u);
  EXPECT_EQ(st.registrations, 0u);
}

// Keeps trying in the background without blocking anyone; Close ends that.
TEST(MissingDaemonTest, RetriesInTheBackgroundWithBackoff) {
  TempDir dir;
  auto client = Client::Connect(FastOptions(dir.File("missing.sock")));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("retry"));
  ASSERT_TRUE(session.ok());
  EXPECT_FALSE((*session)->WaitUntilActive(absl::Milliseconds(700)));
  const uint64_t failures = (*client)->stats().registration_failures;
  // Backoff 20 ms doubling to 200 ms: about 1 + 5 attempts in 700 ms, certainly not hundreds.
  EXPECT_GE(failures, 3u);
  EXPECT_LE(failures, 20u);
  (*session)->Close();
  EXPECT_EQ((*session)->state(), SessionState::kClosed);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_LE((*client)->stats().registration_failures, failures + 1);
}

TEST(MissingDaemonTest, OpaqueNamespaceRejectsTokens) {
  TempDir dir;
  auto client = Client::Connect(FastOptions(dir.File("missing.sock")));
  ASSERT_TRUE(client.ok());
  EngineRegistration reg = SchedulerRegistration("opaque");
  reg.ns.opaque_keys = true;
  auto session = (*client)->Register(reg);
  ASSERT_TRUE(session.ok());
  const std::vector<uint32_t> tokens(8, 1);
  MatchSequence seq;
  seq.tokens = tokens;
  EXPECT_EQ((*session)->Match({seq}).status.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcellar::client
