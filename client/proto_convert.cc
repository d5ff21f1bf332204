#include "client/proto_convert.h"

#include <unistd.h>

#include <cstring>

namespace kvcellar::client {
namespace {

// DeviceSpec.uuid is exactly 16 bytes (the size of cudaUUID_t).
constexpr size_t kDeviceUuidBytes = 16;

void ToProto(const core::BufferLayout& b, v1::BlockBuffer* out) {
  out->set_region(b.region);
  out->set_offset_bytes(b.offset);
  out->set_block_stride_bytes(b.block_stride);
  out->set_bytes_per_block(b.bytes_per_block);
}

}  // namespace

void ToProto(const core::NamespaceSpec& ns, v1::NamespaceSpec* out) {
  out->set_tenant(ns.tenant);
  out->set_model_id(ns.model_id);
  out->set_model_revision(ns.model_revision);
  out->set_kv_dtype(ns.kv_dtype);
  out->set_page_size_tokens(ns.page_size);
  // The proto numbers differ from the canonical encoding's (common.proto, LayoutKind).
  out->set_layout_kind(ns.layout == core::LayoutKind::kMla ? v1::LAYOUT_KIND_MLA
                                                           : v1::LAYOUT_KIND_MHA_GQA);
  out->set_tp_size(ns.tp_size);
  out->set_opaque_keys(ns.opaque_keys);
  if (!ns.Hybrid()) return;  // One full-attention group: no groups on the wire (API revision 3).
  for (const core::KvGroup& g : ns.groups) {
    v1::KvGroup* pg = out->add_groups();
    // KvGroupKind numbers are the canonical encoding's plus one (common.proto).
    pg->set_kind(static_cast<v1::KvGroupKind>(static_cast<int>(g.kind) + 1));
    pg->set_sliding_window_tokens(g.window_tokens);
  }
}

v1::RegisterEngineRequest ToRegisterRequest(const EngineRegistration& reg) {
  v1::RegisterEngineRequest req;
  req.set_instance_id(reg.instance_id);
  req.set_rank(reg.rank);
  req.set_role(reg.scheduler ? v1::SESSION_ROLE_SCHEDULER : v1::SESSION_ROLE_WORKER);
  ToProto(reg.ns, req.mutable_namespace_spec());
  req.set_replace_existing(reg.replace_existing);
  req.set_pid(static_cast<uint32_t>(getpid()));
  req.set_engine_name(reg.engine_name);
  req.set_client_version(kClientVersion);
  req.set_client_api_revision(kClientApiRevision);
  if (reg.scheduler) return req;

  const bool cuda = reg.device_kind == DeviceKind::kCuda;
  v1::DeviceSpec* dev = req.mutable_device();
  dev->set_kind(static_cast<v1::DeviceKind>(reg.device_kind));
  std::string uuid = reg.device_uuid;
  if (uuid.empty()) uuid.assign(kDeviceUuidBytes, '\0');
  dev->set_uuid(uuid);
  dev->set_name(reg.device_name);

  v1::KvLayout* layout = req.mutable_layout();
  for (const core::MemoryRegion& r : reg.layout.regions) {
    v1::MemoryRegion* pr = layout->add_regions();
    if (cuda) {
      pr->set_cuda_ipc_handle(r.handle);
    } else {
      pr->set_sim_shm_name(r.handle);
    }
    pr->set_offset_bytes(r.offset);
    pr->set_size_bytes(r.size);
  }
  for (const core::LayerLayout& l : reg.layout.layers) {
    v1::LayerLayout* pl = layout->add_layers();
    ToProto(l.k, pl->mutable_k());
    if (l.v.has_value()) ToProto(*l.v, pl->mutable_v());
    pl->set_group(l.group);
  }
  layout->set_num_blocks(reg.layout.num_blocks);
  for (uint32_t n : reg.layout.group_num_blocks) layout->add_group_num_blocks(n);
  layout->set_tokens_per_block(reg.ns.page_size);

  const CompletionChannelSpec& c = reg.completion;
  if (c.num_load_slots > 0 || c.num_ready_slots > 0) {
    v1::CompletionChannel* pc = req.mutable_completion();
    pc->set_num_load_slots(c.num_load_slots);
    pc->set_num_ready_slots(c.num_ready_slots);
    if (cuda) {
      pc->mutable_cuda_events()->set_load_event_handles(c.cuda_load_event_handles);
      pc->mutable_cuda_events()->set_ready_event_handles(c.cuda_ready_event_handles);
    } else {
      pc->mutable_sim_counters()->set_shm_name(c.sim_shm_name);
      pc->mutable_sim_counters()->set_size_bytes(c.sim_size_bytes);
    }
  }
  return req;
}

PageStatus FromProto(v1::PageStatus s) {
  if (s < v1::PAGE_STATUS_UNSPECIFIED || s > v1::PAGE_STATUS_INTERNAL_ERROR) {
    return PageStatus::kInternalError;
  }
  return static_cast<PageStatus>(s);
}

OpState FromProto(v1::OpState s) {
  switch (s) {
    case v1::OP_STATE_PENDING:
      return OpState::kPending;
    case v1::OP_STATE_DONE:
      return OpState::kDone;
    case v1::OP_STATE_CANCELLED:
      return OpState::kCancelled;
    case v1::OP_STATE_UNKNOWN:
      return OpState::kUnknown;
    // FAILED, and anything this revision does not know (including UNSPECIFIED, never sent).
    default:
      return OpState::kFailed;
  }
}

ReleaseOutcome FromProto(v1::ReleaseOutcome s) {
  if (s < v1::RELEASE_OUTCOME_RELEASED || s > v1::RELEASE_OUTCOME_UNKNOWN) {
    return ReleaseOutcome::kUnknown;
  }
  return static_cast<ReleaseOutcome>(s);
}

void FromProto(const v1::OpResult& in, OpResult* out) {
  out->ref.op_id = in.op_id();
  out->kind = in.kind() >= v1::OP_KIND_PREFETCH && in.kind() <= v1::OP_KIND_BACKUP
                  ? static_cast<OpKind>(in.kind())
                  : OpKind::kUnspecified;
  out->state = FromProto(in.state());
  out->elapsed_us = in.elapsed_us();
  out->error_message = in.error_message();
  out->sequences.resize(in.sequences_size());
  for (int i = 0; i < in.sequences_size(); ++i) {
    const v1::SequenceResult& s = in.sequences(i);
    SequenceResult& o = out->sequences[i];
    o.leading_ok_pages = s.leading_ok_pages();
    o.page_status.resize(s.page_status_size());
    for (int j = 0; j < s.page_status_size(); ++j) {
      o.page_status[j] = FromProto(static_cast<v1::PageStatus>(s.page_status(j)));
    }
  }
}

void AppendKeys(absl::Span<const core::PageKey> keys, std::string* out) {
  const size_t at = out->size();
  out->resize(at + keys.size() * core::kPageKeyBytes);
  char* p = out->data() + at;
  for (const core::PageKey& k : keys) {
    std::memcpy(p, k.bytes.data(), core::kPageKeyBytes);
    p += core::kPageKeyBytes;
  }
}

}  // namespace kvcellar::client
