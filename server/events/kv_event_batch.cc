#include "server/events/kv_event_batch.h"

// msgpack-cxx 4.1 (Debian 12's libmsgpack-cxx-dev), packer only; no Boost-dependent adaptors.
#include <msgpack.hpp>

#include "core/index_events.h"

namespace kvcellar::server {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackStr(Packer& p, std::string_view s) {
  p.pack_str(static_cast<uint32_t>(s.size()));
  p.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackKey(Packer& p, const core::PageKey& key) {
  p.pack_bin(core::kPageKeyBytes);
  p.pack_bin_body(reinterpret_cast<const char*>(key.bytes.data()), core::kPageKeyBytes);
}

void PackHashes(Packer& p, const KvEvent& e, bool int_hashes) {
  p.pack_array(static_cast<uint32_t>(e.keys.size()));
  for (size_t i = 0; i < e.keys.size(); ++i) {
    if (int_hashes) {
      p.pack_uint64(i < e.hashes.size() ? e.hashes[i] : core::IntBlockHash(e.keys[i]));
    } else {
      PackKey(p, e.keys[i]);
    }
  }
}

// vLLM 0.33's KVCacheSpecKind values (vllm/v1/kv_cache_interface.py) for our group kinds.
std::string_view SpecKind(core::GroupKind kind) {
  switch (kind) {
    case core::GroupKind::kWindow:
      return "sliding_window";
    case core::GroupKind::kState:
      return "mamba";
    case core::GroupKind::kFull:
      break;
  }
  return "full_attention";
}

void PackEvent(Packer& p, const KvEvent& e, bool int_hashes) {
  const bool locality = !e.locality.empty();
  // A hybrid model's events name their group (vLLM 0.32/0.33 KVCacheEvent fields group_idx,
  // kv_cache_spec_kind, kv_cache_spec_sliding_window; omitted when None, as msgspec does with
  // omit_defaults).
  const bool group = e.group >= 0;
  const bool window = group && e.group_kind == core::GroupKind::kWindow;
  switch (e.kind) {
    case KvEvent::Kind::kBlockStored:
      p.pack_map(8 + (locality ? 1 : 0) + (group ? 2 : 0) + (window ? 1 : 0));
      PackStr(p, "type");
      PackStr(p, "BlockStored");
      PackStr(p, "block_hashes");
      PackHashes(p, e, int_hashes);
      PackStr(p, "parent_block_hash");
      if (!e.parent.has_value()) {
        p.pack_nil();
      } else if (int_hashes) {
        p.pack_uint64(e.parent_hash);
      } else {
        PackKey(p, *e.parent);
      }
      PackStr(p, "token_ids");
      p.pack_array(static_cast<uint32_t>(e.token_ids.size()));
      for (uint32_t t : e.token_ids) p.pack_uint32(t);
      PackStr(p, "block_size");
      p.pack_uint32(e.block_size);
      PackStr(p, "lora_id");
      p.pack_nil();
      PackStr(p, "medium");
      PackStr(p, e.medium);
      PackStr(p, "lora_name");
      p.pack_nil();
      if (group) {
        PackStr(p, "group_idx");
        p.pack_int32(e.group);
        PackStr(p, "kv_cache_spec_kind");
        PackStr(p, SpecKind(e.group_kind));
      }
      if (window) {
        PackStr(p, "kv_cache_spec_sliding_window");
        p.pack_uint32(e.sliding_window);
      }
      break;
    case KvEvent::Kind::kBlockRemoved:
      p.pack_map(3 + (locality ? 1 : 0) + (group ? 1 : 0));
      PackStr(p, "type");
      PackStr(p, "BlockRemoved");
      PackStr(p, "block_hashes");
      PackHashes(p, e, int_hashes);
      PackStr(p, "medium");
      PackStr(p, e.medium);
      if (group) {
        PackStr(p, "group_idx");
        p.pack_int32(e.group);
      }
      break;
    case KvEvent::Kind::kAllBlocksCleared:
      p.pack_map(1);
      PackStr(p, "type");
      PackStr(p, "AllBlocksCleared");
      return;
  }
  if (locality) {
    PackStr(p, "locality");
    PackStr(p, e.locality);
  }
}

}  // namespace

std::string EncodeKvEventBatch(double ts, const std::vector<KvEvent>& events, bool int_hashes) {
  msgpack::sbuffer buffer;
  Packer p(buffer);
  p.pack_array(3);
  p.pack_double(ts);
  p.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) PackEvent(p, e, int_hashes);
  p.pack_nil();  // data_parallel_rank: a daemon serves every rank.
  return std::string(buffer.data(), buffer.size());
}

}  // namespace kvcellar::server
