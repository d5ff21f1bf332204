// Tests CacheService's request validation (server/rpc/request_validation.h) through the real
// service: every kind of bad request is rejected whole, with the gRPC code, the
// kvcellar-error-reason and kvcellar-error-field trailers the proto documents, and nothing is
// copied or changed: the engine's blocks, the index and the pool are exactly as before.
#include <atomic>
#include <functional>
#include <thread>

#include "tests/server/cache_test_harness.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;

struct Expect {
  grpc::StatusCode code;
  std::string reason;
  std::string field;
  std::string message = "";
};

class CacheValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    h_ = std::make_unique<CacheHarness>();
    a_ = std::make_unique<TestEngine>(16, false, 1);
    h_->Register(*a_, "inst-a", 0, Spec());
    scheduler_ = h_->RegisterScheduler("inst-a", Spec());
    keys_ = CacheHarness::Keys(Spec(), Tokens(1, 4));
    h_->Wait(a_->session, h_->Backup(a_->session, keys_, 0, 2, {0, 1}).op().op_id());
  }

  // Runs `call` and checks that it failed as expected and changed nothing.
  void Rejected(const std::string& what, const std::function<Rpc()>& call, const Expect& e) {
    SCOPED_TRACE(what);
    const std::string memory = a_->Snapshot();
    const core::RadixIndexStats before = h_->IndexStats();
    const uint64_t slots = h_->PoolSlotsUsed();
    const size_t sessions = h_->cache().GetCounts().sessions;
    Rpc r = call();
    EXPECT_EQ(r.status.error_code(), e.code) << r.status.error_message();
    EXPECT_EQ(r.reason, e.reason);
    EXPECT_EQ(r.field, e.field);
    if (!e.message.empty()) {
      EXPECT_THAT(r.status.error_message(), HasSubstr(e.message));
    }
    absl::SleepFor(absl::Milliseconds(5));  // Anything wrongly submitted would be copying now.
    EXPECT_EQ(a_->Snapshot(), memory) << "engine memory changed";
    const core::RadixIndexStats after = h_->IndexStats();
    EXPECT_EQ(after.l2_objects, before.l2_objects);
    EXPECT_EQ(after.l2_inflight_objects, before.l2_inflight_objects);
    EXPECT_EQ(after.pinned_pages, before.pinned_pages);
    EXPECT_EQ(h_->PoolSlotsUsed(), slots);
    EXPECT_EQ(h_->cache().GetCounts().sessions, sessions);
  }

  v1::LoadRequest GoodLoad() const {
    v1::LoadRequest req;
    req.set_session_id(a_->session);
    v1::LoadSequence* seq = req.add_sequences();
    seq->set_page_keys(KeyBlob(keys_, 0, 2));
    seq->add_device_blocks(5);
    seq->add_device_blocks(6);
    return req;
  }
  v1::BackupRequest GoodBackup() const {
    v1::BackupRequest req;
    req.set_session_id(a_->session);
    v1::BackupSequence* seq = req.add_sequences();
    seq->set_parent_key(std::string(keys_[1].AsBytes()));
    seq->set_page_keys(KeyBlob(keys_, 2, 4));
    seq->add_device_blocks(7);
    seq->add_device_blocks(8);
    return req;
  }
  Rpc DoLoad(const v1::LoadRequest& req) {
    v1::LoadResponse resp;
    return h_->Load(req, &resp);
  }
  Rpc DoBackup(const v1::BackupRequest& req) {
    v1::BackupResponse resp;
    return h_->Backup(req, &resp);
  }
  Rpc DoRegister(const v1::RegisterEngineRequest& req) {
    v1::RegisterEngineResponse resp;
    return h_->RegisterEngine(req, &resp);
  }

  std::unique_ptr<CacheHarness> h_;
  std::unique_ptr<TestEngine> a_;
  uint64_t scheduler_ = 0;
  std::vector<core::PageKey> keys_;
};

constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
constexpr auto kPrecondition = grpc::StatusCode::FAILED_PRECONDITION;

TEST_F(CacheValidationTest, GoodRequestsPass) {
  v1::LoadResponse l;
  ASSERT_TRUE(h_->Load(GoodLoad(), &l).ok());
  EXPECT_EQ(h_->Wait(a_->session, l.op().op_id()).state(), v1::OP_STATE_DONE);
  v1::BackupResponse b;
  ASSERT_TRUE(h_->Backup(GoodBackup(), &b).ok());
  EXPECT_EQ(h_->Wait(a_->session, b.op().op_id()).sequences(0).leading_ok_pages(), 2u);
}

TEST_F(CacheValidationTest, LoadRejections) {
  v1::LoadRequest r = GoodLoad();
  r.mutable_sequences(0)->mutable_page_keys()->push_back('x');
  Rejected(
      "key blob", [&] { return DoLoad(r); },
      {kInvalid, "ERROR_REASON_INVALID_FIELD", "sequences[0].page_keys", "not a multiple of 32"});

  r = GoodLoad();
  r.mutable_sequences(0)->add_device_blocks(9);
  Rejected("count mismatch", [&] { return DoLoad(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "sequences[0].device_blocks",
            "3 blocks for 2 page keys"});

  r = GoodLoad();
  v1::LoadSequence* second = r.add_sequences();
  second->set_page_keys(KeyBlob(keys_, 2, 4));
  second->add_device_blocks(7);
  second->add_device_blocks(9000);
  Rejected("out of range", [&] { return DoLoad(r); },
           {kInvalid, "ERROR_REASON_BLOCK_OUT_OF_RANGE", "sequences[1].device_blocks[1]",
            "sequences[1].device_blocks[1] (9000) out of range [0, 16)"});

  second->set_device_blocks(1, 5);  // Repeats sequences[0].device_blocks[0].
  Rejected("duplicate block", [&] { return DoLoad(r); },
           {kInvalid, "ERROR_REASON_BLOCK_OUT_OF_RANGE", "sequences[1].device_blocks[1]",
            "repeats sequences[0].device_blocks[0]"});

  r = GoodLoad();
  std::vector<core::PageKey> many = CacheHarness::Keys(Spec(), Tokens(9, 65));
  v1::LoadSequence* big = r.mutable_sequences(0);
  big->set_page_keys(KeyBlob(many));
  big->clear_device_blocks();
  for (uint32_t i = 0; i < 65; ++i) big->add_device_blocks(i % 16);
  Rejected("batch over max_batch_pages", [&] { return DoLoad(r); },
           {kInvalid, "ERROR_REASON_LIMIT_EXCEEDED", "sequences", "max_batch_pages (64)"});

  r = GoodLoad();
  r.set_session_id(12345);
  Rejected("unknown session", [&] { return DoLoad(r); },
           {kPrecondition, "ERROR_REASON_SESSION_UNKNOWN", "session_id"});

  r = GoodLoad();
  r.set_session_id(scheduler_);
  Rejected("scheduler", [&] { return DoLoad(r); },
           {kPrecondition, "ERROR_REASON_WRONG_ROLE", "session_id",
            absl::StrCat("session_id ", scheduler_, " is a SCHEDULER")});

  r = GoodLoad();
  r.set_signal_layers(true);
  r.set_completion_slot(TestEngine::kLoadSlots);
  Rejected("slot", [&] { return DoLoad(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "completion_slot", "out of range [0, 4)"});
}

TEST_F(CacheValidationTest, BackupRejections) {
  v1::BackupRequest r = GoodBackup();
  r.mutable_sequences(0)->mutable_parent_key()->pop_back();
  Rejected("parent key", [&] { return DoBackup(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "sequences[0].parent_key"});

  r = GoodBackup();
  r.mutable_ready()->set_slot(TestEngine::kReadySlots);
  r.mutable_ready()->set_sim_token(1);
  Rejected("ready slot", [&] { return DoBackup(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "ready.slot"});

  r = GoodBackup();
  r.mutable_ready()->set_slot(0);
  Rejected("sim token 0", [&] { return DoBackup(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "ready.sim_token"});

  r = GoodBackup();
  r.set_write_policy(static_cast<v1::WritePolicy>(99));
  Rejected("write policy", [&] { return DoBackup(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "write_policy"});

  r = GoodBackup();
  r.mutable_sequences(0)->set_device_blocks(0, 16);
  Rejected("out of range", [&] { return DoBackup(r); },
           {kInvalid, "ERROR_REASON_BLOCK_OUT_OF_RANGE", "sequences[0].device_blocks[0]"});

  r = GoodBackup();
  r.set_session_id(scheduler_);
  Rejected("scheduler", [&] { return DoBackup(r); },
           {kPrecondition, "ERROR_REASON_WRONG_ROLE", "session_id",
            absl::StrCat("session_id ", scheduler_, " is a SCHEDULER")});
}

TEST_F(CacheValidationTest, MatchRejections) {
  v1::MatchRequest r;
  r.set_session_id(a_->session);
  v1::MatchSequence* seq = r.add_sequences();
  const std::vector<uint32_t> tokens = Tokens(1, 2);
  seq->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  seq->set_page_keys(KeyBlob(keys_, 0, 1));
  v1::MatchResponse resp;
  Rejected("keys and tokens", [&] { return h_->Match(r, &resp); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "sequences[0]"});
  seq->clear_token_ids();
  seq->mutable_page_keys()->pop_back();
  Rejected("key blob", [&] { return h_->Match(r, &resp); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "sequences[0].page_keys"});
  seq->set_page_keys(KeyBlob(keys_, 0, 1));
  r.set_prefetch_policy(static_cast<v1::PrefetchPolicy>(42));
  Rejected("prefetch policy", [&] { return h_->Match(r, &resp); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "prefetch_policy"});
  r.set_prefetch_policy(v1::PREFETCH_POLICY_UNSPECIFIED);
  r.set_pin(true);
  r.set_session_id(777);
  Rejected("unknown session", [&] { return h_->Match(r, &resp); },
           {kPrecondition, "ERROR_REASON_SESSION_UNKNOWN", "session_id"});

  // Tokens in an opaque namespace.
  TestEngine o(16, false, 3);
  h_->Register(o, "inst-o", 0, Spec(1, false, /*opaque=*/true));
  v1::MatchRequest t;
  t.set_session_id(o.session);
  t.add_sequences()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  Rejected("tokens in opaque namespace", [&] { return h_->Match(t, &resp); },
           {kInvalid, "ERROR_REASON_TOKENS_IN_OPAQUE_NAMESPACE", "sequences[0].token_ids"});
}

TEST_F(CacheValidationTest, RegisterRejections) {
  TestEngine b(16, false, 2);
  v1::RegisterEngineRequest r = b.Register("inst-b", 2, Spec(/*tp=*/2));
  Rejected("rank", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "rank", "rank (2) out of range"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  Rejected("device kind", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_DEVICE_UNAVAILABLE", "device.kind"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_device()->set_uuid("short");
  Rejected("uuid", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "device.uuid"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_namespace_spec()->clear_model_id();
  Rejected("model id", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "namespace_spec.model_id"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_namespace_spec()->set_layout_kind(v1::LAYOUT_KIND_UNSPECIFIED);
  Rejected("layout kind", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "namespace_spec.layout_kind"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_layout()->mutable_layers(1)->clear_v();
  Rejected("MHA layer without V", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "layout.layers[1].v"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_layout()->mutable_layers(0)->mutable_k()->set_bytes_per_block(kBytesPerBlock + 1);
  Rejected("buffer overlaps its next block", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "layout.layers[0].k.bytes_per_block"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_layout()->set_tokens_per_block(kPageSize * 2);
  Rejected("tokens per block", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "layout.tokens_per_block"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_layout()->mutable_layers(0)->mutable_k()->set_bytes_per_block(kBytesPerBlock / 2);
  Rejected("geometry differs from the namespace's", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_GROUP_MISMATCH", "layout.layers[0].k.bytes_per_block"});

  r = b.Register("inst-a", 0, Spec(1, false, false, "other-model"));
  Rejected("instance namespace", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_GROUP_MISMATCH", "namespace_spec"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_completion()->set_num_load_slots(TestEngine::kLoadSlots - 1);
  Rejected("counters header", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_HANDLE_OPEN_FAILED", "completion.num_load_slots"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_completion()->mutable_sim_counters()->set_shm_name("/kvc-no-such-object");
  Rejected("counters object", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_HANDLE_OPEN_FAILED", "completion.sim_counters.shm_name"});

  r = b.Register("inst-b", 0, Spec());
  r.mutable_layout()->mutable_regions(0)->set_sim_shm_name("/kvc-no-such-region");
  Rejected("region object", [&] { return DoRegister(r); },
           {kPrecondition, "ERROR_REASON_HANDLE_OPEN_FAILED", "layout.regions[0]"});

  r = b.Register("", 0, Spec());
  Rejected("instance id", [&] { return DoRegister(r); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "instance_id"});

  // And the same engine registers fine once the request is right.
  EXPECT_TRUE(DoRegister(b.Register("inst-b", 0, Spec())).ok());
}

TEST_F(CacheValidationTest, WaitOpsAndReleaseRejections) {
  v1::WaitOpsRequest w;
  w.set_session_id(a_->session);
  v1::WaitOpsResponse wr;
  Rejected("no ids", [&] { return h_->WaitOps(w, &wr); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "op_ids"});
  w.add_op_ids(1);
  w.set_mode(static_cast<v1::WaitMode>(7));
  Rejected("mode", [&] { return h_->WaitOps(w, &wr); },
           {kInvalid, "ERROR_REASON_INVALID_FIELD", "mode"});
  v1::ReleaseRequest rel;
  rel.set_session_id(999);
  v1::ReleaseResponse rr;
  Rejected("unknown session", [&] { return h_->Release(rel, &rr); },
           {kPrecondition, "ERROR_REASON_SESSION_UNKNOWN", "session_id"});
  // Heartbeat of an unknown session is an answer, not an error.
  v1::HeartbeatRequest hb;
  hb.set_session_id(999);
  v1::HeartbeatResponse hr;
  ASSERT_TRUE(h_->Heartbeat(hb, &hr).ok());
  EXPECT_EQ(hr.state(), v1::SESSION_STATE_UNKNOWN);
}

// Audit: a tp_size the index cannot hold (its shard mask has core::kMaxShardsPerPage bits) is
// the caller's INVALID_ARGUMENT naming the field, for a WORKER and a SCHEDULER alike; before,
// a WORKER failed inside the radix index and a SCHEDULER was accepted.
TEST_F(CacheValidationTest, TpSizeBeyondTheShardMaskIsRejectedForEveryRole) {
  TestEngine b(16, false, 2);
  for (uint32_t tp : {65u, 1000u, 1024u}) {
    v1::RegisterEngineRequest r = b.Register("inst-b", 0, Spec(tp));
    Rejected(absl::StrCat("worker tp ", tp), [&] { return DoRegister(r); },
             {kInvalid, "ERROR_REASON_INVALID_FIELD", "namespace_spec.tp_size",
              absl::StrCat("namespace_spec.tp_size (", tp, ")")});
    r.set_role(v1::SESSION_ROLE_SCHEDULER);
    Rejected(absl::StrCat("scheduler tp ", tp), [&] { return DoRegister(r); },
             {kInvalid, "ERROR_REASON_INVALID_FIELD", "namespace_spec.tp_size"});
  }
  // 64 ranks fit the mask; an MLA page has one shard whatever the TP size.
  v1::RegisterEngineRequest r = b.Register("inst-c", 0, Spec(64));
  r.set_role(v1::SESSION_ROLE_SCHEDULER);
  EXPECT_TRUE(DoRegister(r).ok());
  r = b.Register("inst-d", 0, Spec(1000, /*mla=*/true));
  r.set_role(v1::SESSION_ROLE_SCHEDULER);
  EXPECT_TRUE(DoRegister(r).ok());
}

// Audit: a shm name ShmMapping cannot open by its form is INVALID_ARGUMENT naming the field, not
// a failed open (FAILED_PRECONDITION, HANDLE_OPEN_FAILED).
TEST_F(CacheValidationTest, MalformedShmNamesAreInvalidArguments) {
  TestEngine b(16, false, 2);
  const std::string bad[] = {"kvc-no-leading-slash", std::string("/kvc\0nul", 8), "/a/b",
                             "/proc/1/fd/x", "/proc/self/fd/3", std::string(300, 'x')};
  for (const std::string& name : bad) {
    v1::RegisterEngineRequest r = b.Register("inst-b", 0, Spec());
    r.mutable_layout()->mutable_regions(0)->set_sim_shm_name(name);
    Rejected("region", [&] { return DoRegister(r); },
             {kInvalid, "ERROR_REASON_INVALID_FIELD", "layout.regions[0].sim_shm_name",
              "layout.regions[0].sim_shm_name \""});
    r = b.Register("inst-b", 0, Spec());
    r.mutable_completion()->mutable_sim_counters()->set_shm_name(name);
    Rejected("counters", [&] { return DoRegister(r); },
             {kInvalid, "ERROR_REASON_INVALID_FIELD", "completion.sim_counters.shm_name"});
  }
  EXPECT_TRUE(DoRegister(b.Register("inst-b", 0, Spec())).ok());
}

// Audit: a long bad value is quoted by a bounded prefix. Echoed whole, an 8000-byte kv_dtype
// made the status message exceed gRPC's metadata limit: RESOURCE_EXHAUSTED for this call, and
// failures for other calls on the connection. A valid call runs alongside on the same channel.
TEST_F(CacheValidationTest, LongBadValuesAreQuotedByABoundedPrefix) {
  std::atomic<bool> stop{false};
  std::atomic<int> good_calls{0};
  std::atomic<int> failed_calls{0};
  std::thread valid([&] {
    while (!stop.load()) {
      v1::MatchRequest m;
      m.set_session_id(scheduler_);
      m.add_sequences()->set_page_keys(KeyBlob(keys_, 0, 2));
      v1::MatchResponse resp;
      (h_->Match(m, &resp).ok() ? good_calls : failed_calls).fetch_add(1);
    }
  });
  TestEngine b(16, false, 2);
  for (size_t bytes : {size_t{8000}, size_t{100000}}) {
    v1::RegisterEngineRequest r = b.Register("inst-b", 0, Spec());
    r.mutable_namespace_spec()->set_kv_dtype(std::string(bytes, 'q'));
    v1::RegisterEngineResponse resp;
    Rpc rpc = h_->RegisterEngine(r, &resp);
    EXPECT_EQ(rpc.status.error_code(), kInvalid) << rpc.status.error_message().substr(0, 200);
    EXPECT_EQ(rpc.field, "namespace_spec.kv_dtype");
    EXPECT_THAT(rpc.status.error_message(), HasSubstr(absl::StrCat("... (", bytes, " bytes)")));
    EXPECT_LT(rpc.status.error_message().size(), 512u);
    // The same through the scheduler path and the instance id quoting.
    r.set_role(v1::SESSION_ROLE_SCHEDULER);
    rpc = h_->RegisterEngine(r, &resp);
    EXPECT_EQ(rpc.status.error_code(), kInvalid);
    EXPECT_LT(rpc.status.error_message().size(), 512u);
  }
  while (good_calls.load() < 3) absl::SleepFor(absl::Milliseconds(1));
  stop = true;
  valid.join();
  EXPECT_EQ(failed_calls.load(), 0);
}

}  // namespace
}  // namespace kvcellar::server::testing
