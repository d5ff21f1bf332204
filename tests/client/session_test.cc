// The Session state machine against FakeDaemon: heartbeats, re-registration after a forgotten
// session or a daemon restart, a slow daemon (deadline, then suspect), a Backup whose outcome the
// transport lost, a draining daemon, and the ns_digest check.
#include "client/session.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "client/kvcellar_client.h"
#include "tests/client/fake_daemon.h"
#include "tests/client/test_util.h"

namespace kvcellar::client {
namespace {

using testing::FakeConfig;
using testing::FakeDaemon;
using testing::kSlack;
using testing::SchedulerRegistration;
using testing::TempDir;
using testing::WorkerRegistration;

// The shared fast options with the 500 ms registration timeout these tests were written with.
ClientOptions FastOptions(const std::string& addr) {
  return testing::FastOptions(addr, absl::Milliseconds(500));
}

// Polls `pred` for up to `timeout`.
template <typename Pred>
bool Eventually(Pred pred, absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return pred();
}

class SessionTest : public ::testing::Test {
 protected:
  std::string sock() const { return dir_.File("fake.sock"); }
  std::unique_ptr<FakeDaemon> StartFake(FakeConfig config = {}) {
    auto d = std::make_unique<FakeDaemon>(sock(), config);
    EXPECT_TRUE(d->ok());
    return d;
  }
  std::vector<uint32_t> Tokens(size_t n) {
    std::vector<uint32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(i + 1);
    return t;
  }
  TempDir dir_;
};

TEST_F(SessionTest, RegistersAndHeartbeats) {
  auto fake = StartFake({.l2_hits = 2});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("hb"));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->state(), SessionState::kActive);
  const SessionInfo info = (*session)->info();
  EXPECT_NE(info.session_id, 0u);
  EXPECT_EQ(info.generation, 1u);
  EXPECT_EQ(info.lease_ms, 1000u);
  EXPECT_TRUE(Eventually([&] { return fake->heartbeats >= 3; }));

  const std::vector<uint32_t> tokens = Tokens(16);
  MatchSequence seq;
  seq.tokens = tokens;
  const MatchReply m = (*session)->Match({seq}, {.pin = true});
  EXPECT_TRUE(m.status.ok()) << m.status;
  EXPECT_EQ(m.results[0].l2_hit_pages, 2u);
  EXPECT_NE(m.results[0].pin_id, 0u);
  EXPECT_EQ((*client)->stats().match_l2_hit_pages, 2u);

  (*session)->Close();
  EXPECT_EQ(fake->unregisters, 1);
  EXPECT_EQ(fake->live_sessions(), 0u);
}

TEST_F(SessionTest, ReregistersWhenTheDaemonForgetsTheSession) {
  auto fake = StartFake({.l2_hits = 1});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("forget"));
  ASSERT_TRUE(session.ok());
  const uint64_t first_id = (*session)->info().session_id;
  fake->ForgetSessions();  // Lease expired daemon-side.
  ASSERT_TRUE(Eventually([&] { return (*session)->info().generation == 2; }));
  EXPECT_TRUE((*session)->WaitUntilActive(absl::Seconds(2)));
  EXPECT_NE((*session)->info().session_id, first_id);
  EXPECT_GE(fake->replaces, 1);  // The re-registration replaces whatever is left.
  const ClientStats st = (*client)->stats();
  EXPECT_EQ(st.reregistrations, 1u);
  EXPECT_EQ(st.sessions_lost, 1u);
}

TEST_F(SessionTest, DataCallLearningSessionUnknownReregisters) {
  FakeConfig config{.heartbeat_interval_ms = 60000, .l2_hits = 1};
  auto fake = StartFake(config);
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("unknown"));
  ASSERT_TRUE(session.ok());
  fake->ForgetSessions();
  const std::vector<uint32_t> tokens = Tokens(8);
  MatchSequence seq;
  seq.tokens = tokens;
  const MatchReply m = (*session)->Match({seq});
  EXPECT_EQ(m.results[0].l2_hit_pages, 0u);  // A miss, not an error the engine must handle.
  EXPECT_EQ(m.status.code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*session)->WaitUntilActive(absl::Seconds(2)));
  EXPECT_EQ((*session)->info().generation, 2u);
  EXPECT_EQ((*session)->Match({seq}).results[0].l2_hit_pages, 1u);
}

TEST_F(SessionTest, ReconnectsAfterDaemonRestartWithNewEpoch) {
  auto fake = StartFake({.epoch = 1});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 1, .bytes_per_block = 64, .num_blocks = 4});
  ASSERT_TRUE(sim.ok());
  auto session = (*client)->Register(WorkerRegistration(**sim, "restart"));
  ASSERT_TRUE(session.ok());
  ASSERT_EQ((*session)->state(), SessionState::kActive);
  // An op in flight when the daemon dies.
  const std::vector<core::PageKey> keys = (*session)->ComputeKeys(Tokens(4));
  const std::vector<uint32_t> blocks = {0};
  BackupSequence bs;
  bs.keys = keys;
  bs.blocks = blocks;
  const OpResult backup = (*session)->Backup({bs});
  ASSERT_EQ(backup.state, OpState::kPending);
  const std::vector<uint32_t> load_blocks = {2};
  LoadSequence ls;
  ls.keys = keys;
  ls.blocks = load_blocks;
  const OpResult load = (*session)->Load({ls}, {.signal_layers = true, .completion_slot = 1});
  ASSERT_NE(load.ref.op_id, 0u);
  EXPECT_FALSE((*session)->Ended(load.ref));
  // A stale layer word from the old daemon, as if it had signalled op 1000.
  (*sim)->signals().SignalLayer(0, 0, 1000);

  fake.reset();  // Daemon gone.
  MatchSequence seq;
  const std::vector<uint32_t> tokens = Tokens(8);
  seq.tokens = tokens;
  const absl::Time t0 = absl::Now();
  const MatchReply m = (*session)->Match({seq});
  EXPECT_LE(absl::Now() - t0, absl::Milliseconds(200) + kSlack);
  EXPECT_EQ(m.results[0].l2_hit_pages, 0u);

  fake = StartFake({.epoch = 2, .l2_hits = 2});  // Restarted: new epoch, no sessions.
  ASSERT_TRUE(Eventually([&] {
    return (*session)->state() == SessionState::kActive && (*session)->info().generation == 2;
  }));
  EXPECT_EQ((*session)->info().daemon_epoch, 2u);
  EXPECT_EQ((*session)->Match({seq}).results[0].l2_hit_pages, 2u);
  // The op of the old daemon is over: its session ended with the daemon.
  const std::vector<OpResult> w = (*session)->WaitOps({backup.ref});
  EXPECT_EQ(w[0].state, OpState::kFailed);
  // The library zeroed the signal region before registering it with the new daemon.
  EXPECT_EQ((*sim)->signals().layer_word(0, 0), 0u);
  // The old daemon will never signal the old Load: a wait on it ends at once, not at its
  // deadline.
  EXPECT_TRUE((*session)->Ended(load.ref));
  const absl::Time t1 = absl::Now();
  EXPECT_EQ((*session)->WaitLayerSignal(load.ref, 1, 0, absl::Now() + absl::Seconds(10)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LE(absl::Now() - t1, absl::Milliseconds(100));
  EXPECT_GE((*client)->stats().reregistrations, 1u);
}

TEST_F(SessionTest, SlowDaemonCostsOneDeadlineThenMissesAtOnce) {
  auto fake = StartFake({.heartbeat_interval_ms = 100, .l2_hits = 1});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("slow"));
  ASSERT_TRUE(session.ok());
  fake->match_delay_ms = 2000;
  fake->heartbeat_delay_ms = 2000;
  const std::vector<uint32_t> tokens = Tokens(8);
  MatchSequence seq;
  seq.tokens = tokens;
  absl::Time t0 = absl::Now();
  MatchReply m = (*session)->Match({seq});
  EXPECT_LE(absl::Now() - t0, absl::Milliseconds(200) + kSlack);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(150));
  EXPECT_EQ(m.results[0].l2_hit_pages, 0u);
  EXPECT_EQ(m.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*session)->state(), SessionState::kSuspect);
  // While suspect, calls do not wait for the slow daemon at all.
  t0 = absl::Now();
  m = (*session)->Match({seq});
  EXPECT_LE(absl::Now() - t0, absl::Milliseconds(100));  // Far below the 200 ms deadline.
  EXPECT_EQ(m.results[0].l2_hit_pages, 0u);
  EXPECT_GE((*client)->stats().rpcs_deadline_exceeded, 1u);

  // The daemon recovers; a probe finds it and calls go through again.
  fake->match_delay_ms = 0;
  fake->heartbeat_delay_ms = 0;
  ASSERT_TRUE((*session)->WaitUntilActive(absl::Seconds(3)));
  EXPECT_EQ((*session)->info().generation, 1u);  // Same session: it never lapsed.
  EXPECT_EQ((*session)->Match({seq}).results[0].l2_hit_pages, 1u);
}

TEST_F(SessionTest, LostBackupReplyReplacesTheSessionBeforeBlocksAreFree) {
  auto fake = StartFake({.heartbeat_interval_ms = 100});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 1, .bytes_per_block = 64, .num_blocks = 4});
  ASSERT_TRUE(sim.ok());
  auto session = (*client)->Register(WorkerRegistration(**sim, "uncertain"));
  ASSERT_TRUE(session.ok());
  const int replaces_before = fake->replaces;
  fake->backup_delay_ms = 1000;  // The reply will not arrive within rpc_timeout.
  const std::vector<core::PageKey> keys = (*session)->ComputeKeys(Tokens(4));
  const std::vector<uint32_t> blocks = {1};
  BackupSequence bs;
  bs.keys = keys;
  bs.blocks = blocks;
  const OpResult r = (*session)->Backup({bs});
  // Not FAILED: the daemon may have accepted it and may still read block 1.
  EXPECT_EQ(r.state, OpState::kPending);
  EXPECT_EQ(r.ref.op_id, 0u);
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ((*client)->stats().uncertain_submissions, 1u);
  fake->backup_delay_ms = 0;
  // WaitOps settles it once the session was replaced (replace_existing ends the old one).
  const std::vector<OpResult> w = (*session)->WaitOps({r.ref}, {.timeout = absl::Seconds(3)});
  EXPECT_EQ(w[0].state, OpState::kFailed);
  EXPECT_GT(fake->replaces, replaces_before);
  EXPECT_EQ((*session)->info().generation, 2u);
}

TEST_F(SessionTest, DrainingDaemonStopsSubmissions) {
  auto fake = StartFake({.heartbeat_interval_ms = 50, .l2_hits = 1});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("drain"));
  ASSERT_TRUE(session.ok());
  fake->heartbeat_draining = true;
  ASSERT_TRUE(Eventually([&] { return (*session)->state() == SessionState::kSuspect; }));
  const int matches = fake->matches;
  const std::vector<uint32_t> tokens = Tokens(8);
  MatchSequence seq;
  seq.tokens = tokens;
  EXPECT_EQ((*session)->Match({seq}).results[0].l2_hit_pages, 0u);
  EXPECT_EQ(fake->matches, matches);  // Not even sent.
}

TEST_F(SessionTest, DigestMismatchRefusesTheCacheAndLogsOnce) {
  auto fake = StartFake({.wrong_digest = true, .l2_hits = 3});
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("mismatch"));
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->state(), SessionState::kRefused);
  EXPECT_FALSE((*session)->WaitUntilActive(absl::Milliseconds(50)));
  const std::vector<uint32_t> tokens = Tokens(16);
  MatchSequence seq;
  seq.tokens = tokens;
  const MatchReply m = (*session)->Match({seq});
  EXPECT_EQ(m.results[0].l2_hit_pages, 0u);  // The daemon would have said 3.
  EXPECT_EQ(fake->matches, 0);
  EXPECT_EQ((*client)->stats().ns_digest_mismatches, 1u);
  EXPECT_EQ(fake->live_sessions(), 0u);  // It unregistered the session it will not use.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(fake->registers, 1);  // And never tries again.
}

TEST_F(SessionTest, DaemonStartingLaterIsPickedUp) {
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Register(SchedulerRegistration("late"));
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->state(), SessionState::kConnecting);
  absl::SleepFor(absl::Milliseconds(300));
  auto fake = StartFake({.l2_hits = 1});
  ASSERT_TRUE((*session)->WaitUntilActive(absl::Seconds(3)));
  EXPECT_EQ((*session)->info().generation, 1u);
  EXPECT_EQ((*client)->stats().reregistrations, 0u);
}

TEST_F(SessionTest, LoadAndWaitOpsRoundTrip) {
  auto fake = StartFake();
  auto client = Client::Connect(FastOptions(sock()));
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 1, .bytes_per_block = 64, .num_blocks = 4});
  ASSERT_TRUE(sim.ok());
  auto session = (*client)->Register(WorkerRegistration(**sim, "load"));
  ASSERT_TRUE(session.ok());
  const std::vector<core::PageKey> keys = (*session)->ComputeKeys(Tokens(8));
  const std::vector<uint32_t> blocks = {2, 3};
  LoadSequence ls;
  ls.keys = keys;
  ls.blocks = blocks;
  const OpResult r = (*session)->Load({ls});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.state, OpState::kPending);
  EXPECT_EQ(r.sequences[0].leading_ok_pages, 2u);
  EXPECT_THAT(r.sequences[0].page_status, ::testing::Each(PageStatus::kPending));
  // Per-layer signals through the session (the test plays the daemon's part).
  (*sim)->signals().SignalLayer(0, 0, r.ref.op_id);
  EXPECT_TRUE((*session)->WaitLayerSignal(r.ref, 0, 0, absl::Now() + absl::Seconds(1)).ok());
  EXPECT_EQ((*session)->WaitLoadSignal(r.ref, 0, absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  (*sim)->signals().SignalOp(0, r.ref.op_id, /*failed=*/false);
  EXPECT_TRUE((*session)->WaitLoadSignal(r.ref, 0, absl::Now() + absl::Seconds(1)).ok());
  const std::vector<OpResult> w = (*session)->WaitOps({r.ref});
  EXPECT_EQ(w[0].state, OpState::kDone);
  EXPECT_FALSE((*session)->Ended(r.ref));
  // Mismatched keys and blocks never reach the daemon.
  ls.blocks = absl::MakeConstSpan(blocks).subspan(0, 1);
  EXPECT_EQ((*session)->Load({ls}).status.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcellar::client
