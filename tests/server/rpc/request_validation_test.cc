// Tests server/rpc/request_validation.h directly: each check's gRPC code, ErrorReason and the
// request field it names, and what an accepted registration turns into. The same checks seen
// through the RPCs are cache_validation_test.cc.
#include "server/rpc/request_validation.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

::testing::AssertionResult InvalidAt(const absl::Status& s, absl::string_view field) {
  return IsCacheError(s, kInvalid, v1::ERROR_REASON_INVALID_FIELD, field);
}

CacheLimits Limits() {
  CacheLimits l = CacheLimits::FromConfig(DefaultConfig());
  l.max_batch_pages = 8;
  l.max_batch_sequences = 3;
  return l;
}

// A valid SIM worker registration of rank 1 of a TP-2 group, with 2 load and 1 ready slots.
v1::RegisterEngineRequest SimWorker() {
  v1::RegisterEngineRequest r;
  r.set_instance_id("inst");
  r.set_rank(1);
  r.set_role(v1::SESSION_ROLE_WORKER);
  *r.mutable_namespace_spec() = Spec(2);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_SIM);
  r.mutable_device()->set_uuid(std::string(16, '\x07'));
  SimLayoutProto(TestLayout(), r.mutable_layout());
  r.mutable_completion()->set_num_load_slots(2);
  r.mutable_completion()->set_num_ready_slots(1);
  r.mutable_completion()->mutable_sim_counters()->set_shm_name("/kvc-test-signals");
  r.mutable_completion()->mutable_sim_counters()->set_size_bytes(4096);
  return r;
}

absl::Status Register(const v1::RegisterEngineRequest& r,
                      std::vector<v1::DeviceKind> served = {v1::DEVICE_KIND_SIM}) {
  return ParseRegistration(r, Limits(), served).status();
}

TEST(RequestValidationTest, AcceptedRegistrationCarriesItsEngineSpec) {
  absl::StatusOr<Registration> reg =
      ParseRegistration(SimWorker(), Limits(), {v1::DEVICE_KIND_SIM});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(reg->worker);
  EXPECT_EQ(reg->spec.Digest(), NsSpec(2).Digest());
  EXPECT_EQ(reg->device_kind, v1::DEVICE_KIND_SIM);
  EXPECT_EQ(reg->engine.layout.layers.size(), kLayers);
  EXPECT_EQ(reg->engine.layout.PageObjectBytes(), kObjectBytes);
  EXPECT_EQ(reg->engine.layout.regions[0].handle, "/kvc-test-layout");
  EXPECT_EQ(reg->engine.device_uuid,
            gpu::FormatGpuUuid(reinterpret_cast<const uint8_t*>(std::string(16, '\x07').data())));
  EXPECT_EQ(reg->num_load_slots, 2u);
  EXPECT_EQ(reg->num_ready_slots, 1u);
  EXPECT_EQ(reg->sim_counters_name, "/kvc-test-signals");
  EXPECT_EQ(reg->sim_counters_bytes, 4096u);
  EXPECT_TRUE(reg->engine.completion_region.empty()) << "the daemon drives the signals itself";
}

TEST(RequestValidationTest, SchedulerNeedsNoDeviceOrLayout) {
  v1::RegisterEngineRequest r;
  r.set_instance_id("inst");
  r.set_role(v1::SESSION_ROLE_SCHEDULER);
  *r.mutable_namespace_spec() = Spec(4);
  r.set_rank(9);  // Ignored for a scheduler.
  absl::StatusOr<Registration> reg = ParseRegistration(r, Limits(), {});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_FALSE(reg->worker);
}

TEST(RequestValidationTest, RegistrationErrorsNameTheField) {
  v1::RegisterEngineRequest r = SimWorker();
  r.set_instance_id("");
  EXPECT_TRUE(InvalidAt(Register(r), "instance_id"));
  r = SimWorker();
  r.set_engine_name(std::string(kMaxIdBytes + 1, 'e'));
  EXPECT_TRUE(InvalidAt(Register(r), "engine_name"));
  r = SimWorker();
  r.clear_namespace_spec();
  EXPECT_TRUE(InvalidAt(Register(r), "namespace_spec"));
  r = SimWorker();
  r.set_rank(2);
  EXPECT_TRUE(InvalidAt(Register(r), "rank"));
  r = SimWorker();
  r.clear_device();
  EXPECT_TRUE(InvalidAt(Register(r), "device"));
  r = SimWorker();
  r.mutable_device()->set_kind(v1::DEVICE_KIND_UNSPECIFIED);
  EXPECT_TRUE(InvalidAt(Register(r), "device.kind"));
  r = SimWorker();
  r.mutable_device()->set_uuid("short");
  EXPECT_TRUE(InvalidAt(Register(r), "device.uuid"));
  r = SimWorker();
  r.clear_layout();
  EXPECT_TRUE(InvalidAt(Register(r), "layout"));
}

TEST(RequestValidationTest, UnservedDeviceKindIsDeviceUnavailable) {
  absl::Status s = Register(SimWorker(), {v1::DEVICE_KIND_CUDA});
  EXPECT_TRUE(IsCacheError(s, absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_DEVICE_UNAVAILABLE, "device.kind"));
  EXPECT_THAT(s.message(), HasSubstr("DEVICE_KIND_SIM is not served"));
  EXPECT_EQ(ErrorReasonOf(Register(SimWorker(), {})), v1::ERROR_REASON_DEVICE_UNAVAILABLE);
}

TEST(RequestValidationTest, NamespaceSpecFieldsAreNamedAsInTheRequest) {
  v1::NamespaceSpec spec = Spec();
  spec.set_layout_kind(v1::LAYOUT_KIND_UNSPECIFIED);
  EXPECT_TRUE(InvalidAt(ParseNamespaceSpec(spec).status(), "namespace_spec.layout_kind"));
  spec = Spec();
  spec.set_page_size_tokens(0);
  EXPECT_TRUE(InvalidAt(ParseNamespaceSpec(spec).status(), "namespace_spec.page_size_tokens"));
  spec = Spec();
  spec.set_model_id("");
  EXPECT_TRUE(InvalidAt(ParseNamespaceSpec(spec).status(), "namespace_spec.model_id"));
  // An MHA page has a shard per rank, at most kMaxShardsPerPage; MLA has one whatever the TP.
  spec = Spec(core::kMaxShardsPerPage + 1);
  EXPECT_TRUE(InvalidAt(ParseNamespaceSpec(spec).status(), "namespace_spec.tp_size"));
  spec.set_layout_kind(v1::LAYOUT_KIND_MLA);
  absl::StatusOr<core::NamespaceSpec> mla = ParseNamespaceSpec(spec);
  ASSERT_TRUE(mla.ok()) << mla.status();
  EXPECT_EQ(mla->ShardsPerPage(), 1u);
  EXPECT_EQ(ParseNamespaceSpec(Spec(2))->Digest(), NsSpec(2).Digest()) << "every field carried";
}

TEST(RequestValidationTest, LayoutErrorsNameTheRequestField) {
  v1::RegisterEngineRequest r = SimWorker();
  r.mutable_layout()->mutable_regions(0)->set_sim_shm_name("no-slash");
  EXPECT_TRUE(InvalidAt(Register(r), "layout.regions[0].sim_shm_name"));
  r = SimWorker();
  r.mutable_layout()->mutable_regions(0)->set_cuda_ipc_handle(std::string(64, 'h'));
  EXPECT_TRUE(InvalidAt(Register(r), "layout.regions[0].sim_shm_name")) << "SIM needs a name";
  r = SimWorker();
  r.mutable_layout()->mutable_layers(1)->clear_v();
  EXPECT_TRUE(InvalidAt(Register(r), "layout.layers[1].v")) << "MHA needs V";
  r = SimWorker();
  r.mutable_layout()->set_num_blocks(0);
  EXPECT_TRUE(InvalidAt(Register(r), "layout.num_blocks"));
  r = SimWorker();
  r.mutable_layout()->set_tokens_per_block(kPageSize + 1);
  EXPECT_TRUE(InvalidAt(Register(r), "layout.tokens_per_block"));
  r = SimWorker();
  r.mutable_layout()->mutable_regions(0)->set_size_bytes(0);
  EXPECT_TRUE(InvalidAt(Register(r), "layout.regions[0].size_bytes"));
  // gpu's own checks (KvLayout::Validate), named in the request's terms.
  r = SimWorker();
  r.mutable_layout()->mutable_layers(0)->mutable_k()->set_block_stride_bytes(kBytesPerBlock - 1);
  EXPECT_TRUE(InvalidAt(Register(r), "layout.layers[0].k.bytes_per_block"));
  r = SimWorker();
  r.mutable_layout()->clear_layers();
  EXPECT_TRUE(InvalidAt(Register(r), "layout.layers"));

  v1::RegisterEngineRequest mla = SimWorker();
  mla.mutable_namespace_spec()->set_layout_kind(v1::LAYOUT_KIND_MLA);
  EXPECT_TRUE(InvalidAt(Register(mla), "layout.layers[0].v")) << "MLA has one buffer";
}

TEST(RequestValidationTest, CompletionChannelChecks) {
  v1::RegisterEngineRequest r = SimWorker();
  r.mutable_completion()->set_num_load_slots(Limits().max_completion_slots + 1);
  EXPECT_TRUE(IsCacheError(Register(r), kInvalid, v1::ERROR_REASON_LIMIT_EXCEEDED,
                           "completion.num_load_slots"));
  r = SimWorker();
  r.mutable_completion()->clear_sim_counters();
  EXPECT_TRUE(InvalidAt(Register(r), "completion.sim_counters")) << "slots need counters";
  r = SimWorker();
  r.mutable_completion()->mutable_cuda_events();
  EXPECT_TRUE(InvalidAt(Register(r), "completion.cuda_events"));
  r = SimWorker();
  r.mutable_completion()->mutable_sim_counters()->set_shm_name("");
  EXPECT_TRUE(InvalidAt(Register(r), "completion.sim_counters.shm_name"));
  r = SimWorker();
  r.clear_completion();
  EXPECT_TRUE(Register(r).ok()) << "no completion channel: no slots";
}

TEST(RequestValidationTest, SchedulersMayNotLoadOrBackUp) {
  L2World world;
  SessionInfo scheduler = WorkerInfo(world.namespaces().GetOrCreate(NsSpec()));
  scheduler.role = v1::SESSION_ROLE_SCHEDULER;
  EXPECT_TRUE(IsCacheError(CheckWorker(scheduler, "Load"), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_WRONG_ROLE, "session_id"));
  EXPECT_TRUE(IsCacheError(ValidateBackup(v1::BackupRequest(), scheduler, Limits()),
                           absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_WRONG_ROLE,
                           "session_id"));
  EXPECT_TRUE(CheckWorker(WorkerInfo(scheduler.ns), "Load").ok());
}

TEST(RequestValidationTest, MatchChecks) {
  const core::NamespaceSpec spec = NsSpec();
  const std::vector<core::PageKey> keys = PromptKeys(spec, 1, 8);
  v1::MatchRequest ok;
  ok.add_sequences()->set_page_keys(KeyBlob(keys, 0, 4));
  v1::MatchSequence* tokens = ok.add_sequences();
  const std::vector<uint32_t> t = Tokens(2, 6);
  tokens->mutable_token_ids()->Add(t.begin(), t.end());
  tokens->set_num_computed_pages(2);  // 4 + (6 - 2) = 8 pages: at the limit.
  EXPECT_TRUE(ValidateMatch(ok, spec, Limits()).ok());

  v1::MatchRequest over = ok;
  over.mutable_sequences(1)->set_num_computed_pages(1);
  EXPECT_TRUE(IsCacheError(ValidateMatch(over, spec, Limits()), kInvalid,
                           v1::ERROR_REASON_LIMIT_EXCEEDED, "sequences"));
  v1::MatchRequest many;
  for (int i = 0; i < 4; ++i) many.add_sequences();
  EXPECT_TRUE(IsCacheError(ValidateMatch(many, spec, Limits()), kInvalid,
                           v1::ERROR_REASON_LIMIT_EXCEEDED, "sequences"));
  v1::MatchRequest both = ok;
  both.mutable_sequences(1)->set_page_keys(KeyBlob(keys, 0, 1));
  EXPECT_TRUE(InvalidAt(ValidateMatch(both, spec, Limits()), "sequences[1]"));
  v1::MatchRequest ragged = ok;
  ragged.mutable_sequences(0)->mutable_page_keys()->push_back('x');
  EXPECT_TRUE(InvalidAt(ValidateMatch(ragged, spec, Limits()), "sequences[0].page_keys"));
  v1::MatchRequest policy = ok;
  policy.set_prefetch_policy(static_cast<v1::PrefetchPolicy>(99));
  EXPECT_TRUE(InvalidAt(ValidateMatch(policy, spec, Limits()), "prefetch_policy"));

  core::NamespaceSpec opaque = spec;
  opaque.opaque_keys = true;
  EXPECT_TRUE(IsCacheError(ValidateMatch(ok, opaque, Limits()), kInvalid,
                           v1::ERROR_REASON_TOKENS_IN_OPAQUE_NAMESPACE, "sequences[1].token_ids"));
}

class DataOpValidationTest : public ::testing::Test {
 protected:
  DataOpValidationTest() : session_(WorkerInfo(world_.namespaces().GetOrCreate(NsSpec()))) {
    session_.num_blocks = 16;
    session_.num_load_slots = 2;
    session_.num_ready_slots = 1;
  }

  // Sequence i: keys of prompt i, one block each from `blocks`.
  template <typename Request>
  void AddSequence(Request* r, std::vector<uint32_t> blocks) {
    auto* seq = r->add_sequences();
    seq->set_page_keys(KeyBlob(PromptKeys(NsSpec(), r->sequences_size(), blocks.size())));
    for (uint32_t b : blocks) seq->add_device_blocks(b);
  }

  L2World world_;
  SessionInfo session_;
};

TEST_F(DataOpValidationTest, BlocksMustBeInRangeDistinctAndOnePerKey) {
  v1::LoadRequest load;
  AddSequence(&load, {0, 1, 2});
  AddSequence(&load, {3, 4});
  EXPECT_TRUE(ValidateLoad(load, session_, Limits()).ok());

  v1::LoadRequest out = load;
  out.mutable_sequences(1)->set_device_blocks(1, 16);
  absl::Status s = ValidateLoad(out, session_, Limits());
  EXPECT_TRUE(IsCacheError(s, kInvalid, v1::ERROR_REASON_BLOCK_OUT_OF_RANGE,
                           "sequences[1].device_blocks[1]"));
  EXPECT_THAT(s.message(), HasSubstr("(16) out of range [0, 16)"));

  v1::LoadRequest repeated = load;
  repeated.mutable_sequences(1)->set_device_blocks(0, 1);
  s = ValidateLoad(repeated, session_, Limits());
  EXPECT_TRUE(IsCacheError(s, kInvalid, v1::ERROR_REASON_BLOCK_OUT_OF_RANGE,
                           "sequences[1].device_blocks[0]"));
  EXPECT_THAT(s.message(), HasSubstr("repeats sequences[0].device_blocks[1]"));

  v1::LoadRequest count = load;
  count.mutable_sequences(0)->add_device_blocks(9);
  EXPECT_TRUE(InvalidAt(ValidateLoad(count, session_, Limits()), "sequences[0].device_blocks"));

  v1::LoadRequest id = load;
  id.mutable_sequences(1)->set_request_id(std::string(kMaxIdBytes + 1, 'r'));
  EXPECT_TRUE(InvalidAt(ValidateLoad(id, session_, Limits()), "sequences[1].request_id"));

  v1::LoadRequest big;
  AddSequence(&big, {0, 1, 2, 3, 4, 5, 6, 7, 8});  // 9 pages; the limit is 8.
  EXPECT_TRUE(IsCacheError(ValidateLoad(big, session_, Limits()), kInvalid,
                           v1::ERROR_REASON_LIMIT_EXCEEDED, "sequences"));
}

TEST_F(DataOpValidationTest, LoadSignalsNeedARegisteredSlot) {
  v1::LoadRequest load;
  AddSequence(&load, {0});
  load.set_signal_layers(true);
  load.set_completion_slot(1);
  EXPECT_TRUE(ValidateLoad(load, session_, Limits()).ok());
  load.set_completion_slot(2);
  EXPECT_TRUE(InvalidAt(ValidateLoad(load, session_, Limits()), "completion_slot"));
  session_.num_load_slots = 0;
  EXPECT_TRUE(InvalidAt(ValidateLoad(load, session_, Limits()), "signal_layers"));
}

TEST_F(DataOpValidationTest, BackupChecksParentsReadySignalAndPolicy) {
  v1::BackupRequest backup;
  AddSequence(&backup, {0, 1});
  backup.mutable_ready()->set_slot(0);
  backup.mutable_ready()->set_sim_token(5);
  EXPECT_TRUE(ValidateBackup(backup, session_, Limits()).ok());

  v1::BackupRequest parent = backup;
  parent.mutable_sequences(0)->set_parent_key("short");
  EXPECT_TRUE(InvalidAt(ValidateBackup(parent, session_, Limits()), "sequences[0].parent_key"));
  v1::BackupRequest slot = backup;
  slot.mutable_ready()->set_slot(1);
  EXPECT_TRUE(InvalidAt(ValidateBackup(slot, session_, Limits()), "ready.slot"));
  v1::BackupRequest token = backup;
  token.mutable_ready()->set_sim_token(0);
  EXPECT_TRUE(InvalidAt(ValidateBackup(token, session_, Limits()), "ready.sim_token"));
  SessionInfo cuda = session_;
  cuda.device_kind = v1::DEVICE_KIND_CUDA;
  EXPECT_TRUE(InvalidAt(ValidateBackup(backup, cuda, Limits()), "ready.sim_token"));
  v1::BackupRequest policy = backup;
  policy.set_write_policy(static_cast<v1::WritePolicy>(42));
  EXPECT_TRUE(InvalidAt(ValidateBackup(policy, session_, Limits()), "write_policy"));
}

// A hybrid model's registration (API revision 4): groups in the namespace, a group per layer.
TEST(RequestValidationTest, HybridGroupsAreParsedAndChecked) {
  v1::RegisterEngineRequest r = SimWorker();
  v1::NamespaceSpec* spec = r.mutable_namespace_spec();
  spec->add_groups()->set_kind(v1::KV_GROUP_KIND_FULL_ATTENTION);
  v1::KvGroup* window = spec->add_groups();
  window->set_kind(v1::KV_GROUP_KIND_SLIDING_WINDOW);
  window->set_sliding_window_tokens(64);
  r.mutable_layout()->mutable_layers(1)->set_group(1);
  absl::StatusOr<Registration> reg = ParseRegistration(r, Limits(), {v1::DEVICE_KIND_SIM});
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_TRUE(reg->spec.Hybrid());
  EXPECT_EQ(reg->spec.groups[1].kind, core::GroupKind::kWindow);
  EXPECT_EQ(reg->spec.groups[1].window_tokens, 64u);
  EXPECT_EQ(reg->engine.layout.layers[1].group, 1u);
  EXPECT_NE(reg->spec.Digest(), NsSpec(2).Digest()) << "groups are part of the namespace";
  SessionInfo info;
  FillSessionGeometry(r, *reg, &info);
  EXPECT_EQ(info.group_kinds.size(), 2u);

  v1::RegisterEngineRequest bad = r;
  bad.mutable_namespace_spec()->mutable_groups(1)->set_sliding_window_tokens(0);
  EXPECT_TRUE(InvalidAt(Register(bad), "namespace_spec.groups[1].sliding_window_tokens"));
  bad = r;
  bad.mutable_namespace_spec()->mutable_groups(0)->set_kind(v1::KV_GROUP_KIND_UNSPECIFIED);
  EXPECT_TRUE(InvalidAt(Register(bad), "namespace_spec.groups[0].kind"));
  bad = r;  // Windows only: nothing stores every page, so nothing keeps the index prefix-closed.
  bad.mutable_namespace_spec()->mutable_groups(0)->set_kind(v1::KV_GROUP_KIND_SLIDING_WINDOW);
  bad.mutable_namespace_spec()->mutable_groups(0)->set_sliding_window_tokens(64);
  EXPECT_TRUE(InvalidAt(Register(bad), "namespace_spec.groups"));
  bad = r;
  bad.mutable_layout()->mutable_layers(0)->set_group(2);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.layers[0].group"));
  bad = r;
  bad.mutable_layout()->mutable_layers(1)->set_group(0);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.layers")) << "group 1 has no layer";
  bad = SimWorker();
  bad.mutable_layout()->mutable_layers(1)->set_group(1);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.layers[1].group")) << "no groups declared";
  bad = r;  // CUDA engines: not in this revision, said before anything is opened.
  bad.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  EXPECT_TRUE(IsCacheError(Register(bad, {v1::DEVICE_KIND_CUDA, v1::DEVICE_KIND_SIM}),
                           absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_DEVICE_UNAVAILABLE, "namespace_spec.groups"));
}

// API revision 5: a hybrid layout whose groups have block pools of their own (SGLang).
TEST(RequestValidationTest, GroupsWithPoolsOfTheirOwnAreParsedAndChecked) {
  v1::RegisterEngineRequest r = SimWorker();
  v1::NamespaceSpec* spec = r.mutable_namespace_spec();
  spec->add_groups()->set_kind(v1::KV_GROUP_KIND_FULL_ATTENTION);
  spec->add_groups()->set_kind(v1::KV_GROUP_KIND_RECURRENT_STATE);
  r.mutable_layout()->mutable_layers(1)->set_group(1);
  const uint32_t n = r.layout().num_blocks();
  r.mutable_layout()->add_group_num_blocks(n);
  r.mutable_layout()->add_group_num_blocks(n / 2);
  absl::StatusOr<Registration> reg = ParseRegistration(r, Limits(), {v1::DEVICE_KIND_SIM});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->engine.layout.GroupBlocks(1), n / 2);
  SessionInfo info;
  FillSessionGeometry(r, *reg, &info);
  EXPECT_EQ(info.GroupBlocks(0), n);
  EXPECT_EQ(info.GroupBlocks(1), n / 2);
  EXPECT_EQ(info.BusyBlock(1, 3), n + 3) << "group 1's blocks come after group 0's";

  v1::RegisterEngineRequest bad = r;
  bad.mutable_layout()->mutable_group_num_blocks()->RemoveLast();
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.group_num_blocks"));
  bad = r;
  bad.mutable_layout()->set_group_num_blocks(1, 0);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.group_num_blocks[1]"));
  bad = r;
  bad.mutable_layout()->set_group_num_blocks(0, n - 1);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.num_blocks")) << "num_blocks is not the largest";
  bad = SimWorker();  // Not hybrid: one pool by definition.
  bad.mutable_layout()->add_group_num_blocks(n);
  EXPECT_TRUE(InvalidAt(Register(bad), "layout.group_num_blocks"));
}

TEST_F(DataOpValidationTest, BackupTokensMustBeThePagesOwn) {
  // Sequence 0: prompt 1's pages 0..2 (AddSequence numbers prompts from 1); its tokens pass.
  v1::BackupRequest backup;
  AddSequence(&backup, {0, 1, 2});
  const std::vector<uint32_t> tokens = Tokens(1, 3);
  backup.mutable_sequences(0)->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  EXPECT_TRUE(ValidateBackup(backup, session_, Limits()).ok());
  // Pages 1..2 after their parent: the same tokens from page 1 on.
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 1, 3);
  v1::BackupRequest tail;
  auto* seq = tail.add_sequences();
  seq->set_parent_key(KeyBlob(keys, 0, 1));
  seq->set_page_keys(KeyBlob(keys, 1, 3));
  seq->add_device_blocks(4);
  seq->add_device_blocks(5);
  const uint32_t page = NsSpec().page_size;
  seq->mutable_token_ids()->Add(tokens.begin() + page, tokens.end());
  EXPECT_TRUE(ValidateBackup(tail, session_, Limits()).ok());

  v1::BackupRequest short_tokens = backup;
  short_tokens.mutable_sequences(0)->mutable_token_ids()->RemoveLast();
  absl::Status s = ValidateBackup(short_tokens, session_, Limits());
  EXPECT_TRUE(InvalidAt(s, "sequences[0].token_ids"));
  EXPECT_THAT(s.message(), HasSubstr("for 3 pages of"));
  // One token changed on page 2: the tokens are not that page's.
  v1::BackupRequest wrong = backup;
  wrong.mutable_sequences(0)->set_token_ids(2 * page + 3, tokens[2 * page + 3] + 1);
  s = ValidateBackup(wrong, session_, Limits());
  EXPECT_TRUE(InvalidAt(s, "sequences[0].token_ids"));
  EXPECT_THAT(s.message(), HasSubstr("page 2's tokens do not hash to page_keys[2]"));
  // Without the parent, page 1's tokens do not continue the namespace's root.
  v1::BackupRequest orphan = tail;
  orphan.mutable_sequences(0)->clear_parent_key();
  EXPECT_TRUE(InvalidAt(ValidateBackup(orphan, session_, Limits()), "sequences[0].token_ids"));
}

TEST_F(DataOpValidationTest, GroupsWithPoolsOfTheirOwnNameBlocksOfTheirOwnPool) {
  SessionInfo hybrid = session_;  // 16 blocks: group 0 has all of them, group 1 four.
  hybrid.group_kinds = {core::GroupKind::kFull, core::GroupKind::kState};
  hybrid.group_num_blocks = {16, 4};
  hybrid.group_block_base = {0, 16};
  v1::BackupRequest backup;
  auto* seq = backup.add_sequences();
  seq->set_page_keys(KeyBlob(PromptKeys(NsSpec(), 1, 2)));
  // Page 0: KV block 0, no state; page 1: KV block 1 and state slot 0, not KV block 0.
  for (uint32_t b : {0u, kNoBlock, 1u, 0u}) seq->add_group_blocks(b);
  EXPECT_TRUE(ValidateBackup(backup, hybrid, Limits()).ok());
  v1::BackupRequest shared = backup;  // With one shared pool, block 0 twice is a repeat.
  SessionInfo one_pool = hybrid;
  one_pool.group_num_blocks.clear();
  one_pool.group_block_base.clear();
  EXPECT_TRUE(IsCacheError(ValidateBackup(shared, one_pool, Limits()), kInvalid,
                           v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, "sequences[0].group_blocks[3]"));
  v1::BackupRequest out = backup;  // Slot 4 is past group 1's pool, though below num_blocks.
  out.mutable_sequences(0)->set_group_blocks(3, 4);
  EXPECT_TRUE(IsCacheError(ValidateBackup(out, hybrid, Limits()), kInvalid,
                           v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, "sequences[0].group_blocks[3]"));
  v1::BackupRequest repeated = backup;  // Slot 0 twice in group 1.
  repeated.mutable_sequences(0)->set_group_blocks(1, 0);
  EXPECT_TRUE(IsCacheError(ValidateBackup(repeated, hybrid, Limits()), kInvalid,
                           v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, "sequences[0].group_blocks[3]"));
}

TEST_F(DataOpValidationTest, HybridSequencesNameABlockPerPageAndGroup) {
  SessionInfo hybrid = session_;
  hybrid.group_kinds = {core::GroupKind::kFull, core::GroupKind::kState};
  v1::BackupRequest backup;
  auto* seq = backup.add_sequences();
  seq->set_page_keys(KeyBlob(PromptKeys(NsSpec(), 1, 2)));
  for (uint32_t b : {0u, kNoBlock, 1u, 2u}) seq->add_group_blocks(b);
  EXPECT_TRUE(ValidateBackup(backup, hybrid, Limits()).ok());
  v1::LoadRequest load;
  auto* lseq = load.add_sequences();
  lseq->set_page_keys(seq->page_keys());
  for (uint32_t b : {kNoBlock, kNoBlock, 1u, 2u}) lseq->add_group_blocks(b);
  EXPECT_TRUE(ValidateLoad(load, hybrid, Limits()).ok()) << "a Load may skip any object";

  v1::BackupRequest no_full = backup;
  no_full.mutable_sequences(0)->set_group_blocks(2, kNoBlock);
  EXPECT_TRUE(InvalidAt(ValidateBackup(no_full, hybrid, Limits()), "sequences[0].group_blocks[2]"));
  v1::BackupRequest short_ = backup;
  short_.mutable_sequences(0)->mutable_group_blocks()->RemoveLast();
  EXPECT_TRUE(InvalidAt(ValidateBackup(short_, hybrid, Limits()), "sequences[0].group_blocks"));
  v1::BackupRequest repeated = backup;
  repeated.mutable_sequences(0)->set_group_blocks(3, 0);
  EXPECT_TRUE(IsCacheError(ValidateBackup(repeated, hybrid, Limits()), kInvalid,
                           v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, "sequences[0].group_blocks[3]"));
  v1::BackupRequest out = backup;
  out.mutable_sequences(0)->set_group_blocks(3, 16);
  EXPECT_TRUE(IsCacheError(ValidateBackup(out, hybrid, Limits()), kInvalid,
                           v1::ERROR_REASON_BLOCK_OUT_OF_RANGE, "sequences[0].group_blocks[3]"));
  v1::BackupRequest both = backup;
  both.mutable_sequences(0)->add_device_blocks(5);
  EXPECT_TRUE(InvalidAt(ValidateBackup(both, hybrid, Limits()), "sequences[0].device_blocks"));
  // A namespace without groups takes no group_blocks.
  EXPECT_TRUE(InvalidAt(ValidateBackup(backup, session_, Limits()), "sequences[0].group_blocks"));
}

TEST(RequestValidationTest, PrefetchChecks) {
  v1::PrefetchRequest r;
  r.set_policy(v1::PREFETCH_POLICY_BEST_EFFORT);
  r.add_sequences()->set_page_keys(KeyBlob(PromptKeys(NsSpec(), 1, 2)));
  EXPECT_TRUE(ValidatePrefetch(r, Limits()).ok());
  v1::PrefetchRequest none = r;
  none.set_policy(v1::PREFETCH_POLICY_NONE);
  EXPECT_TRUE(InvalidAt(ValidatePrefetch(none, Limits()), "policy"));
  v1::PrefetchRequest parent = r;
  parent.mutable_sequences(0)->set_parent_key(std::string(31, 'p'));
  EXPECT_TRUE(InvalidAt(ValidatePrefetch(parent, Limits()), "sequences[0].parent_key"));
  v1::PrefetchRequest big = r;
  big.mutable_sequences(0)->set_page_keys(KeyBlob(PromptKeys(NsSpec(), 1, 9)));
  EXPECT_TRUE(IsCacheError(ValidatePrefetch(big, Limits()), kInvalid,
                           v1::ERROR_REASON_LIMIT_EXCEEDED, "sequences"));
}

TEST(RequestValidationTest, BlockFieldNamesTheSequenceAndIndex) {
  const std::vector<uint32_t> seq_begin = {0, 3, 3, 5};
  EXPECT_EQ(BlockField(seq_begin, 0), "sequences[0].device_blocks[0]");
  EXPECT_EQ(BlockField(seq_begin, 2), "sequences[0].device_blocks[2]");
  EXPECT_EQ(BlockField(seq_begin, 3), "sequences[2].device_blocks[0]") << "sequence 1 is empty";
  EXPECT_EQ(BlockField(seq_begin, 4), "sequences[2].device_blocks[1]");
}

}  // namespace
}  // namespace kvcellar::server::testing
