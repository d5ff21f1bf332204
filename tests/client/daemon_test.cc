// The client against the real kvcellard (KVCELLAR_BIN_DIR/kvcellard on a temp socket, sim
// device): back up and load byte-exact, then SIGKILL and restart the daemon and check the client
// misses within its deadline, reconnects, re-registers and works again. Skips while the daemon's
// CacheService answers UNIMPLEMENTED.
#include <gtest/gtest.h>

#include <csignal>

#include "absl/time/clock.h"
#include "client/kvcellar_client.h"
#include "client/sim_engine.h"
#include "tests/client/test_util.h"

namespace kvcellar::client {
namespace {

using testing::DaemonProcess;
using testing::TempDir;
using testing::WorkerRegistration;

constexpr uint64_t kSeed = 99;

ClientOptions Options(const std::string& addr) {
  ClientOptions o;
  o.addr = addr;
  o.rpc_timeout = absl::Milliseconds(500);
  o.register_timeout = absl::Seconds(2);
  o.reconnect_backoff_min = absl::Milliseconds(50);
  o.reconnect_backoff_max = absl::Milliseconds(500);
  return o;
}

std::vector<uint32_t> Tokens(uint32_t salt, size_t n) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(salt * 100003 + i * 31 + 1);
  return t;
}

OpResult WaitTerminal(Session& s, OpResult r) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!r.terminal() && absl::Now() < deadline) {
    r = s.WaitOps({r.ref}, {.timeout = absl::Milliseconds(500)})[0];
  }
  return r;
}

// Backs up `pages` pages of `tokens` from blocks [0, pages) with the ready signal published after
// the call; returns the pages stored.
uint32_t BackupPages(Session& s, SimEngine& sim, const std::vector<core::PageKey>& keys) {
  std::vector<uint32_t> blocks(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) blocks[i] = static_cast<uint32_t>(i);
  BackupSequence seq;
  seq.keys = keys;
  seq.blocks = blocks;
  BackupOptions opts;
  opts.has_ready = true;
  opts.ready_slot = 0;
  opts.ready_token = sim.NextReadyToken();
  OpResult r = s.Backup({seq}, opts);
  for (size_t i = 0; i < keys.size(); ++i) {
    sim.FillBlock(blocks[i], kSeed, keys[i], s.info().shard_index);
  }
  sim.PublishReady(0, opts.ready_token);
  r = WaitTerminal(s, std::move(r));
  return r.usable_pages(0);
}

// Matches and loads into blocks [base, ...), verifying every byte; returns the pages verified.
uint32_t LoadAndVerify(Session& s, SimEngine& sim, const std::vector<uint32_t>& tokens,
                       uint32_t base) {
  MatchSequence ms;
  ms.tokens = tokens;
  const MatchReply m = s.Match({ms}, {.pin = true});
  const MatchResult& mr = m.results[0];
  if (mr.l2_hit_pages == 0) return 0;
  std::vector<uint32_t> blocks(mr.l2_hit_pages);
  for (uint32_t i = 0; i < mr.l2_hit_pages; ++i) {
    blocks[i] = base + i;
    sim.ClearBlock(blocks[i], 0xEE);
  }
  LoadSequence ls;
  ls.keys = absl::MakeConstSpan(mr.keys).subspan(0, mr.l2_hit_pages);
  ls.blocks = blocks;
  ls.pin_id = mr.pin_id;
  ls.release_pin = true;
  const OpResult r = WaitTerminal(s, s.Load({ls}));
  const uint32_t n = r.usable_pages(0);
  for (uint32_t i = 0; i < n; ++i) {
    std::string first;
    EXPECT_EQ(sim.CountMismatches(blocks[i], kSeed, mr.keys[i], s.info().shard_index, &first), 0u)
        << first;
  }
  return n;
}

TEST(RealDaemonTest, SurvivesSigkillAndRestart) {
  TempDir dir;
  DaemonProcess daemon(dir.path());
  ASSERT_TRUE(daemon.Start()) << "kvcellard did not start; see " << dir.File("kvcellard.log");
  auto client = Client::Connect(Options(daemon.socket()));
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 2, .bytes_per_block = 512, .num_blocks = 32});
  ASSERT_TRUE(sim.ok()) << sim.status();
  auto session = (*client)->Register(WorkerRegistration(**sim, "restart-test"));
  ASSERT_TRUE(session.ok()) << session.status();
  if (!(*session)->WaitUntilActive(absl::Seconds(3))) {
    if ((*client)->stats().rpcs_unimplemented > 0) {
      GTEST_SKIP() << "kvcellard's CacheService is not implemented yet";
    }
    FAIL() << "session never became active: " << SessionStateName((*session)->state());
  }
  Session& s = **session;

  const std::vector<uint32_t> tokens = Tokens(1, 4 * 6);
  const std::vector<core::PageKey> keys = s.ComputeKeys(tokens);
  ASSERT_EQ(BackupPages(s, **sim, keys), 6u);
  EXPECT_EQ(LoadAndVerify(s, **sim, tokens, 10), 6u);

  daemon.Kill(SIGKILL);
  // Down: a miss within the deadline, every time, and nothing crashes.
  for (int i = 0; i < 5; ++i) {
    const absl::Time t0 = absl::Now();
    MatchSequence ms;
    ms.tokens = tokens;
    EXPECT_EQ(s.Match({ms}).results[0].l2_hit_pages, 0u);
    EXPECT_LE(absl::Now() - t0, absl::Milliseconds(500 + 200));
  }

  ASSERT_TRUE(daemon.Start()) << "restart failed";
  ASSERT_TRUE(s.WaitUntilActive(absl::Seconds(10)));
  EXPECT_GE(s.info().generation, 2u);
  const ClientStats st = (*client)->stats();
  EXPECT_GE(st.reregistrations, 1u);
  EXPECT_GE(st.sessions_lost, 1u);
  // A fresh daemon (no warm restart): the old pages are gone, so Match misses ...
  MatchSequence ms;
  ms.tokens = tokens;
  EXPECT_EQ(s.Match({ms}).results[0].l2_hit_pages, 0u);
  // ... and the cache works again through the same Session.
  const std::vector<uint32_t> tokens2 = Tokens(2, 4 * 3);
  ASSERT_EQ(BackupPages(s, **sim, s.ComputeKeys(tokens2)), 3u);
  EXPECT_EQ(LoadAndVerify(s, **sim, tokens2, 20), 3u);
}

TEST(RealDaemonTest, StoppedDaemonIsAMissWithinTheDeadline) {
  TempDir dir;
  DaemonProcess daemon(dir.path());
  ASSERT_TRUE(daemon.Start());
  ClientOptions o = Options(daemon.socket());
  o.rpc_timeout = absl::Milliseconds(300);
  auto client = Client::Connect(o);
  ASSERT_TRUE(client.ok());
  auto sim = SimEngine::Create({.num_layers = 1, .bytes_per_block = 256, .num_blocks = 8});
  ASSERT_TRUE(sim.ok());
  auto session = (*client)->Register(WorkerRegistration(**sim, "stopped"));
  ASSERT_TRUE(session.ok());
  if (!(*session)->WaitUntilActive(absl::Seconds(3))) {
    GTEST_SKIP() << "kvcellard's CacheService is not implemented yet";
  }
  daemon.StopAndWait();  // Alive, accepting connections, answering nothing.
  const std::vector<uint32_t> tokens = Tokens(3, 16);
  MatchSequence ms;
  ms.tokens = tokens;
  for (int i = 0; i < 3; ++i) {
    const absl::Time t0 = absl::Now();
    EXPECT_EQ((*session)->Match({ms}).results[0].l2_hit_pages, 0u);
    EXPECT_LE(absl::Now() - t0, absl::Milliseconds(300 + 200));
  }
  EXPECT_GE((*client)->stats().rpcs_deadline_exceeded, 1u);
}

}  // namespace
}  // namespace kvcellar::client
