#include "server/rpc/request_validation.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/kv_layout.h"
#include "core/page_key.h"
#include "core/quote.h"
#include "core/radix_index.h"
#include "platform/process_memory.h"
#include "platform/shm_mapping.h"
#include "server/datapath/device_set.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

constexpr size_t kKeyBytes = core::kPageKeyBytes;
// POSIX shm names: NAME_MAX (cache_service.proto: "at most 255 bytes").
constexpr size_t kMaxShmNameBytes = 255;
// sizeof(cudaIpcMemHandle_t), sizeof(cudaIpcEventHandle_t).
constexpr size_t kCudaHandleBytes = gpu::kCudaIpcHandleBytes;

absl::Status CheckLength(absl::string_view field, absl::string_view value, size_t max) {
  if (value.size() > max) {
    return InvalidField(
        field, absl::StrCat(field, " is ", value.size(), " bytes, more than the limit of ", max));
  }
  return absl::OkStatus();
}

// A SIM shm name the daemon will open: 1..255 bytes and of a form ShmMapping opens (a POSIX name
// or "/proc/<pid>/fd/<fd>"). Checked here so that a malformed name is the caller's
// INVALID_ARGUMENT naming the field, not a failed open (HANDLE_OPEN_FAILED) later.
absl::Status CheckShmName(absl::string_view field, absl::string_view name) {
  if (name.empty() || name.size() > kMaxShmNameBytes ||
      !platform::ShmMapping::CheckName(name).ok()) {
    return InvalidField(
        field, absl::StrCat(field, " ", core::Quote(name),
                            " is not a shm name: \"/\" then 1..254 bytes, none of them \"/\" or "
                            "NUL, or exactly /proc/<pid>/fd/<fd>"));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyBlob(absl::string_view field, absl::string_view blob) {
  if (blob.size() % kKeyBytes != 0) {
    return InvalidField(field, absl::StrCat(field, " is ", blob.size(),
                                            " bytes, not a multiple of 32 (N concatenated "
                                            "32-byte page keys)"));
  }
  return absl::OkStatus();
}

absl::Status CheckSequenceCount(int n, const CacheLimits& limits) {
  if (static_cast<uint64_t>(n) > limits.max_batch_sequences) {
    return LimitExceeded("sequences", absl::StrCat("sequences: ", n,
                                                   " in one request, more than "
                                                   "max_batch_sequences (",
                                                   limits.max_batch_sequences, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckPageCount(uint64_t pages, const CacheLimits& limits) {
  if (pages > limits.max_batch_pages) {
    return LimitExceeded("sequences", absl::StrCat("sequences: ", pages,
                                                   " pages in one request, more than "
                                                   "max_batch_pages (",
                                                   limits.max_batch_pages, ")"));
  }
  return absl::OkStatus();
}

// Keys, blocks and request ids of a Load or Backup: counts match, blocks in range and distinct
// across the whole request, total within the limits. A hybrid namespace's sequences name their
// blocks per (page, group) in group_blocks, where kNoBlock skips an object; a Backup must name a
// block for every full-attention group of every page.
template <typename Sequences>
absl::Status CheckKeysAndBlocks(const Sequences& sequences, const SessionInfo& session,
                                const CacheLimits& limits, bool backup) {
  if (absl::Status s = CheckSequenceCount(sequences.size(), limits); !s.ok()) return s;
  const size_t groups = session.group_kinds.size();  // 0: not hybrid.
  const char* const blocks_name = groups > 0 ? "group_blocks" : "device_blocks";
  uint64_t pages = 0;
  for (int i = 0; i < sequences.size(); ++i) {
    const auto& seq = sequences[i];
    const std::string prefix = absl::StrCat("sequences[", i, "]");
    if (absl::Status s = CheckKeyBlob(absl::StrCat(prefix, ".page_keys"), seq.page_keys());
        !s.ok()) {
      return s;
    }
    const size_t keys = seq.page_keys().size() / kKeyBytes;
    const char* const unused_name = groups > 0 ? "device_blocks" : "group_blocks";
    const int unused = groups > 0 ? seq.device_blocks_size() : seq.group_blocks_size();
    if (unused > 0) {
      std::string field = absl::StrCat(prefix, ".", unused_name);
      return InvalidField(field,
                          absl::StrCat(field, " must be empty: this namespace ",
                                       groups > 0 ? "has KV groups (send group_blocks)"
                                                  : "has no KV groups (send device_blocks)"));
    }
    const size_t named = groups > 0 ? seq.group_blocks_size() : seq.device_blocks_size();
    const size_t per_page = std::max<size_t>(groups, 1);
    if (named != keys * per_page) {
      std::string field = absl::StrCat(prefix, ".", blocks_name);
      return InvalidField(
          field, groups > 0
                     ? absl::StrCat(field, ": ", named, " blocks for ", keys, " page keys and ",
                                    groups, " groups (one per page and group, page-major)")
                     : absl::StrCat(field, ": ", named, " blocks for ", keys,
                                    " page keys (one block per page)"));
    }
    if (absl::Status s =
            CheckLength(absl::StrCat(prefix, ".request_id"), seq.request_id(), kMaxIdBytes);
        !s.ok()) {
      return s;
    }
    pages += keys;
  }
  if (absl::Status s = CheckPageCount(pages, limits); !s.ok()) return s;

  // (block, sequence, index) sorted by block: out-of-range and repeated blocks in one pass.
  std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> blocks;
  blocks.reserve(pages);
  for (int i = 0; i < sequences.size(); ++i) {
    const auto& b = groups > 0 ? sequences[i].group_blocks() : sequences[i].device_blocks();
    for (int j = 0; j < b.size(); ++j) {
      std::string field;
      if (groups > 0 && b[j] == kNoBlock) {
        const size_t g = static_cast<size_t>(j) % groups;
        if (backup && session.group_kinds[g] == core::GroupKind::kFull) {
          field = absl::StrCat("sequences[", i, "].group_blocks[", j, "]");
          return InvalidField(
              field, absl::StrCat(field, ": page ", j / groups, " names no block for group ", g,
                                  ", a full-attention group (it is stored on every page)"));
        }
        continue;
      }
      // With a pool per group, group g's block b is its own: (g, b) is what may not repeat.
      const size_t g = groups > 0 ? static_cast<size_t>(j) % groups : 0;
      const uint32_t limit = session.GroupBlocks(g);
      if (b[j] >= limit) {
        field = absl::StrCat("sequences[", i, "].", blocks_name, "[", j, "]");
        return BlockOutOfRange(field,
                               absl::StrCat(field, " (", b[j], ") out of range [0, ", limit, ")",
                                            session.group_block_base.empty()
                                                ? ""
                                                : absl::StrCat(": group ", g, "'s own pool")));
      }
      blocks.emplace_back(session.BusyBlock(g, b[j]), i, j);
    }
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t k = 1; k < blocks.size(); ++k) {
    if (std::get<0>(blocks[k]) == std::get<0>(blocks[k - 1])) {
      const auto& seq = sequences[std::get<1>(blocks[k])];
      const uint32_t block =
          (groups > 0 ? seq.group_blocks()
                      : seq.device_blocks())[static_cast<int>(std::get<2>(blocks[k]))];
      std::string field = absl::StrCat("sequences[", std::get<1>(blocks[k]), "].", blocks_name, "[",
                                       std::get<2>(blocks[k]), "]");
      return BlockOutOfRange(field, absl::StrCat(field, " (", block, ") repeats sequences[",
                                                 std::get<1>(blocks[k - 1]), "].", blocks_name, "[",
                                                 std::get<2>(blocks[k - 1]),
                                                 "]: a block may appear once per request"));
    }
  }
  return absl::OkStatus();
}

// Field names of core::KvLayout::Validate errors ("layers[3].v.block_stride ...") in the
// request's terms ("layout.layers[3].v.block_stride_bytes").
std::string LayoutField(absl::string_view message) {
  size_t end = message.find_first_of(" :");
  std::string field(message.substr(0, end == absl::string_view::npos ? message.size() : end));
  struct Rename {
    absl::string_view from;
    absl::string_view to;
  };
  for (const Rename& r : {Rename{".block_stride", ".block_stride_bytes"},
                          Rename{".offset", ".offset_bytes"}, Rename{".size", ".size_bytes"}}) {
    if (absl::EndsWith(field, r.from)) {
      field = absl::StrCat(field.substr(0, field.size() - r.from.size()), r.to);
    }
  }
  return absl::StrCat("layout.", field);
}

absl::StatusOr<core::KvLayout> ParseLayout(const v1::KvLayout& in, const core::NamespaceSpec& spec,
                                           v1::DeviceKind kind, const CacheLimits& limits) {
  if (in.regions_size() == 0) {
    return InvalidField("layout.regions", "layout.regions: at least one region is required");
  }
  if (static_cast<uint32_t>(in.regions_size()) > limits.max_regions) {
    return LimitExceeded("layout.regions", absl::StrCat("layout.regions: ", in.regions_size(),
                                                        " regions, more than max_regions (",
                                                        limits.max_regions, ")"));
  }
  if (in.layers_size() == 0) {
    return InvalidField("layout.layers", "layout.layers: at least one layer is required");
  }
  if (static_cast<uint32_t>(in.layers_size()) > limits.max_layers) {
    return LimitExceeded("layout.layers",
                         absl::StrCat("layout.layers: ", in.layers_size(),
                                      " layers, more than max_layers (", limits.max_layers, ")"));
  }
  if (in.num_blocks() == 0) {
    return InvalidField("layout.num_blocks", "layout.num_blocks is 0");
  }
  if (in.tokens_per_block() != 0 && in.tokens_per_block() != spec.page_size) {
    return InvalidField("layout.tokens_per_block",
                        absl::StrCat("layout.tokens_per_block (", in.tokens_per_block(),
                                     ") must be 0 or equal namespace_spec.page_size_tokens (",
                                     spec.page_size, "): one page is one block in this revision"));
  }
  core::KvLayout out;
  out.num_blocks = in.num_blocks();
  for (int i = 0; i < in.regions_size(); ++i) {
    const v1::MemoryRegion& r = in.regions(i);
    const std::string prefix = absl::StrCat("layout.regions[", i, "]");
    core::MemoryRegion region;
    if (kind == v1::DEVICE_KIND_SIM) {
      const std::string field = absl::StrCat(prefix, ".sim_shm_name");
      if (r.handle_case() != v1::MemoryRegion::kSimShmName) {
        return InvalidField(field, absl::StrCat(field,
                                                ": a SIM device region needs a shm name, a "
                                                "/proc/<pid>/fd/<fd> path of 1..255 bytes, or "
                                                "/proc/<pid>/mem"));
      }
      // "/proc/<pid>/mem": the engine's own memory at the addresses offset_bytes gives
      // (platform/process_memory.h); the device checks whose it is.
      if (!platform::ParseProcessMemoryName(r.sim_shm_name()).has_value()) {
        if (absl::Status s = CheckShmName(field, r.sim_shm_name()); !s.ok()) return s;
      }
      region.handle = r.sim_shm_name();
    } else {
      if (r.handle_case() != v1::MemoryRegion::kCudaIpcHandle ||
          r.cuda_ipc_handle().size() != kCudaHandleBytes) {
        std::string field = absl::StrCat(prefix, ".cuda_ipc_handle");
        return InvalidField(field, absl::StrCat(field, ": a CUDA device region needs the ",
                                                kCudaHandleBytes, "-byte cudaIpcMemHandle_t"));
      }
      region.handle = r.cuda_ipc_handle();
    }
    if (r.size_bytes() == 0) {
      std::string field = absl::StrCat(prefix, ".size_bytes");
      return InvalidField(field, absl::StrCat(field, " is 0"));
    }
    region.offset = r.offset_bytes();
    region.size = r.size_bytes();
    out.regions.push_back(std::move(region));
  }
  const bool mla = spec.layout == core::LayoutKind::kMla;
  for (int i = 0; i < in.layers_size(); ++i) {
    const v1::LayerLayout& l = in.layers(i);
    const std::string prefix = absl::StrCat("layout.layers[", i, "]");
    if (!l.has_k()) {
      return InvalidField(absl::StrCat(prefix, ".k"), absl::StrCat(prefix, ".k is required"));
    }
    if (l.has_v() == mla) {
      std::string field = absl::StrCat(prefix, ".v");
      return InvalidField(field, mla ? absl::StrCat(field,
                                                    " must be absent: an MLA layer has one "
                                                    "(latent) buffer, given as k")
                                     : absl::StrCat(field,
                                                    " is required: an MHA/GQA layer has "
                                                    "a K and a V buffer"));
    }
    auto buffer = [](const v1::BlockBuffer& b) {
      return core::BufferLayout{b.region(), b.offset_bytes(), b.block_stride_bytes(),
                                b.bytes_per_block()};
    };
    core::LayerLayout layer;
    layer.k = buffer(l.k());
    if (l.has_v()) layer.v = buffer(l.v());
    if (l.group() >= spec.NumGroups()) {
      std::string field = absl::StrCat(prefix, ".group");
      return InvalidField(
          field, absl::StrCat(field, " (", l.group(), ") out of range [0, ", spec.NumGroups(),
                              "): namespace_spec.groups has ", spec.groups.size()));
    }
    layer.group = l.group();
    out.layers.push_back(layer);
  }
  if (out.NumGroups() != spec.NumGroups()) {
    return InvalidField("layout.layers",
                        absl::StrCat("layout.layers: no layer is in group ", out.NumGroups(),
                                     " of namespace_spec.groups (every group needs a layer)"));
  }
  if (in.group_num_blocks_size() > 0 && !spec.Hybrid()) {
    return InvalidField("layout.group_num_blocks",
                        "layout.group_num_blocks must be empty: the namespace has no KV groups");
  }
  out.group_num_blocks.assign(in.group_num_blocks().begin(), in.group_num_blocks().end());
  if (absl::Status s = out.Validate(); !s.ok()) {
    std::string field = LayoutField(s.message());
    return InvalidField(field, absl::StrCat("layout.", s.message()));
  }
  return out;
}

absl::Status ParseCompletion(const v1::RegisterEngineRequest& request, v1::DeviceKind kind,
                             const CacheLimits& limits, Registration* out) {
  if (!request.has_completion()) return absl::OkStatus();
  const v1::CompletionChannel& c = request.completion();
  for (auto [field, n] :
       {std::pair<absl::string_view, uint32_t>{"completion.num_load_slots", c.num_load_slots()},
        {"completion.num_ready_slots", c.num_ready_slots()}}) {
    if (n > limits.max_completion_slots) {
      return LimitExceeded(field, absl::StrCat(field, " (", n, ") exceeds max_completion_slots (",
                                               limits.max_completion_slots, ")"));
    }
  }
  out->num_load_slots = c.num_load_slots();
  out->num_ready_slots = c.num_ready_slots();
  const bool any = c.num_load_slots() > 0 || c.num_ready_slots() > 0;
  if (kind == v1::DEVICE_KIND_SIM) {
    if (c.signals_case() == v1::CompletionChannel::kCudaEvents) {
      return InvalidField("completion.cuda_events",
                          "completion.cuda_events: a SIM device signals through sim_counters");
    }
    if (c.signals_case() == v1::CompletionChannel::kSimCounters) {
      const std::string& name = c.sim_counters().shm_name();
      if (absl::Status s = CheckShmName("completion.sim_counters.shm_name", name); !s.ok()) {
        return s;
      }
      out->sim_counters_name = name;
      out->sim_counters_bytes = c.sim_counters().size_bytes();
    } else if (any) {
      return InvalidField("completion.sim_counters",
                          "completion.sim_counters is required when a slot count is > 0");
    }
    return absl::OkStatus();
  }
  // CUDA.
  if (c.signals_case() == v1::CompletionChannel::kSimCounters) {
    return InvalidField("completion.sim_counters",
                        "completion.sim_counters: a CUDA device signals through cuda_events");
  }
  if (any && c.signals_case() != v1::CompletionChannel::kCudaEvents) {
    return InvalidField("completion.cuda_events",
                        "completion.cuda_events is required when a slot count is > 0");
  }
  // Load events: one per (slot, layer), slot-major (docs/api.md "CUDA: IPC events").
  const uint64_t layers = static_cast<uint64_t>(request.layout().layers_size());
  const std::string& load = c.cuda_events().load_event_handles();
  if (load.size() != uint64_t{c.num_load_slots()} * layers * kCudaHandleBytes) {
    return InvalidField("completion.cuda_events.load_event_handles",
                        absl::StrCat("completion.cuda_events.load_event_handles is ", load.size(),
                                     " bytes; expected num_load_slots x layers x 64 = ",
                                     uint64_t{c.num_load_slots()} * layers * kCudaHandleBytes));
  }
  for (uint64_t i = 0; i < uint64_t{c.num_load_slots()} * layers; ++i) {
    out->engine.cuda_load_events.push_back(load.substr(i * kCudaHandleBytes, kCudaHandleBytes));
  }
  const std::string& ready = c.cuda_events().ready_event_handles();
  if (ready.size() != uint64_t{c.num_ready_slots()} * kCudaHandleBytes) {
    return InvalidField("completion.cuda_events.ready_event_handles",
                        absl::StrCat("completion.cuda_events.ready_event_handles is ", ready.size(),
                                     " bytes; expected num_ready_slots x 64 = ",
                                     uint64_t{c.num_ready_slots()} * kCudaHandleBytes));
  }
  for (uint32_t r = 0; r < c.num_ready_slots(); ++r) {
    out->cuda_ready_events.push_back(ready.substr(r * kCudaHandleBytes, kCudaHandleBytes));
  }
  return absl::OkStatus();
}

}  // namespace

void FillSessionGeometry(const v1::RegisterEngineRequest& request, const Registration& reg,
                         SessionInfo* info) {
  const bool mla = reg.spec.layout == core::LayoutKind::kMla;
  info->instance_id = request.instance_id();
  info->rank = reg.worker ? request.rank() : 0;
  info->role = reg.worker ? v1::SESSION_ROLE_WORKER : v1::SESSION_ROLE_SCHEDULER;
  info->shard = static_cast<uint16_t>(reg.worker && !mla ? request.rank() : 0);
  info->shard_writer = reg.worker && (!mla || request.rank() == 0);
  info->tp_size = reg.spec.tp_size;
  info->page_size = reg.spec.page_size;
  info->opaque_keys = reg.spec.opaque_keys;
  info->ns_digest = reg.spec.Digest();
  if (reg.spec.Hybrid()) {
    for (const core::KvGroup& g : reg.spec.groups) info->group_kinds.push_back(g.kind);
  }
  info->device_kind = reg.device_kind;
  info->num_blocks = reg.engine.layout.num_blocks;
  info->group_num_blocks = reg.engine.layout.group_num_blocks;
  uint32_t base = 0;
  for (uint32_t n : info->group_num_blocks) {
    info->group_block_base.push_back(base);
    base += n;  // Fits: KvLayout::Validate bounds the total by 2^32 - 1.
  }
  info->num_layers = static_cast<uint32_t>(reg.engine.layout.layers.size());
  info->num_load_slots = reg.num_load_slots;
  info->num_ready_slots = reg.num_ready_slots;
  info->cuda_ready_events = reg.cuda_ready_events;
}

absl::StatusOr<core::NamespaceSpec> ParseNamespaceSpec(const v1::NamespaceSpec& in) {
  core::NamespaceSpec spec;
  spec.tenant = in.tenant();
  spec.model_id = in.model_id();
  spec.model_revision = in.model_revision();
  spec.kv_dtype = in.kv_dtype();
  spec.page_size = in.page_size_tokens();
  spec.tp_size = in.tp_size();
  spec.opaque_keys = in.opaque_keys();
  for (int g = 0; g < in.groups_size(); ++g) {
    const v1::KvGroup& group = in.groups(g);
    core::KvGroup out;
    switch (group.kind()) {
      case v1::KV_GROUP_KIND_FULL_ATTENTION:
        out.kind = core::GroupKind::kFull;
        break;
      case v1::KV_GROUP_KIND_SLIDING_WINDOW:
        out.kind = core::GroupKind::kWindow;
        break;
      case v1::KV_GROUP_KIND_RECURRENT_STATE:
        out.kind = core::GroupKind::kState;
        break;
      default: {
        std::string field = absl::StrCat("namespace_spec.groups[", g, "].kind");
        return InvalidField(field, absl::StrCat(field, " (", group.kind(),
                                                ") must be FULL_ATTENTION, SLIDING_WINDOW or "
                                                "RECURRENT_STATE"));
      }
    }
    out.window_tokens = group.sliding_window_tokens();
    spec.groups.push_back(out);
  }
  switch (in.layout_kind()) {
    case v1::LAYOUT_KIND_MHA_GQA:
      spec.layout = core::LayoutKind::kMha;
      break;
    case v1::LAYOUT_KIND_MLA:
      spec.layout = core::LayoutKind::kMla;
      break;
    case v1::LAYOUT_KIND_UNSPECIFIED:
      return InvalidField("namespace_spec.layout_kind",
                          "namespace_spec.layout_kind is required (MHA_GQA or MLA)");
    default:
      return InvalidField("namespace_spec.layout_kind",
                          absl::StrCat("namespace_spec.layout_kind (", in.layout_kind(),
                                       ") is not a known LayoutKind"));
  }
  if (absl::Status s = spec.Validate(); !s.ok()) {
    // core names its fields "namespace <field> ..."; the request calls two of them differently.
    absl::string_view msg = s.message();
    absl::string_view rest = msg;
    absl::ConsumePrefix(&rest, "namespace ");
    std::string field(rest.substr(0, rest.find(' ')));
    if (absl::EndsWith(field, ":")) field.pop_back();  // "namespace groups: 17 groups, ..."
    if (field == "page_size") field = "page_size_tokens";
    if (field == "layout") field = "layout_kind";
    if (absl::EndsWith(field, ".window_tokens")) {
      field = absl::StrCat(field.substr(0, field.size() - 14), ".sliding_window_tokens");
    }
    return InvalidField(absl::StrCat("namespace_spec.", field),
                        absl::StrCat("namespace_spec.", field, ": ", msg));
  }
  if (spec.Hybrid() &&
      std::none_of(spec.groups.begin(), spec.groups.end(),
                   [](const core::KvGroup& g) { return g.kind == core::GroupKind::kFull; })) {
    // A full-attention group stores every page of a prefix, which keeps the index prefix-closed.
    return InvalidField("namespace_spec.groups",
                        "namespace_spec.groups: a hybrid namespace needs a FULL_ATTENTION group "
                        "in this revision");
  }
  // core allows tp_size up to kMaxTpSize; an MHA/GQA page has one shard per rank, and the index
  // tracks a page's shards in a mask of kMaxShardsPerPage bits. Checked here, for every role, so
  // that no session is accepted into a namespace whose index cannot exist.
  if (spec.ShardsPerPage() > static_cast<uint32_t>(core::kMaxShardsPerPage)) {
    return InvalidField("namespace_spec.tp_size",
                        absl::StrCat("namespace_spec.tp_size (", spec.tp_size, ") is more than ",
                                     core::kMaxShardsPerPage,
                                     ", the most shards an MHA/GQA page can have (one per rank)"));
  }
  return spec;
}

absl::StatusOr<Registration> ParseRegistration(const v1::RegisterEngineRequest& request,
                                               const CacheLimits& limits,
                                               absl::Span<const v1::DeviceKind> served) {
  if (request.instance_id().empty() || request.instance_id().size() > kMaxIdBytes) {
    return InvalidField("instance_id", absl::StrCat("instance_id is ", request.instance_id().size(),
                                                    " bytes; 1..256 required"));
  }
  if (!v1::SessionRole_IsValid(request.role())) {
    return InvalidField("role", absl::StrCat("role (", request.role(), ") is not a SessionRole"));
  }
  for (auto [field, value] :
       {std::pair<absl::string_view, const std::string*>{"engine_name", &request.engine_name()},
        {"client_version", &request.client_version()}}) {
    if (absl::Status s = CheckLength(field, *value, kMaxIdBytes); !s.ok()) return s;
  }
  if (!request.has_namespace_spec()) {
    return InvalidField("namespace_spec", "namespace_spec is required");
  }
  Registration reg;
  absl::StatusOr<core::NamespaceSpec> spec = ParseNamespaceSpec(request.namespace_spec());
  if (!spec.ok()) return spec.status();
  reg.spec = *std::move(spec);
  reg.worker = request.role() != v1::SESSION_ROLE_SCHEDULER;
  if (!reg.worker) return reg;  // Device, layout and completion are not used.

  if (request.rank() >= reg.spec.tp_size) {
    return InvalidField("rank", absl::StrCat("rank (", request.rank(),
                                             ") out of range [0, namespace_spec.tp_size = ",
                                             reg.spec.tp_size, ")"));
  }
  if (!request.has_device()) return InvalidField("device", "device is required for a WORKER");
  const v1::DeviceSpec& device = request.device();
  if (device.kind() == v1::DEVICE_KIND_UNSPECIFIED || !v1::DeviceKind_IsValid(device.kind())) {
    return InvalidField("device.kind",
                        absl::StrCat("device.kind (", device.kind(), ") must be CUDA or SIM"));
  }
  if (std::find(served.begin(), served.end(), device.kind()) == served.end()) {
    const std::string kinds = DeviceKindNames(served, "no device backend");
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_DEVICE_UNAVAILABLE,
                      "device.kind",
                      absl::StrCat("device.kind ", v1::DeviceKind_Name(device.kind()),
                                   " is not served: this daemon serves ", kinds,
                                   " (config device.kind, device.host_memory_engines)"));
  }
  if (device.uuid().size() != 16) {
    return InvalidField("device.uuid", absl::StrCat("device.uuid is ", device.uuid().size(),
                                                    " bytes; exactly 16 required"));
  }
  if (absl::Status s = CheckLength("device.name", device.name(), kMaxIdBytes); !s.ok()) return s;
  reg.device_kind = device.kind();
  if (reg.spec.Hybrid() && device.kind() == v1::DEVICE_KIND_CUDA) {
    // The CUDA copy kernels pack one object per block over every layer (gpu/cuda).
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_DEVICE_UNAVAILABLE,
                      "namespace_spec.groups",
                      "namespace_spec.groups: KV groups (a hybrid model) are served for "
                      "host-memory (SIM) engines only in this revision, not for CUDA engines");
  }
  if (!request.has_layout()) return InvalidField("layout", "layout is required for a WORKER");
  absl::StatusOr<core::KvLayout> layout =
      ParseLayout(request.layout(), reg.spec, device.kind(), limits);
  if (!layout.ok()) return layout.status();
  reg.engine.layout = *std::move(layout);
  reg.engine.device_uuid =
      gpu::FormatGpuUuid(reinterpret_cast<const uint8_t*>(device.uuid().data()));
  if (absl::Status s = ParseCompletion(request, device.kind(), limits, &reg); !s.ok()) return s;
  return reg;
}

absl::Status CheckWorker(const SessionInfo& session, absl::string_view rpc) {
  if (session.is_worker()) return absl::OkStatus();
  return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_WRONG_ROLE,
                    "session_id",
                    absl::StrCat(rpc, " needs a WORKER session; session_id ", session.id,
                                 " is a SCHEDULER session (it registered no device memory)"));
}

absl::Status ValidateMatch(const v1::MatchRequest& request, const core::NamespaceSpec& spec,
                           const CacheLimits& limits) {
  if (absl::Status s = CheckSequenceCount(request.sequences_size(), limits); !s.ok()) return s;
  if (!v1::PrefetchPolicy_IsValid(request.prefetch_policy())) {
    return InvalidField(
        "prefetch_policy",
        absl::StrCat("prefetch_policy (", request.prefetch_policy(), ") is not a PrefetchPolicy"));
  }
  uint64_t pages = 0;
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::MatchSequence& seq = request.sequences(i);
    const std::string prefix = absl::StrCat("sequences[", i, "]");
    if (!seq.page_keys().empty() && seq.token_ids_size() > 0) {
      return InvalidField(prefix, absl::StrCat(prefix, ": give page_keys or token_ids, not both"));
    }
    if (absl::Status s =
            CheckLength(absl::StrCat(prefix, ".request_id"), seq.request_id(), kMaxIdBytes);
        !s.ok()) {
      return s;
    }
    if (seq.token_ids_size() > 0) {
      if (spec.opaque_keys) {
        std::string field = absl::StrCat(prefix, ".token_ids");
        return CacheError(absl::StatusCode::kInvalidArgument,
                          v1::ERROR_REASON_TOKENS_IN_OPAQUE_NAMESPACE, field,
                          absl::StrCat(field,
                                       ": this namespace has opaque_keys; send the "
                                       "engine's page_keys"));
      }
      const uint64_t full = core::FullPages(seq.token_ids_size(), spec.page_size);
      pages += full > seq.num_computed_pages() ? full - seq.num_computed_pages() : 0;
    } else {
      if (absl::Status s = CheckKeyBlob(absl::StrCat(prefix, ".page_keys"), seq.page_keys());
          !s.ok()) {
        return s;
      }
      pages += seq.page_keys().size() / kKeyBytes;
    }
  }
  return CheckPageCount(pages, limits);
}

absl::Status ValidateLoad(const v1::LoadRequest& request, const SessionInfo& session,
                          const CacheLimits& limits) {
  if (absl::Status s = CheckWorker(session, "Load"); !s.ok()) return s;
  if (request.signal_layers()) {
    if (session.num_load_slots == 0) {
      return InvalidField("signal_layers",
                          "signal_layers: this session registered no load slots "
                          "(completion.num_load_slots = 0)");
    }
    if (request.completion_slot() >= session.num_load_slots) {
      return InvalidField("completion_slot",
                          absl::StrCat("completion_slot (", request.completion_slot(),
                                       ") out of range [0, ", session.num_load_slots, ")"));
    }
  }
  return CheckKeysAndBlocks(request.sequences(), session, limits, /*backup=*/false);
}

absl::Status ValidateBackup(const v1::BackupRequest& request, const SessionInfo& session,
                            const CacheLimits& limits) {
  if (absl::Status s = CheckWorker(session, "Backup"); !s.ok()) return s;
  if (!v1::WritePolicy_IsValid(request.write_policy())) {
    return InvalidField("write_policy", absl::StrCat("write_policy (", request.write_policy(),
                                                     ") is not a WritePolicy"));
  }
  if (request.has_ready()) {
    const v1::ReadySignal& ready = request.ready();
    if (ready.slot() >= session.num_ready_slots) {
      return InvalidField("ready.slot",
                          absl::StrCat("ready.slot (", ready.slot(), ") out of range [0, ",
                                       session.num_ready_slots, ")"));
    }
    if (session.device_kind == v1::DEVICE_KIND_SIM && ready.sim_token() == 0) {
      return InvalidField("ready.sim_token", "ready.sim_token must be > 0 on the SIM device");
    }
    if (session.device_kind == v1::DEVICE_KIND_CUDA && ready.sim_token() != 0) {
      return InvalidField("ready.sim_token", "ready.sim_token must be 0 on a CUDA device");
    }
  }
  for (int i = 0; i < request.sequences_size(); ++i) {
    const std::string& parent = request.sequences(i).parent_key();
    if (!parent.empty() && parent.size() != kKeyBytes) {
      std::string field = absl::StrCat("sequences[", i, "].parent_key");
      return InvalidField(field, absl::StrCat(field, " is ", parent.size(),
                                              " bytes; 32 required, or empty for page 0"));
    }
  }
  if (absl::Status s = CheckKeysAndBlocks(request.sequences(), session, limits, /*backup=*/true);
      !s.ok()) {
    return s;
  }
  for (int i = 0; i < request.sequences_size(); ++i) {
    if (absl::Status s = CheckBackupTokens(request.sequences(i), i, session); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckBackupTokens(const v1::BackupSequence& seq, int i, const SessionInfo& session) {
  if (seq.token_ids_size() == 0) return absl::OkStatus();
  const std::string field = absl::StrCat("sequences[", i, "].token_ids");
  const size_t pages = seq.page_keys().size() / kKeyBytes;
  const uint32_t page_size = session.page_size;
  if (static_cast<size_t>(seq.token_ids_size()) != pages * page_size) {
    return InvalidField(
        field, absl::StrCat(field, ": ", seq.token_ids_size(), " tokens for ", pages, " pages of ",
                            page_size, " tokens (page_size_tokens per page, or none)"));
  }
  if (session.opaque_keys) return absl::OkStatus();  // The engine's keys: nothing to hash.
  // An event must never name tokens a page does not hold: they must hash to its key.
  core::PageKey parent = session.ns_digest;
  if (!seq.parent_key().empty())
    std::memcpy(parent.bytes.data(), seq.parent_key().data(), kKeyBytes);
  const absl::Span<const uint32_t> tokens(seq.token_ids().data(), seq.token_ids_size());
  for (size_t p = 0; p < pages; ++p) {
    parent = core::ChainPageKey(parent, tokens.subspan(p * page_size, page_size));
    if (std::memcmp(parent.bytes.data(), seq.page_keys().data() + p * kKeyBytes, kKeyBytes) != 0) {
      return InvalidField(field, absl::StrCat(field, ": page ", p,
                                              "'s tokens do not hash to "
                                              "page_keys[",
                                              p, "] (docs/keys.md) from ",
                                              p == 0 ? "parent_key" : "the previous page's key"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrefetch(const v1::PrefetchRequest& request, const CacheLimits& limits) {
  if (!v1::PrefetchPolicy_IsValid(request.policy())) {
    return InvalidField("policy",
                        absl::StrCat("policy (", request.policy(), ") is not a PrefetchPolicy"));
  }
  if (request.policy() == v1::PREFETCH_POLICY_NONE) {
    return InvalidField("policy", "policy PREFETCH_POLICY_NONE asks for no prefetch");
  }
  if (absl::Status s = CheckSequenceCount(request.sequences_size(), limits); !s.ok()) return s;
  uint64_t pages = 0;
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::PrefetchSequence& seq = request.sequences(i);
    const std::string prefix = absl::StrCat("sequences[", i, "]");
    if (absl::Status s = CheckKeyBlob(absl::StrCat(prefix, ".page_keys"), seq.page_keys());
        !s.ok()) {
      return s;
    }
    if (!seq.parent_key().empty() && seq.parent_key().size() != kKeyBytes) {
      std::string field = absl::StrCat(prefix, ".parent_key");
      return InvalidField(field, absl::StrCat(field, " is ", seq.parent_key().size(),
                                              " bytes; 32 required, or empty for page 0"));
    }
    if (absl::Status s =
            CheckLength(absl::StrCat(prefix, ".request_id"), seq.request_id(), kMaxIdBytes);
        !s.ok()) {
      return s;
    }
    pages += seq.page_keys().size() / kKeyBytes;
  }
  return CheckPageCount(pages, limits);
}

}  // namespace kvcellar::server
