#include "server/events/kv_event_batch.h"

// msgpack-cxx 4.1 (Debian 12's libmsgpack-cxx-dev), packer only; no Boost-dependent adaptors.
#include <msgpack.hpp>

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

void PackKeys(Packer& p, const std::vector<core::PageKey>& keys) {
  p.pack_array(static_cast<uint32_t>(keys.size()));
  for (const core::PageKey& k : keys) PackKey(p, k);
}

void PackEvent(Packer& p, const KvEvent& e) {
  const bool locality = !e.locality.empty();
  switch (e.kind) {
    case KvEvent::Kind::kBlockStored:
      p.pack_map(8 + (locality ? 1 : 0));
      PackStr(p, "type");
      PackStr(p, "BlockStored");
      PackStr(p, "block_hashes");
      PackKeys(p, e.keys);
      PackStr(p, "parent_block_hash");
      if (e.parent.has_value()) {
        PackKey(p, *e.parent);
      } else {
        p.pack_nil();
      }
      PackStr(p, "token_ids");
      p.pack_array(0);
      PackStr(p, "block_size");
      p.pack_uint32(e.block_size);
      PackStr(p, "lora_id");
      p.pack_nil();
      PackStr(p, "medium");
      PackStr(p, e.medium);
      PackStr(p, "lora_name");
      p.pack_nil();
      break;
    case KvEvent::Kind::kBlockRemoved:
      p.pack_map(3 + (locality ? 1 : 0));
      PackStr(p, "type");
      PackStr(p, "BlockRemoved");
      PackStr(p, "block_hashes");
      PackKeys(p, e.keys);
      PackStr(p, "medium");
      PackStr(p, e.medium);
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

std::string EncodeKvEventBatch(double ts, const std::vector<KvEvent>& events) {
  msgpack::sbuffer buffer;
  Packer p(buffer);
  p.pack_array(3);
  p.pack_double(ts);
  p.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) PackEvent(p, e);
  p.pack_nil();  // data_parallel_rank: a daemon serves every rank.
  return std::string(buffer.data(), buffer.size());
}

}  // namespace kvcellar::server
