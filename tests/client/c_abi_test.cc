// The C ABI (kvcellar_client_c.h) against a missing daemon and against FakeDaemon. (The header
// is also compiled as C by client/tools/c_abi_smoke.c, which links libkvcellar-client.so.)
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/kvcellar_client.h"
#include "client/kvcellar_client_c.h"
#include "client/sim_engine.h"
#include "tests/client/fake_daemon.h"
#include "tests/client/test_util.h"

namespace kvcellar::client {
namespace {

using testing::FakeDaemon;
using testing::TempDir;

kvc_registration SchedulerRegistrationC(const char* instance) {
  kvc_registration reg;
  std::memset(&reg, 0, sizeof(reg));
  reg.instance_id = instance;
  reg.scheduler = 1;
  reg.ns.tenant = "acme";
  reg.ns.model_id = "tiny-llm";
  reg.ns.model_revision = "rev1";
  reg.ns.kv_dtype = "bf16";
  reg.ns.page_size = 4;
  reg.ns.layout = KVC_LAYOUT_MHA;
  reg.ns.tp_size = 1;
  return reg;
}

kvc_client* Connect(const std::string& addr) {
  kvc_client_options o;
  kvc_client_options_init(&o);
  EXPECT_EQ(o.heartbeat, 1);
  o.addr = addr.c_str();
  o.rpc_timeout_ms = 200;
  o.register_timeout_ms = 400;
  o.backoff_min_ms = 20;
  o.backoff_max_ms = 200;
  kvc_client* c = nullptr;
  EXPECT_EQ(kvc_client_connect(&o, &c), KVC_OK) << kvc_last_error();
  return c;
}

TEST(CAbiTest, BadArgumentsSetLastError) {
  EXPECT_EQ(kvc_client_connect(nullptr, nullptr), KVC_ERR_INVALID_ARGUMENT);
  EXPECT_STRNE(kvc_last_error(), "");
  kvc_client_options o;
  kvc_client_options_init(&o);
  o.addr = "no-colon-no-slash";
  kvc_client* c = nullptr;
  EXPECT_EQ(kvc_client_connect(&o, &c), KVC_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(std::string(kvc_last_error()).find("no-colon-no-slash"), std::string::npos);
  EXPECT_NE(std::string(kvc_version()).find("libkvcellar-client"), std::string::npos);
}

TEST(CAbiTest, MissingDaemonGivesMissesNotFailures) {
  TempDir dir;
  kvc_client* c = Connect(dir.File("missing.sock"));
  kvc_registration reg = SchedulerRegistrationC("c-missing");
  kvc_session* s = nullptr;
  ASSERT_EQ(kvc_register(c, &reg, &s), KVC_OK) << kvc_last_error();
  kvc_session_info info;
  ASSERT_EQ(kvc_session_info_get(s, &info), KVC_OK);
  EXPECT_EQ(info.state, KVC_SESSION_CONNECTING);
  EXPECT_EQ(info.session_id, 0u);

  const uint32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  uint8_t keys[2 * KVC_KEY_BYTES];
  ASSERT_EQ(kvc_compute_keys(s, tokens, 10, keys, 2), 2u);
  EXPECT_EQ(kvc_compute_keys(s, tokens, 10, nullptr, 0), 2u);  // Count only.
  const auto expected = ComputePageKeys(testing::TestNamespace(), tokens);
  EXPECT_EQ(std::memcmp(keys, expected[0].bytes.data(), 32), 0);
  EXPECT_EQ(std::memcmp(keys + 32, expected[1].bytes.data(), 32), 0);

  kvc_match_seq seq;
  std::memset(&seq, 0, sizeof(seq));
  seq.tokens = tokens;
  seq.num_tokens = 10;
  seq.l2_hit_pages = 99;  // Outputs are always written.
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(kvc_match(s, &seq, 1, nullptr, nullptr), KVC_ERR_UNAVAILABLE);
  EXPECT_LE(absl::Now() - t0, absl::Milliseconds(350));
  EXPECT_EQ(seq.l2_hit_pages, 0u);
  EXPECT_EQ(seq.total_pages, 2u);
  EXPECT_STRNE(kvc_last_error(), "");

  kvc_op_status st;
  std::memset(&st, 0, sizeof(st));
  st.op = {0, 0};
  EXPECT_NE(kvc_wait(s, &st, 1, 10, 0), KVC_OK);
  EXPECT_EQ(st.state, KVC_OP_FAILED);

  EXPECT_EQ(kvc_session_wait_active(s, 50), KVC_ERR_UNAVAILABLE);
  kvc_client_stats stats;
  ASSERT_EQ(kvc_client_stats_get(c, &stats), KVC_OK);
  EXPECT_GE(stats.degraded_calls, 1u);
  EXPECT_GE(stats.registration_failures, 1u);
  kvc_session_close(s, 0);
  kvc_client_close(c);
}

TEST(CAbiTest, WorkerRoundTripAgainstFakeDaemon) {
  TempDir dir;
  FakeDaemon fake(dir.File("fake.sock"), {.l2_hits = 1});
  ASSERT_TRUE(fake.ok());
  auto sim = SimEngine::Create({.num_layers = 2, .bytes_per_block = 64, .num_blocks = 8});
  ASSERT_TRUE(sim.ok());
  const core::KvLayout& layout = (*sim)->layout();

  std::vector<kvc_region> regions;
  for (const core::MemoryRegion& r : layout.regions) {
    regions.push_back({r.handle.c_str(), nullptr, r.offset, r.size});
  }
  std::vector<kvc_layer> layers;
  for (const core::LayerLayout& l : layout.layers) {
    kvc_layer cl;
    std::memset(&cl, 0, sizeof(cl));
    cl.k = {l.k.region, l.k.offset, l.k.block_stride, l.k.bytes_per_block};
    if (l.v) cl.v = {l.v->region, l.v->offset, l.v->block_stride, l.v->bytes_per_block};
    cl.has_v = l.v.has_value();
    layers.push_back(cl);
  }
  kvc_registration reg = SchedulerRegistrationC("c-worker");
  reg.scheduler = 0;
  reg.device_kind = KVC_DEVICE_SIM;
  reg.regions = regions.data();
  reg.num_regions = regions.size();
  reg.layers = layers.data();
  reg.num_layers = layers.size();
  reg.num_blocks = layout.num_blocks;
  const CompletionChannelSpec ch = (*sim)->signals().Channel();
  reg.num_load_slots = ch.num_load_slots;
  reg.num_ready_slots = ch.num_ready_slots;
  reg.sim_signal_shm_name = ch.sim_shm_name.c_str();
  reg.sim_signal_size = ch.sim_size_bytes;

  kvc_client* c = Connect(dir.File("fake.sock"));
  kvc_session* s = nullptr;
  ASSERT_EQ(kvc_register(c, &reg, &s), KVC_OK) << kvc_last_error();
  ASSERT_EQ(kvc_session_wait_active(s, 1000), KVC_OK);
  kvc_session_info info;
  kvc_session_info_get(s, &info);
  EXPECT_EQ(info.state, KVC_SESSION_ACTIVE);
  EXPECT_EQ(info.generation, 1u);

  const uint32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  kvc_match_seq seq;
  std::memset(&seq, 0, sizeof(seq));
  seq.tokens = tokens;
  seq.num_tokens = 8;
  kvc_match_options mo;
  std::memset(&mo, 0, sizeof(mo));
  mo.pin = 1;
  ASSERT_EQ(kvc_match(s, &seq, 1, &mo, nullptr), KVC_OK) << kvc_last_error();
  EXPECT_EQ(seq.l2_hit_pages, 1u);
  EXPECT_NE(seq.pin_id, 0u);

  uint8_t keys[2 * KVC_KEY_BYTES];
  ASSERT_EQ(kvc_compute_keys(s, tokens, 8, keys, 2), 2u);
  const uint32_t blocks[2] = {3, 4};
  uint8_t status[2] = {0, 0};
  kvc_load_seq ls;
  std::memset(&ls, 0, sizeof(ls));
  ls.keys = keys;
  ls.blocks = blocks;
  ls.num_pages = 1;
  ls.pin_id = seq.pin_id;
  ls.release_pin = 1;
  ls.page_status = status;
  kvc_op op;
  int state = 0;
  ASSERT_EQ(kvc_load(s, &ls, 1, 0, 0, &op, &state), KVC_OK) << kvc_last_error();
  EXPECT_EQ(state, KVC_OP_PENDING);
  EXPECT_EQ(ls.leading_ok_pages, 1u);
  EXPECT_EQ(status[0], KVC_PAGE_PENDING);
  // The test plays the daemon's part on the signal words.
  EXPECT_EQ(kvc_wait_layer(s, op, 1, 0, 10), KVC_ERR_UNAVAILABLE);
  (*sim)->signals().SignalLayer(1, 0, op.op_id);
  EXPECT_EQ(kvc_wait_layer(s, op, 1, 0, 1000), KVC_OK);
  (*sim)->signals().SignalOp(1, op.op_id, /*failed=*/true);
  EXPECT_EQ(kvc_wait_load_signal(s, op, 1, 1000), KVC_ERR_OP_FAILED);

  kvc_backup_seq bs;
  std::memset(&bs, 0, sizeof(bs));
  bs.parent_key = keys;
  bs.keys = keys + 32;
  bs.blocks = blocks + 1;
  bs.num_pages = 1;
  kvc_backup_options bo;
  std::memset(&bo, 0, sizeof(bo));
  bo.has_ready = 1;
  bo.ready_token = 1;
  kvc_op bop;
  ASSERT_EQ(kvc_backup(s, &bs, 1, &bo, &bop, nullptr), KVC_OK) << kvc_last_error();

  uint32_t leading[2][1] = {{0}, {0}};
  kvc_op_status ws[2];
  std::memset(ws, 0, sizeof(ws));
  ws[0].op = op;
  ws[0].leading_ok_pages = leading[0];
  ws[0].leading_ok_cap = 1;
  ws[1].op = bop;
  ws[1].leading_ok_pages = leading[1];
  ws[1].leading_ok_cap = 1;
  ASSERT_EQ(kvc_wait(s, ws, 2, 1000, 0), KVC_OK) << kvc_last_error();
  EXPECT_EQ(ws[0].state, KVC_OP_DONE);
  EXPECT_EQ(ws[1].state, KVC_OP_DONE);
  EXPECT_EQ(leading[0][0], 1u);

  const uint64_t pins[1] = {seq.pin_id};
  EXPECT_EQ(kvc_release(s, pins, 1, nullptr, 0), KVC_OK);
  kvc_session_close(s, 100);
  kvc_client_close(c);
  EXPECT_EQ(fake.unregisters, 1);
}

}  // namespace
}  // namespace kvcellar::client
