// Fuzz target: Match, Prefetch, Load and Backup requests against a registered session, through
// the validation the RPC handlers run before anything is copied (server/rpc/request_validation.h).
//
// Input: one selector byte (which RPC, which session), then the serialized request. The sessions
// are registered by the daemon's own ParseRegistration from realistic requests: an MHA worker on
// the SIM device with completion slots, an MLA worker on CUDA, and a scheduler of an opaque-key
// namespace. An accepted request must be one the data path may trust: keys in whole 32-byte
// pages, one block per page, blocks in range and distinct, batch limits kept; and its keys must
// derive as the matcher derives them (core/page_key.h).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/config/cache_limits.h"
#include "server/config/config.h"
#include "server/rpc/request_validation.h"
#include "server/session/session_registry.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace core = kvcellar::core;
namespace server = kvcellar::server;
namespace v1 = kvcellar::v1;
using kvcellar::fuzz::CheckRefusal;

const server::CacheLimits& Limits() {
  static const server::CacheLimits limits =
      server::CacheLimits::FromConfig(server::DefaultConfig());
  return limits;
}

struct RegisteredSession {
  core::NamespaceSpec spec;
  server::SessionInfo info;
};

v1::RegisterEngineRequest BaseRequest(v1::LayoutKind kind, uint32_t tp_size, bool opaque) {
  v1::RegisterEngineRequest r;
  r.set_instance_id("fuzz-instance");
  r.set_engine_name("fuzz");
  v1::NamespaceSpec* ns = r.mutable_namespace_spec();
  ns->set_model_id("fuzz/model");
  ns->set_model_revision("r1");
  ns->set_kv_dtype("bf16");
  ns->set_page_size_tokens(16);
  ns->set_layout_kind(kind);
  ns->set_tp_size(tp_size);
  ns->set_opaque_keys(opaque);
  return r;
}

// Layer i's K (and V) buffers, one block after the other in region 0.
void AddLayers(v1::KvLayout* layout, int layers, bool with_v, uint64_t block_bytes) {
  const uint64_t per_layer = layout->num_blocks() * block_bytes * (with_v ? 2 : 1);
  for (int i = 0; i < layers; ++i) {
    v1::LayerLayout* l = layout->add_layers();
    l->mutable_k()->set_offset_bytes(i * per_layer);
    l->mutable_k()->set_block_stride_bytes(block_bytes * (with_v ? 2 : 1));
    l->mutable_k()->set_bytes_per_block(block_bytes);
    if (with_v) {
      l->mutable_v()->set_offset_bytes(i * per_layer + block_bytes);
      l->mutable_v()->set_block_stride_bytes(block_bytes * 2);
      l->mutable_v()->set_bytes_per_block(block_bytes);
    }
  }
  layout->mutable_regions(0)->set_size_bytes(layers * per_layer);
}

v1::RegisterEngineRequest SimMhaWorker() {
  v1::RegisterEngineRequest r = BaseRequest(v1::LAYOUT_KIND_MHA_GQA, 2, false);
  r.set_rank(1);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_SIM);
  r.mutable_device()->set_uuid(std::string(16, '\x01'));
  r.mutable_layout()->set_num_blocks(64);
  r.mutable_layout()->add_regions()->set_sim_shm_name("/kvc-fuzz-engine");
  AddLayers(r.mutable_layout(), 2, true, 512);
  r.mutable_completion()->set_num_load_slots(2);
  r.mutable_completion()->set_num_ready_slots(2);
  r.mutable_completion()->mutable_sim_counters()->set_shm_name("/kvc-fuzz-signals");
  r.mutable_completion()->mutable_sim_counters()->set_size_bytes(4096);
  return r;
}

v1::RegisterEngineRequest CudaMlaWorker() {
  v1::RegisterEngineRequest r = BaseRequest(v1::LAYOUT_KIND_MLA, 1, false);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  r.mutable_device()->set_uuid(std::string(16, '\x02'));
  r.mutable_layout()->set_num_blocks(32);
  r.mutable_layout()->add_regions()->set_cuda_ipc_handle(std::string(64, '\x03'));
  AddLayers(r.mutable_layout(), 3, false, 576);
  r.mutable_completion()->set_num_load_slots(1);
  r.mutable_completion()->set_num_ready_slots(1);
  r.mutable_completion()->mutable_cuda_events()->set_load_event_handles(std::string(3 * 64, 'l'));
  r.mutable_completion()->mutable_cuda_events()->set_ready_event_handles(std::string(64, 'r'));
  return r;
}

v1::RegisterEngineRequest OpaqueScheduler() {
  v1::RegisterEngineRequest r = BaseRequest(v1::LAYOUT_KIND_MHA_GQA, 4, true);
  r.set_role(v1::SESSION_ROLE_SCHEDULER);
  return r;
}

// As CacheServiceImpl::DoRegister fills a session's info from an accepted registration.
RegisteredSession Register(uint64_t id, const v1::RegisterEngineRequest& request) {
  static constexpr v1::DeviceKind kServed[] = {v1::DEVICE_KIND_SIM, v1::DEVICE_KIND_CUDA};
  absl::StatusOr<server::Registration> reg = server::ParseRegistration(request, Limits(), kServed);
  FUZZ_CHECK(reg.ok());
  RegisteredSession s;
  s.spec = reg->spec;
  s.info.id = id;
  server::FillSessionGeometry(request, *reg, &s.info);
  return s;
}

const std::vector<RegisteredSession>& Sessions() {
  static const std::vector<RegisteredSession> sessions = {
      Register(1, SimMhaWorker()), Register(2, CudaMlaWorker()), Register(3, OpaqueScheduler())};
  return sessions;
}

// Whole pages of keys, each a PageKey as the index takes it.
size_t CheckKeys(const std::string& blob) {
  FUZZ_CHECK(blob.size() % core::kPageKeyBytes == 0);
  for (size_t off = 0; off < blob.size(); off += core::kPageKeyBytes) {
    FUZZ_CHECK(core::PageKey::FromBytes(blob.substr(off, core::kPageKeyBytes)).ok());
  }
  return blob.size() / core::kPageKeyBytes;
}

// An accepted Load or Backup: one block per key, every block in range and used once.
template <typename Sequences>
void CheckAcceptedBlocks(const Sequences& sequences, const server::SessionInfo& session) {
  FUZZ_CHECK(session.is_worker());
  FUZZ_CHECK(static_cast<uint64_t>(sequences.size()) <= Limits().max_batch_sequences);
  absl::flat_hash_set<uint32_t> used;
  for (const auto& seq : sequences) {
    FUZZ_CHECK(CheckKeys(seq.page_keys()) == static_cast<size_t>(seq.device_blocks_size()));
    for (uint32_t block : seq.device_blocks()) {
      FUZZ_CHECK(block < session.num_blocks);
      FUZZ_CHECK(used.insert(block).second);
    }
  }
  FUZZ_CHECK(used.size() <= Limits().max_batch_pages);
}

// An accepted Match: the pages it asks about, derived as the matcher derives them.
void CheckAcceptedMatch(const v1::MatchRequest& request, const core::NamespaceSpec& spec) {
  const core::PageKey root = spec.Digest();
  uint64_t pages = 0;
  for (const v1::MatchSequence& seq : request.sequences()) {
    if (seq.token_ids_size() == 0) {
      pages += CheckKeys(seq.page_keys());
      continue;
    }
    FUZZ_CHECK(!spec.opaque_keys && seq.page_keys().empty());
    const std::vector<core::PageKey> keys =
        core::ComputePageKeys(root, seq.token_ids(), spec.page_size);
    FUZZ_CHECK(keys.size() == core::FullPages(seq.token_ids_size(), spec.page_size));
    pages += keys.size() > seq.num_computed_pages() ? keys.size() - seq.num_computed_pages() : 0;
  }
  FUZZ_CHECK(pages <= Limits().max_batch_pages);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcellar::fuzz::QuietProtobuf();
  (void)Sessions();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return -1;
  const int rpc = data[0] & 3;
  const RegisteredSession& session = Sessions()[(data[0] >> 2) % Sessions().size()];
  const uint8_t* body = data + 1;
  const int body_size = static_cast<int>(size - 1);
  const server::CacheLimits& limits = Limits();
  absl::Status s;
  switch (rpc) {
    case 0: {
      v1::MatchRequest r;
      if (!r.ParseFromArray(body, body_size)) return -1;
      s = server::ValidateMatch(r, session.spec, limits);
      if (s.ok()) CheckAcceptedMatch(r, session.spec);
      break;
    }
    case 1: {
      v1::PrefetchRequest r;
      if (!r.ParseFromArray(body, body_size)) return -1;
      s = server::ValidatePrefetch(r, limits);
      if (s.ok()) {
        for (const v1::PrefetchSequence& seq : r.sequences()) CheckKeys(seq.page_keys());
      }
      break;
    }
    case 2: {
      v1::LoadRequest r;
      if (!r.ParseFromArray(body, body_size)) return -1;
      s = server::ValidateLoad(r, session.info, limits);
      if (s.ok()) {
        CheckAcceptedBlocks(r.sequences(), session.info);
        FUZZ_CHECK(!r.signal_layers() || r.completion_slot() < session.info.num_load_slots);
      }
      break;
    }
    case 3: {
      v1::BackupRequest r;
      if (!r.ParseFromArray(body, body_size)) return -1;
      s = server::ValidateBackup(r, session.info, limits);
      if (s.ok()) {
        CheckAcceptedBlocks(r.sequences(), session.info);
        FUZZ_CHECK(!r.has_ready() || r.ready().slot() < session.info.num_ready_slots);
      }
      break;
    }
  }
  if (!s.ok()) CheckRefusal(s);
  return 0;
}
