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

#include "core/page_key.h"

namespace kvcellar::core {

// IndexEvent::medium of L2; 0..kMaxL3Tiers-1 name an L3 tier by its index.
inline constexpr int8_t kMediumL2 = -1;

struct IndexEvent {
  enum class Kind : uint8_t { kStored, kRemoved };
  Kind kind = Kind::kStored;
  int8_t medium = kMediumL2;
  // kStored: whether the page has a parent (false: the first page of its sequences).
  bool has_parent = false;
  PageKey key;
  PageKey parent;  // Meaningful when has_parent.
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
