// IndexEvent: a page gained its first copy in a medium, or lost its last one (docs/events.md).
//
// A RadixIndex with a sink reports, per page and medium (L2, or one L3 tier):
//  - kStored when the page's first shard becomes visible there (L2: its first committed shard;
//    L3: the first shard the storage layer marked present),
//  - kRemoved when its last shard there goes (eviction, removal, the storage layer's report).
// So for every (page, medium) the events alternate stored, removed, stored..., starting with
// stored, in the order the index applied them. The same transitions move RadixIndexStats'
// l2_pages; a medium is a page-level fact, as a router needs it, not a shard-level one.
//
// Threads: the index calls the sink with its own lock held, from whichever thread changed it.
// A sink must not block and must not call back into the index.
#ifndef KVCELLAR_CORE_INDEX_EVENTS_H_
#define KVCELLAR_CORE_INDEX_EVENTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "core/page_key.h"

namespace kvcellar::core {

// IndexEvent::medium of L2; 0..kMaxL3Tiers-1 name an L3 tier by its index.
inline constexpr int8_t kMediumL2 = -1;

// What events say of a page beyond its key (RadixIndex::Label): the tokens it holds, and the
// engine's own hash of it where the engine keys pages itself (an opaque-key namespace). Immutable
// once attached, shared by every event of the page.
struct PageLabel {
  // vLLM's integer form of the engine's block hash (ExternalBlockHash: the hash's last 8 bytes,
  // big-endian); meaningful when has_engine_hash.
  uint64_t engine_hash = 0;
  bool has_engine_hash = false;
  std::vector<uint32_t> tokens;  // The page's tokens; empty: not known.

  // Heap bytes of one label, what the index accounts for it.
  uint64_t MemoryBytes() const { return sizeof(PageLabel) + tokens.capacity() * sizeof(uint32_t); }
};

// vLLM's integer form of a 32-byte block hash: its last 8 bytes, big-endian
// (vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash, vLLM 0.33.0).
inline uint64_t IntBlockHash(const PageKey& key) {
  uint64_t v = 0;
  for (size_t i = kPageKeyBytes - 8; i < kPageKeyBytes; ++i) v = v << 8 | key.bytes[i];
  return v;
}

struct IndexEvent {
  enum class Kind : uint8_t { kStored, kRemoved };
  Kind kind = Kind::kStored;
  int8_t medium = kMediumL2;
  // kStored: whether the page has a parent (false: the first page of its sequences).
  bool has_parent = false;
  PageKey key;
  PageKey parent;  // Meaningful when has_parent.
  // kStored: the page's label (nullptr: none), and the integer block hashes of the page and of its
  // parent (when has_parent): the engine's own where its label has one, else IntBlockHash(key).
  std::shared_ptr<const PageLabel> label;
  uint64_t hash = 0;
  uint64_t parent_hash = 0;
  // An L3 medium's event: the tiers holding the page (with groups: its group's objects) after
  // this change, so that a consumer may announce several tiers as one medium.
  uint8_t l3_tiers = 0;
  // The KV group whose objects of the page entered or left the medium, in a namespace of a
  // hybrid model (one event per group); -1 otherwise (the page as a whole).
  int16_t group = -1;
};

class IndexEventSink {
 public:
  virtual ~IndexEventSink() = default;
  virtual void OnIndexEvent(const IndexEvent& event) = 0;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_INDEX_EVENTS_H_
