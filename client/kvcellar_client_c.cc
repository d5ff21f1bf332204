// The C ABI over the C++ API. Each function converts its plain-C arguments, calls the C++ API,
// and maps absl::Status to a KVC_* code plus the thread-local message of kvc_last_error().
#include "client/kvcellar_client_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvcellar_client.h"
#include "client/sim_signals.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "platform/sim_engine_memory.h"

using kvcellar::client::Client;
using kvcellar::client::Session;

struct kvc_client {
  std::unique_ptr<Client> client;
};

struct kvc_session {
  std::unique_ptr<Session> session;
  size_t blocks_per_page = 1;  // The namespace's KV groups, or 1.
  size_t page_size = 0;        // Tokens per page.
};

struct kvc_sim_memory {
  kvcellar::platform::SimEngineMemory memory;
};

struct kvc_sim_signals {
  kvcellar::client::SimSignalRegion region;
};

namespace {

namespace kc = ::kvcellar::client;
namespace core = ::kvcellar::core;

thread_local std::string last_error;

int Fail(int code, absl::string_view message) {
  last_error.assign(message.data(), message.size());
  return code;
}

// The KVC code for a result status; session state distinguishes a refused session.
int Code(const absl::Status& s, kvc_session* session = nullptr) {
  if (s.ok()) return KVC_OK;
  last_error = s.ToString();
  if (session != nullptr && session->session->state() == kc::SessionState::kRefused) {
    return KVC_ERR_REFUSED;
  }
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return KVC_ERR_INVALID_ARGUMENT;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
      return KVC_ERR_UNAVAILABLE;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
      return KVC_ERR_INTERNAL;
    default:
      return KVC_ERR_REJECTED;
  }
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

absl::Duration MsOr(uint32_t ms, absl::Duration dflt) {
  return ms == 0 ? dflt : absl::Milliseconds(ms);
}

// The caller's n * 32 bytes as n keys, in place: core::PageKey is exactly its 32 bytes with
// byte alignment, so no copy is made per call (2048 keys are 64 KiB, copied on every Match, Load
// and Backup before; measured by client/python/bench/bench_calls.py).
static_assert(sizeof(core::PageKey) == KVC_KEY_BYTES && alignof(core::PageKey) == 1);
absl::Span<const core::PageKey> Keys(const uint8_t* bytes, size_t n) {
  if (bytes == nullptr) return {};
  return absl::MakeConstSpan(reinterpret_cast<const core::PageKey*>(bytes), n);
}

int StateCode(kc::OpState s) {
  switch (s) {
    case kc::OpState::kPending:
      return KVC_OP_PENDING;
    case kc::OpState::kDone:
      return KVC_OP_DONE;
    case kc::OpState::kCancelled:
      return KVC_OP_CANCELLED;
    case kc::OpState::kUnknown:
      return KVC_OP_UNKNOWN;
    default:
      return KVC_OP_FAILED;
  }
}

int SessionStateCode(kc::SessionState s) {
  switch (s) {
    case kc::SessionState::kConnecting:
      return KVC_SESSION_CONNECTING;
    case kc::SessionState::kActive:
      return KVC_SESSION_ACTIVE;
    case kc::SessionState::kSuspect:
      return KVC_SESSION_SUSPECT;
    case kc::SessionState::kRefused:
      return KVC_SESSION_REFUSED;
    case kc::SessionState::kClosed:
      return KVC_SESSION_CLOSED;
  }
  return KVC_SESSION_CLOSED;
}

kc::OpRef Ref(const kvc_op& op) { return {op.op_id, op.generation}; }

core::NamespaceSpec Namespace(const kvc_namespace& n) {
  core::NamespaceSpec ns;
  ns.tenant = Str(n.tenant);
  ns.model_id = Str(n.model_id);
  ns.model_revision = Str(n.model_revision);
  ns.kv_dtype = Str(n.kv_dtype);
  ns.page_size = n.page_size;
  ns.layout = n.layout == KVC_LAYOUT_MLA ? core::LayoutKind::kMla : core::LayoutKind::kMha;
  ns.tp_size = n.tp_size;
  ns.opaque_keys = n.opaque_keys != 0;
  for (size_t g = 0; n.groups != nullptr && g < n.num_groups; ++g) {
    // Kinds past the enum stay out of range for Validate to name.
    ns.groups.push_back({static_cast<core::GroupKind>(std::min<uint32_t>(n.groups[g].kind, 255)),
                         n.groups[g].window_tokens});
  }
  return ns;
}

// The namespace, validated (the layout enum included, which NamespaceSpec cannot hold wrong).
absl::StatusOr<core::NamespaceSpec> ValidNamespace(const kvc_namespace& n) {
  if (n.layout != KVC_LAYOUT_MHA && n.layout != KVC_LAYOUT_MLA) {
    return absl::InvalidArgumentError(absl::StrCat("ns.layout ", n.layout, " unknown"));
  }
  core::NamespaceSpec ns = Namespace(n);
  if (absl::Status s = ns.Validate(); !s.ok()) return s;
  return ns;
}

// Copies an op result's per-sequence outcome into the C sequences (load or backup).
template <typename Seq>
void CopyResult(const kc::OpResult& r, Seq* seqs, size_t n, kvc_op* op_out, int* state_out) {
  for (size_t i = 0; i < n; ++i) {
    seqs[i].leading_ok_pages = 0;
    if (i >= r.sequences.size()) continue;
    const kc::SequenceResult& s = r.sequences[i];
    seqs[i].leading_ok_pages = s.leading_ok_pages;
    if (seqs[i].page_status != nullptr) {
      for (size_t j = 0; j < seqs[i].num_pages; ++j) {
        seqs[i].page_status[j] = j < s.page_status.size() ? static_cast<uint8_t>(s.page_status[j])
                                                          : static_cast<uint8_t>(KVC_PAGE_MISS);
      }
    }
  }
  if (op_out != nullptr) *op_out = {r.ref.op_id, r.ref.generation};
  if (state_out != nullptr) *state_out = StateCode(r.state);
}

}  // namespace

extern "C" {

const char* kvc_last_error(void) { return last_error.c_str(); }

const char* kvc_version(void) { return kc::kClientVersion; }

void kvc_client_options_init(kvc_client_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  o->heartbeat = 1;
}

int kvc_client_connect(const kvc_client_options* o, kvc_client** out) {
  if (out == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "out is NULL");
  *out = nullptr;
  kc::ClientOptions opts;
  if (o != nullptr) {
    opts.addr = Str(o->addr);
    opts.rpc_timeout = MsOr(o->rpc_timeout_ms, opts.rpc_timeout);
    opts.register_timeout = MsOr(o->register_timeout_ms, opts.register_timeout);
    opts.reconnect_backoff_min = MsOr(o->backoff_min_ms, opts.reconnect_backoff_min);
    opts.reconnect_backoff_max = MsOr(o->backoff_max_ms, opts.reconnect_backoff_max);
    opts.heartbeat = o->heartbeat != 0;
    opts.heartbeat_interval = MsOr(o->heartbeat_interval_ms, absl::ZeroDuration());
    opts.channel.ca_file = Str(o->tls_ca_file);
    opts.channel.cert_file = Str(o->tls_cert_file);
    opts.channel.key_file = Str(o->tls_key_file);
    opts.channel.server_name_override = Str(o->tls_server_name);
  }
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(std::move(opts));
  if (!c.ok()) return Code(c.status());
  *out = new kvc_client{*std::move(c)};
  return KVC_OK;
}

void kvc_client_close(kvc_client* client) { delete client; }

int kvc_client_stats_get(kvc_client* client, kvc_client_stats* out) {
  if (client == nullptr || out == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  const kc::ClientStats s = client->client->stats();
  out->rpcs_ok = s.rpcs_ok;
  out->rpcs_failed = s.rpcs_failed;
  out->rpcs_unavailable = s.rpcs_unavailable;
  out->rpcs_deadline_exceeded = s.rpcs_deadline_exceeded;
  out->rpcs_unimplemented = s.rpcs_unimplemented;
  out->degraded_calls = s.degraded_calls;
  out->match_calls = s.match_calls;
  out->match_pages = s.match_pages;
  out->match_l2_hit_pages = s.match_l2_hit_pages;
  out->registrations = s.registrations;
  out->reregistrations = s.reregistrations;
  out->registration_failures = s.registration_failures;
  out->sessions_lost = s.sessions_lost;
  out->heartbeats_ok = s.heartbeats_ok;
  out->heartbeats_failed = s.heartbeats_failed;
  out->ns_digest_mismatches = s.ns_digest_mismatches;
  out->ops_failed_session_lost = s.ops_failed_session_lost;
  out->uncertain_submissions = s.uncertain_submissions;
  return KVC_OK;
}

int kvc_register(kvc_client* client, const kvc_registration* r, kvc_session** out) {
  if (client == nullptr || r == nullptr || out == nullptr) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  *out = nullptr;
  if (r->ns.layout != KVC_LAYOUT_MHA && r->ns.layout != KVC_LAYOUT_MLA) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, absl::StrCat("ns.layout ", r->ns.layout, " unknown"));
  }
  kc::EngineRegistration reg;
  reg.instance_id = Str(r->instance_id);
  reg.rank = r->rank;
  reg.scheduler = r->scheduler != 0;
  reg.ns = Namespace(r->ns);
  reg.device_kind = static_cast<kc::DeviceKind>(r->device_kind);
  if (r->device_uuid != nullptr) {
    reg.device_uuid.assign(reinterpret_cast<const char*>(r->device_uuid), 16);
  }
  reg.device_name = Str(r->device_name);
  const bool cuda = r->device_kind == KVC_DEVICE_CUDA;
  for (size_t i = 0; i < r->num_regions; ++i) {
    const kvc_region& cr = r->regions[i];
    kvcellar::core::MemoryRegion mr;
    if (cuda) {
      if (cr.cuda_ipc_handle == nullptr) {
        return Fail(KVC_ERR_INVALID_ARGUMENT, absl::StrCat("regions[", i, "]: no IPC handle"));
      }
      mr.handle.assign(reinterpret_cast<const char*>(cr.cuda_ipc_handle), 64);
    } else {
      mr.handle = Str(cr.sim_shm_name);
    }
    mr.offset = cr.offset;
    mr.size = cr.size;
    reg.layout.regions.push_back(std::move(mr));
  }
  auto buffer = [](const kvc_buffer& b) {
    return kvcellar::core::BufferLayout{b.region, b.offset, b.block_stride, b.bytes_per_block};
  };
  for (size_t i = 0; i < r->num_layers; ++i) {
    kvcellar::core::LayerLayout l;
    l.k = buffer(r->layers[i].k);
    if (r->layers[i].has_v) l.v = buffer(r->layers[i].v);
    l.group = r->layers[i].group;
    reg.layout.layers.push_back(l);
  }
  reg.layout.num_blocks = r->num_blocks;
  if (r->num_group_num_blocks > 0 && r->group_num_blocks == nullptr) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "group_num_blocks: NULL with num_group_num_blocks > 0");
  }
  reg.layout.group_num_blocks.assign(r->group_num_blocks,
                                     r->group_num_blocks + r->num_group_num_blocks);
  reg.completion.num_load_slots = r->num_load_slots;
  reg.completion.num_ready_slots = r->num_ready_slots;
  reg.completion.sim_shm_name = Str(r->sim_signal_shm_name);
  reg.completion.sim_size_bytes = r->sim_signal_size;
  if (cuda && r->cuda_load_event_handles != nullptr) {
    reg.completion.cuda_load_event_handles.assign(
        reinterpret_cast<const char*>(r->cuda_load_event_handles),
        size_t{r->num_load_slots} * r->num_layers * 64);
  }
  if (cuda && r->cuda_ready_event_handles != nullptr) {
    reg.completion.cuda_ready_event_handles.assign(
        reinterpret_cast<const char*>(r->cuda_ready_event_handles),
        size_t{r->num_ready_slots} * 64);
  }
  reg.replace_existing = r->replace_existing != 0;
  reg.engine_name = Str(r->engine_name);
  const size_t blocks_per_page = reg.ns.NumGroups();
  const size_t page_size = reg.ns.page_size;
  absl::StatusOr<std::unique_ptr<Session>> s = client->client->Register(std::move(reg));
  if (!s.ok()) return Code(s.status());
  *out = new kvc_session{*std::move(s), blocks_per_page, page_size};
  return KVC_OK;
}

void kvc_session_close(kvc_session* session, uint32_t drain_timeout_ms) {
  if (session == nullptr) return;
  session->session->Close(absl::Milliseconds(drain_timeout_ms));
  delete session;
}

int kvc_session_info_get(kvc_session* session, kvc_session_info* out) {
  if (session == nullptr || out == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  const kc::SessionInfo i = session->session->info();
  out->session_id = i.session_id;
  out->generation = i.generation;
  out->daemon_epoch = i.daemon_epoch;
  out->lease_ms = i.lease_ms;
  out->heartbeat_interval_ms = i.heartbeat_interval_ms;
  out->shard_index = i.shard_index;
  out->num_shards = i.num_shards;
  out->is_shard_writer = i.is_shard_writer ? 1 : 0;
  out->page_object_bytes = i.page_object_bytes;
  out->state = SessionStateCode(session->session->state());
  std::memcpy(out->ns_digest, i.ns_digest.bytes.data(), KVC_KEY_BYTES);
  out->max_batch_pages = i.max_batch_pages;
  out->max_batch_sequences = i.max_batch_sequences;
  out->num_l3_tiers = static_cast<uint32_t>(i.l3_tier_names.size());
  out->page_tokens = i.page_tokens ? 1 : 0;
  return KVC_OK;
}

int kvc_session_wait_active(kvc_session* session, uint32_t timeout_ms) {
  if (session == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL session");
  if (session->session->WaitUntilActive(absl::Milliseconds(timeout_ms))) return KVC_OK;
  if (session->session->state() == kc::SessionState::kRefused) {
    return Fail(KVC_ERR_REFUSED, "namespace digest mismatch: the cache is not used");
  }
  return Fail(KVC_ERR_UNAVAILABLE, absl::StrCat("session not active after ", timeout_ms, " ms"));
}

size_t kvc_compute_keys(kvc_session* session, const uint32_t* tokens, size_t num_tokens,
                        uint8_t* keys_out, size_t max_keys) {
  if (session == nullptr || (tokens == nullptr && num_tokens > 0)) return 0;
  const std::vector<core::PageKey> keys =
      session->session->ComputeKeys(absl::MakeConstSpan(tokens, num_tokens));
  const size_t n = std::min(keys.size(), max_keys);
  for (size_t i = 0; i < n && keys_out != nullptr; ++i) {
    std::memcpy(keys_out + i * KVC_KEY_BYTES, keys[i].bytes.data(), KVC_KEY_BYTES);
  }
  return keys_out == nullptr ? keys.size() : n;
}

int kvc_match(kvc_session* session, kvc_match_seq* seqs, size_t num_seqs,
              const kvc_match_options* options, kvc_op* prefetch_op) {
  if (session == nullptr || (seqs == nullptr && num_seqs > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  std::vector<kc::MatchSequence> in(num_seqs);
  for (size_t i = 0; i < num_seqs; ++i) {
    seqs[i].l2_hit_pages = seqs[i].l3_hit_pages = seqs[i].total_pages = 0;
    seqs[i].pin_id = 0;
    if (seqs[i].tokens != nullptr) {
      in[i].tokens = absl::MakeConstSpan(seqs[i].tokens, seqs[i].num_tokens);
    }
    if (seqs[i].keys != nullptr) in[i].keys = Keys(seqs[i].keys, seqs[i].num_keys);
    in[i].num_computed_pages = seqs[i].num_computed_pages;
  }
  kc::MatchOptions mo;
  if (options != nullptr) {
    mo.pin = options->pin != 0;
    mo.pin_lease_ms = options->pin_lease_ms;
    mo.prefetch_policy = static_cast<kc::PrefetchPolicy>(options->prefetch_policy);
    mo.prefetch_timeout_ms = options->prefetch_timeout_ms;
    mo.step_id = options->step_id;
    mo.l3_lookup_timeout_ms = options->l3_lookup_timeout_ms;
  }
  const kc::MatchReply reply = session->session->Match(in, mo);
  for (size_t i = 0; i < num_seqs && i < reply.results.size(); ++i) {
    seqs[i].l2_hit_pages = reply.results[i].l2_hit_pages;
    seqs[i].l3_hit_pages = reply.results[i].l3_hit_pages;
    seqs[i].total_pages = reply.results[i].total_pages;
    seqs[i].pin_id = reply.results[i].pin_id;
  }
  if (prefetch_op != nullptr)
    *prefetch_op = {reply.prefetch_op.op_id, reply.prefetch_op.generation};
  return Code(reply.status, session);
}

int kvc_load(kvc_session* session, kvc_load_seq* seqs, size_t num_seqs, int signal_layers,
             uint32_t completion_slot, kvc_op* op_out, int* state_out) {
  if (session == nullptr || (seqs == nullptr && num_seqs > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  std::vector<kc::LoadSequence> in(num_seqs);
  for (size_t i = 0; i < num_seqs; ++i) {
    in[i].keys = Keys(seqs[i].keys, seqs[i].num_pages);
    in[i].blocks =
        absl::MakeConstSpan(seqs[i].blocks, seqs[i].num_pages * session->blocks_per_page);
    in[i].pin_id = seqs[i].pin_id;
    in[i].release_pin = seqs[i].release_pin != 0;
  }
  const kc::OpResult r = session->session->Load(in, {signal_layers != 0, completion_slot});
  CopyResult(r, seqs, num_seqs, op_out, state_out);
  return Code(r.status, session);
}

int kvc_backup(kvc_session* session, kvc_backup_seq* seqs, size_t num_seqs,
               const kvc_backup_options* options, kvc_op* op_out, int* state_out) {
  if (session == nullptr || (seqs == nullptr && num_seqs > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  std::vector<kc::BackupSequence> in(num_seqs);
  for (size_t i = 0; i < num_seqs; ++i) {
    in[i].keys = Keys(seqs[i].keys, seqs[i].num_pages);
    in[i].blocks =
        absl::MakeConstSpan(seqs[i].blocks, seqs[i].num_pages * session->blocks_per_page);
    if (seqs[i].parent_key != nullptr) {
      in[i].has_parent = true;
      std::memcpy(in[i].parent.bytes.data(), seqs[i].parent_key, KVC_KEY_BYTES);
    }
    if (seqs[i].tokens != nullptr) {
      in[i].tokens = absl::MakeConstSpan(seqs[i].tokens, seqs[i].num_pages * session->page_size);
    }
  }
  kc::BackupOptions bo;
  if (options != nullptr) {
    bo.has_ready = options->has_ready != 0;
    bo.ready_slot = options->ready_slot;
    bo.ready_token = options->ready_token;
    bo.write_policy = static_cast<kc::WritePolicy>(options->write_policy);
    bo.ready_timeout_ms = options->ready_timeout_ms;
  }
  const kc::OpResult r = session->session->Backup(in, bo);
  CopyResult(r, seqs, num_seqs, op_out, state_out);
  return Code(r.status, session);
}

int kvc_wait(kvc_session* session, kvc_op_status* ops, size_t num_ops, uint32_t timeout_ms,
             int any) {
  if (session == nullptr || (ops == nullptr && num_ops > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  std::vector<kc::OpRef> refs(num_ops);
  for (size_t i = 0; i < num_ops; ++i) refs[i] = Ref(ops[i].op);
  kc::WaitOptions wo;
  wo.timeout = absl::Milliseconds(timeout_ms);
  wo.any = any != 0;
  wo.omit_page_status = true;
  const std::vector<kc::OpResult> rs = session->session->WaitOps(refs, wo);
  absl::Status first;
  for (size_t i = 0; i < num_ops; ++i) {
    const kc::OpResult& r = rs[i];
    ops[i].state = StateCode(r.state);
    ops[i].num_sequences = static_cast<uint32_t>(r.sequences.size());
    for (size_t j = 0; ops[i].leading_ok_pages != nullptr && j < ops[i].leading_ok_cap; ++j) {
      ops[i].leading_ok_pages[j] = r.usable_pages(j);
    }
    if (first.ok() && !r.status.ok()) first = r.status;
  }
  return Code(first, session);
}

int kvc_wait_layer(kvc_session* session, kvc_op op, uint32_t slot, uint32_t layer,
                   uint32_t timeout_ms) {
  if (session == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL session");
  return Code(session->session->WaitLayerSignal(Ref(op), slot, layer,
                                                absl::Now() + absl::Milliseconds(timeout_ms)),
              session);
}

int kvc_wait_load_signal(kvc_session* session, kvc_op op, uint32_t slot, uint32_t timeout_ms) {
  if (session == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL session");
  const absl::Status s =
      session->session->WaitLoadSignal(Ref(op), slot, absl::Now() + absl::Milliseconds(timeout_ms));
  if (s.code() == absl::StatusCode::kAborted) return Fail(KVC_ERR_OP_FAILED, s.ToString());
  return Code(s, session);
}

int kvc_release(kvc_session* session, const uint64_t* pin_ids, size_t num_pins,
                const kvc_op* cancel_ops, size_t num_cancel) {
  if (session == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL session");
  std::vector<kc::OpRef> cancel(num_cancel);
  for (size_t i = 0; i < num_cancel; ++i) cancel[i] = Ref(cancel_ops[i]);
  const kc::ReleaseReply r = session->session->Release(
      absl::MakeConstSpan(pin_ids, pin_ids == nullptr ? 0 : num_pins), cancel);
  return Code(r.status, session);
}

int kvc_namespace_digest(const kvc_namespace* ns, uint8_t* digest_out) {
  if (ns == nullptr || digest_out == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  absl::StatusOr<core::NamespaceSpec> spec = ValidNamespace(*ns);
  if (!spec.ok()) return Code(spec.status());
  const core::PageKey d = spec->Digest();
  std::memcpy(digest_out, d.bytes.data(), KVC_KEY_BYTES);
  return KVC_OK;
}

int kvc_page_keys(const kvc_namespace* ns, const uint8_t* parent_key, const uint32_t* tokens,
                  size_t num_tokens, uint8_t* keys_out, size_t max_keys, size_t* num_keys_out) {
  if (num_keys_out != nullptr) *num_keys_out = 0;
  if (ns == nullptr || num_keys_out == nullptr || (tokens == nullptr && num_tokens > 0) ||
      (keys_out == nullptr && max_keys > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  absl::StatusOr<core::NamespaceSpec> spec = ValidNamespace(*ns);
  if (!spec.ok()) return Code(spec.status());
  core::PageKey parent;
  if (parent_key != nullptr) {
    std::memcpy(parent.bytes.data(), parent_key, KVC_KEY_BYTES);
  } else {
    parent = spec->Digest();
  }
  // core::PageKey is exactly its 32 bytes, so the caller's buffer is written in place.
  static_assert(sizeof(core::PageKey) == KVC_KEY_BYTES);
  *num_keys_out = core::ComputePageKeys(
      parent, absl::MakeConstSpan(tokens, num_tokens), spec->page_size,
      absl::MakeSpan(reinterpret_cast<core::PageKey*>(keys_out), max_keys));
  return KVC_OK;
}

int kvc_session_keys(kvc_session* session, const uint32_t* tokens, size_t num_tokens,
                     uint8_t* keys_out, size_t max_keys, size_t* num_keys_out) {
  if (num_keys_out != nullptr) *num_keys_out = 0;
  if (session == nullptr || num_keys_out == nullptr || (tokens == nullptr && num_tokens > 0) ||
      (keys_out == nullptr && max_keys > 0)) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  }
  const std::vector<core::PageKey> keys =
      session->session->ComputeKeys(absl::MakeConstSpan(tokens, num_tokens));
  const size_t n = std::min(keys.size(), max_keys);
  if (n > 0) std::memcpy(keys_out, keys.data(), n * KVC_KEY_BYTES);
  *num_keys_out = n;
  return KVC_OK;
}

int kvc_sim_unique_name(const char* tag, char* buf, size_t cap) {
  if (buf == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL buf");
  const std::string name = kvcellar::platform::UniqueShmName(tag == nullptr ? "py" : tag);
  if (name.size() + 1 > cap) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, absl::StrCat("cap ", cap, " < ", name.size() + 1));
  }
  std::memcpy(buf, name.c_str(), name.size() + 1);
  return KVC_OK;
}

int kvc_sim_memory_create(const char* name, uint64_t bytes, kvc_sim_memory** out) {
  if (out == nullptr || name == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  *out = nullptr;
  if (bytes == 0) return Fail(KVC_ERR_INVALID_ARGUMENT, "bytes must be > 0");
  absl::StatusOr<kvcellar::platform::SimEngineMemory> m =
      kvcellar::platform::SimEngineMemory::Create(name, bytes);
  if (!m.ok()) return Code(m.status());
  *out = new kvc_sim_memory{*std::move(m)};
  return KVC_OK;
}

uint8_t* kvc_sim_memory_data(const kvc_sim_memory* m) {
  return m == nullptr ? nullptr : m->memory.data();
}
uint64_t kvc_sim_memory_size(const kvc_sim_memory* m) {
  return m == nullptr ? 0 : m->memory.size();
}
const char* kvc_sim_memory_name(const kvc_sim_memory* m) {
  return m == nullptr ? "" : m->memory.name().c_str();
}
void kvc_sim_memory_close(kvc_sim_memory* m) { delete m; }

int kvc_sim_signals_create(const char* name, uint32_t num_load_slots, uint32_t num_layers,
                           uint32_t num_ready_slots, kvc_sim_signals** out) {
  if (out == nullptr || name == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL argument");
  *out = nullptr;
  absl::StatusOr<kc::SimSignalRegion> r =
      kc::SimSignalRegion::Create(name, num_load_slots, num_layers, num_ready_slots);
  if (!r.ok()) return Code(r.status());
  *out = new kvc_sim_signals{*std::move(r)};
  return KVC_OK;
}

const char* kvc_sim_signals_name(const kvc_sim_signals* s) {
  return s == nullptr ? "" : s->region.name().c_str();
}
uint64_t kvc_sim_signals_size(const kvc_sim_signals* s) {
  return s == nullptr ? 0 : s->region.size();
}

int kvc_sim_signals_publish_ready(kvc_sim_signals* s, uint32_t slot, uint64_t token) {
  if (s == nullptr) return Fail(KVC_ERR_INVALID_ARGUMENT, "NULL signals");
  if (slot >= s->region.num_ready_slots()) {
    return Fail(KVC_ERR_INVALID_ARGUMENT, absl::StrCat("slot ", slot, " >= num_ready_slots ",
                                                       s->region.num_ready_slots()));
  }
  s->region.PublishReady(slot, token);
  return KVC_OK;
}

void kvc_sim_signals_close(kvc_sim_signals* s) { delete s; }

}  // extern "C"
