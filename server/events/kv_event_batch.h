// KvEventBatch: what kvcellard publishes for routers, and its wire form, vLLM's KV event format.
//
// The format is vLLM's (vllm/distributed/kv_events.py, checked against vLLM 0.33.0, the newest
// release on PyPI on 2026-11-26; docs/events.md): a batch is a msgpack array
// [ts: float64, events: array, data_parallel_rank: nil] (msgspec `EventBatch`, array_like), and
// each event a msgpack map tagged by "type" (msgspec tag=True, omit_defaults):
//   {"type": "BlockStored", "block_hashes": [hash...], "parent_block_hash": hash | nil,
//    "token_ids": [uint...], "block_size": uint, "lora_id": nil, "medium": str,
//    "lora_name": nil, "locality": "LOCAL" | "REMOTE"}
//   {"type": "BlockRemoved", "block_hashes": [hash...], "medium": str, "locality": ...}
//   {"type": "AllBlocksCleared"}
// A hash is vLLM's ExternalBlockHash: by default an integer, as vLLM publishes it
// (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the block hash's last 8 bytes, big-endian), here the
// engine's own hash of the page where it keys pages itself, else the page key's; or, with
// `int_hashes` false, the 32-byte page key. token_ids are the pages' tokens, block_size per page
// (vLLM's self-describing events), when every page of the event has them; else empty.
//
// Threads: plain values and a pure function.
#ifndef KVCELLAR_SERVER_EVENTS_KV_EVENT_BATCH_H_
#define KVCELLAR_SERVER_EVENTS_KV_EVENT_BATCH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/namespace_spec.h"
#include "core/page_key.h"

namespace kvcellar::server {

struct KvEvent {
  enum class Kind : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Kind kind = Kind::kBlockStored;
  std::string medium;    // "CPU" (L2) or "STORAGE:<tier name>"; empty for kAllBlocksCleared.
  std::string locality;  // "LOCAL" or "REMOTE" (a tier other nodes share); empty: omitted.
  std::vector<core::PageKey> keys;      // A chain (stored) or any pages (removed), in order.
  std::optional<core::PageKey> parent;  // kBlockStored: the parent of keys[0].
  std::vector<uint64_t> hashes;         // The integer block hash of each of keys.
  uint64_t parent_hash = 0;             // Of parent, when it has one.
  std::vector<uint32_t> token_ids;      // kBlockStored: every page's tokens, or empty.
  uint32_t block_size = 0;              // kBlockStored: tokens per page.
  // A hybrid model's KV group the event is about (vLLM's group_idx), -1: none (omitted). Stored
  // events also say the group's kind and window (kv_cache_spec_kind, _sliding_window).
  int16_t group = -1;
  core::GroupKind group_kind = core::GroupKind::kFull;
  uint32_t sliding_window = 0;
};

// One published batch: its sequence number (per daemon, from 0, one per batch), the topic it was
// sent under, the namespace it belongs to, and the msgpack payload.
struct KvEventBatch {
  uint64_t seq = 0;
  double ts = 0;  // Seconds since the Unix epoch.
  std::string topic;
  uint32_t ns_id = 0;
  std::string tenant;
  std::string model_id;
  std::vector<KvEvent> events;
  std::string payload;  // EncodeKvEventBatch(ts, events).
};

// The msgpack encoding of a batch, as vLLM's ZmqEventPublisher sends it.
// `int_hashes`: block hashes as integers (KvEvent::hashes), else as 32-byte keys.
std::string EncodeKvEventBatch(double ts, const std::vector<KvEvent>& events,
                               bool int_hashes = true);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_EVENTS_KV_EVENT_BATCH_H_
