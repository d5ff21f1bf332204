#include "core/radix_index.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

// Under AddressSanitizer, slab memory not handed out is poisoned, so a stale node pointer is
// reported like a use after free of malloc'ed memory would be.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KVCELLAR_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define KVCELLAR_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define KVCELLAR_POISON(p, n) ((void)(p), (void)(n))
#define KVCELLAR_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace kvcellar::core {
namespace {

// A chain continues through its parent's child links, scanning this many children before a
// hash probe is cheaper (a shared prefix with many continuations). Most pages have 0 or 1 child.
constexpr int kChildScan = 4;

// Match follows child links while children mostly lie near their parents in memory (a Backup
// batch allocates a prompt's run of pages together, so the hardware prefetcher streams them):
// no hash probe at all. Links far apart serialize one cache miss per page, though, where hash
// probes issued ahead overlap. Once at least kFarLinks links, and more than 1 in kFarRatio, led
// farther than kNearBytes, Match switches to pipelined probes for the rest of the call. A prompt
// backed up in runs of 64 pages (chunked prefill) stays on links. Measured with bench_index.cc on
// a 1M-page index: sequential, runs of 64, and page-by-page random layouts.
constexpr size_t kNearBytes = 4096;
constexpr int kFarLinks = 4;
constexpr size_t kFarRatio = 8;
// Probing is a two-stage pipeline: the hash probe of keys[i + 2 * kResolveAhead] is prefetched
// and keys[i + kResolveAhead] is looked up (its node load starts then), while keys[i] is used.
constexpr size_t kResolveAhead = 8;
// BeginWrite prefetches the hash probe of the request this many ahead.
constexpr size_t kWriteAhead = 8;
// While following links, Match also prefetches the node this many slab slots past the current
// one: a run's pages were allocated one after the other, and the hardware prefetcher neither
// crosses 4 KiB pages nor ramps up within a short run. A wrong guess costs two cache lines.
// Runs of 64: 79 us -> 45-50 us per 2048-page Match (4: 55, 8: 53, 32: 52); sequential and
// random layouts unchanged (bench_index.cc).
constexpr size_t kSlabPrefetchNodes = 16;

// Keys are digests: their first 8 bytes identify a page well enough for a ghost entry.
uint64_t KeyFingerprint(const PageKey& key) {
  uint64_t v;
  std::memcpy(&v, key.bytes.data(), sizeof(v));
  return v;
}

std::string ShortKey(const PageKey& key) { return key.Hex().substr(0, 16); }

int LowBit(uint64_t mask) { return std::countr_zero(mask); }

}  // namespace

// Per-shard state: 12 bytes, so a TP-8 page spends 96 bytes on its shards.
struct RadixIndex::ShardState {
  SlotRef slot;          // Valid iff the shard is committed or being written to L2.
  uint8_t l3_tiers = 0;  // Bit t: tier t holds a checked copy.
  WriteKind write_kind = WriteKind::kBackup;  // Of the write in flight, if any.
};

// A page. Trivially destructible; lives in the slab, followed by shards_per_page ShardStates.
struct RadixIndex::Node {
  EvictionHook hook;  // First member: the policy's EvictionHook* converts back to the Node*.
  PageKey key;
  // Links by slab id (0: none). parent 0: the first page of its sequences. Right after the key:
  // a Match that probes by hash reads the key and then the parent.
  NodeId parent = 0;
  NodeId first_child = 0;
  NodeId prev_sibling = 0;
  NodeId next_sibling = 0;
  ShardMask resident = 0;    // Shards committed in L2 (visible).
  uint32_t l2_children = 0;  // Children with HoldsL2().
  uint32_t pins = 0;         // Sum of the counts in pinned_[pin_slot].
  uint32_t pin_slot = 0;     // Index of this page's record in pinned_; meaningful iff pins > 0.
  uint16_t l3_copies = 0;    // (shard, tier) copies.
  // Shards being written to L2 (slot held, invisible): those whose slot is valid and whose
  // resident bit is clear (Writing). A count rather than a mask: 7 bytes fewer per page.
  uint8_t writing = 0;
  // Cleared by an admin while busy: invisible to Match, its copies dropped by ReapDoomed once
  // the copy using it ends.
  bool doomed = false;

  ShardState* shards() {
    return reinterpret_cast<ShardState*>(reinterpret_cast<char*>(this) + sizeof(Node));
  }
  const ShardState* shards() const {
    return reinterpret_cast<const ShardState*>(reinterpret_cast<const char*>(this) + sizeof(Node));
  }
  bool HoldsL2() const { return resident != 0 || writing != 0; }
  // Shard s holds an L2 slot (committed or being written).
  bool HoldsSlot(int s) const { return shards()[s].slot.valid(); }
  bool Writing(int s) const { return HoldsSlot(s) && ((resident >> s) & 1) == 0; }
  bool Empty() const { return !HoldsL2() && l3_copies == 0; }
  bool Busy() const { return pins != 0 || writing != 0; }
  bool Evictable() const { return resident != 0 && writing == 0 && pins == 0 && l2_children == 0; }
  static Node* FromHook(EvictionHook* h) { return reinterpret_cast<Node*>(h); }
  static const Node* FromHook(const EvictionHook* h) { return reinterpret_cast<const Node*>(h); }
};

// Fixed-size node allocator: chunks carved in order, freed nodes reused LIFO. Memory returns to
// the system only when the index is destroyed (a namespace's high-water mark of pages). A node's id
// is its chunk << kChunkShift | its place in the chunk; id 0 (chunk 0's first node) is never handed
// out, so that 0 means no node.
class RadixIndex::NodeSlab {
 public:
  // 512 nodes a chunk: large enough that chunk allocation is rare, small enough (about 60 KiB for
  // MLA nodes) that a small namespace does not reserve much.
  static constexpr int kChunkShift = 9;
  static constexpr size_t kNodesPerChunk = size_t{1} << kChunkShift;
  static constexpr size_t kMaxChunks = size_t{1} << (32 - kChunkShift);

  explicit NodeSlab(size_t node_bytes)
      : node_bytes_((node_bytes + alignof(Node) - 1) / alignof(Node) * alignof(Node)) {}
  ~NodeSlab() {
    for (auto& chunk : chunks_) KVCELLAR_UNPOISON(chunk.get(), node_bytes_ * kNodesPerChunk);
  }

  Node* At(NodeId id) const {
    if (id == 0) return nullptr;
    return reinterpret_cast<Node*>(chunks_[id >> kChunkShift].get() +
                                   (id & (kNodesPerChunk - 1)) * node_bytes_);
  }
  // Every id is in use: 2^32 - 1 nodes.
  bool Full() const { return free_ == 0 && next_ == kMaxChunks * kNodesPerChunk; }
  // A free node's memory and its id. Not when Full().
  std::pair<void*, NodeId> Allocate() {
    NodeId id;
    if (free_ != 0) {
      id = free_;
      std::memcpy(&free_, At(id), sizeof(free_));
    } else {
      if (next_ == chunks_.size() * kNodesPerChunk) {
        chunks_.emplace_back(new std::byte[node_bytes_ * kNodesPerChunk]);
        KVCELLAR_POISON(chunks_.back().get(), node_bytes_ * kNodesPerChunk);
        if (next_ == 0) next_ = 1;  // Id 0 is no node.
      }
      id = static_cast<NodeId>(next_++);
    }
    void* p = At(id);
    KVCELLAR_UNPOISON(p, node_bytes_);
    return {p, id};
  }
  // The first 4 bytes of a free node link the free list; the rest is poisoned.
  void Free(NodeId id) {
    void* p = At(id);
    std::memcpy(p, &free_, sizeof(free_));
    free_ = id;
    KVCELLAR_POISON(static_cast<std::byte*>(p) + sizeof(free_), node_bytes_ - sizeof(free_));
  }
  size_t node_bytes() const { return node_bytes_; }
  // Every id handed out so far is below this.
  size_t IdBound() const { return next_; }
  size_t MemoryBytes() const {
    return chunks_.size() * node_bytes_ * kNodesPerChunk +
           chunks_.capacity() * sizeof(std::unique_ptr<std::byte[]>);
  }

 private:
  const size_t node_bytes_;
  std::vector<std::unique_ptr<std::byte[]>> chunks_;
  size_t next_ = 0;  // The next id never handed out.
  NodeId free_ = 0;  // Head of the free list.
};

inline RadixIndex::Node* RadixIndex::At(NodeId id) const { return slab_->At(id); }

class RadixIndex::Candidates final : public EvictionCandidates {
 public:
  bool Evictable(const EvictionHook& hook) const override {
    return Node::FromHook(&hook)->Evictable();
  }
  uint64_t Fingerprint(const EvictionHook& hook) const override {
    return KeyFingerprint(Node::FromHook(&hook)->key);
  }
};

inline size_t RadixIndex::NodeHash::operator()(const PageKey& key) const {
  return absl::Hash<PageKey>{}(key);
}
inline size_t RadixIndex::NodeHash::operator()(NodeId id) const {
  return (*this)(slab->At(id)->key);
}
// Word-wise and inline: std::array's operator== calls memcmp, which showed up at ~20% of Match.
inline bool KeysEqual(const PageKey& a, const PageKey& b) {
  uint64_t x[4], y[4];
  std::memcpy(x, a.bytes.data(), sizeof(x));
  std::memcpy(y, b.bytes.data(), sizeof(y));
  return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0;
}
inline bool RadixIndex::NodeEq::operator()(NodeId a, const PageKey& b) const {
  return KeysEqual(slab->At(a)->key, b);
}

// --- Construction ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<RadixIndex>> RadixIndex::Create(const RadixIndexOptions& options) {
  return Create(options, MakeEvictionPolicy(options.policy));
}

absl::StatusOr<std::unique_ptr<RadixIndex>> RadixIndex::Create(
    const RadixIndexOptions& options, std::unique_ptr<EvictionPolicy> policy) {
  static_assert(sizeof(ShardState) == 12);
  static_assert(sizeof(Node) % alignof(ShardState) == 0);
  if (options.shards_per_page < 1 || options.shards_per_page > kMaxShardsPerPage) {
    return absl::InvalidArgumentError(absl::StrCat("radix index: shards_per_page ",
                                                   options.shards_per_page, " not in [1, ",
                                                   kMaxShardsPerPage, "]"));
  }
  if (!options.groups.empty() &&
      options.shards_per_page % static_cast<int>(options.groups.size()) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("radix index: shards_per_page ", options.shards_per_page,
                     " is not a multiple of the number of groups (", options.groups.size(), ")"));
  }
  for (size_t g = 0; g < options.groups.size(); ++g) {
    const GroupRule& rule = options.groups[g];
    if (rule.kind != GroupKind::kFull && rule.kind != GroupKind::kWindow &&
        rule.kind != GroupKind::kState) {
      return absl::InvalidArgumentError(absl::StrCat("radix index: groups[", g, "].kind ",
                                                     static_cast<int>(rule.kind), " is unknown"));
    }
    if (rule.kind != GroupKind::kWindow && rule.window_pages != 0) {
      return absl::InvalidArgumentError(absl::StrCat("radix index: groups[", g,
                                                     "].window_pages is ", rule.window_pages,
                                                     " for a group that has no window"));
    }
  }
  if (options.l3_tiers < 0 || options.l3_tiers > kMaxL3Tiers) {
    return absl::InvalidArgumentError(
        absl::StrCat("radix index: l3_tiers ", options.l3_tiers, " not in [0, ", kMaxL3Tiers, "]"));
  }
  if (options.object_bytes == 0) {
    return absl::InvalidArgumentError("radix index: object_bytes must be > 0");
  }
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark &&
        options.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("radix index: watermarks need 0 < low_watermark (", options.low_watermark,
                     ") <= high_watermark (", options.high_watermark, ") <= 1"));
  }
  if (policy == nullptr) return absl::InvalidArgumentError("radix index: policy is null");
  return std::unique_ptr<RadixIndex>(new RadixIndex(options, std::move(policy)));
}

RadixIndex::RadixIndex(const RadixIndexOptions& options, std::unique_ptr<EvictionPolicy> policy)
    : shards_per_page_(options.shards_per_page),
      groups_(options.groups.empty() ? std::vector<GroupRule>{GroupRule{}} : options.groups),
      hybrid_(groups_.size() > 1 || groups_[0].kind != GroupKind::kFull),
      l3_tiers_(options.l3_tiers),
      object_bytes_(options.object_bytes),
      high_watermark_(options.high_watermark),
      low_watermark_(options.low_watermark),
      policy_name_(policy->Name()),
      capacity_bytes_(options.capacity_bytes),
      slab_(
          std::make_unique<NodeSlab>(sizeof(Node) + sizeof(ShardState) * options.shards_per_page)),
      nodes_(0, NodeHash{slab_.get()}, NodeEq{slab_.get()}),
      policy_(std::move(policy)) {}

RadixIndex::~RadixIndex() = default;

absl::Status RadixIndex::CheckShardSet(ShardMask shards) const {
  if (shards == 0) return absl::InvalidArgumentError("match: shard set is empty");
  if ((shards & ~AllShards(shards_per_page_)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("match: shard set names shard ",
                                                   63 - std::countl_zero(shards),
                                                   " >= shards_per_page ", shards_per_page_));
  }
  return absl::OkStatus();
}

// --- Tree maintenance --------------------------------------------------------------------------

RadixIndex::Node* RadixIndex::Find(const PageKey& key, NodeId* id) const {
  auto it = nodes_.find(key);
  if (it == nodes_.end()) return nullptr;
  if (id != nullptr) *id = *it;
  return At(*it);
}

RadixIndex::Node* RadixIndex::FindChild(Node* parent, const PageKey& key, NodeId* id) const {
  int scanned = 0;
  for (NodeId c = parent->first_child; c != 0;) {
    Node* child = At(c);
    if (KeysEqual(child->key, key)) {
      if (id != nullptr) *id = c;
      return child;
    }
    if (++scanned == kChildScan) {
      NodeId found = 0;
      Node* n = Find(key, &found);
      if (n == nullptr || At(n->parent) != parent) return nullptr;
      if (id != nullptr) *id = found;
      return n;
    }
    c = child->next_sibling;
  }
  return nullptr;
}

RadixIndex::Node* RadixIndex::Seek(Cursor& cursor, const PageKey& key) const {
  if (Node* last = cursor.last; last != nullptr) {
    if (KeysEqual(last->key, key)) return last;
    if (Node* c = FindChild(last, key, &cursor.last_id); c != nullptr) return cursor.last = c;
  }
  Node* n = Find(key, &cursor.last_id);
  if (n != nullptr) cursor.last = n;
  return n;
}

absl::StatusOr<RadixIndex::Node*> RadixIndex::FindOrCreate(const PageKey& key,
                                                           const std::optional<PageKey>& parent,
                                                           Cursor& cursor) {
  if (parent.has_value() && *parent == key) {
    return absl::InvalidArgumentError(absl::StrCat("page ", ShortKey(key), " is its own parent"));
  }
  Node* p = parent.has_value() ? Seek(cursor, *parent) : nullptr;
  if (parent.has_value() && p == nullptr) {
    // Either way the request names a parent the page cannot have.
    return absl::FailedPreconditionError(
        Find(key) != nullptr
            ? absl::StrCat("page ", ShortKey(key), " is indexed under another parent")
            : absl::StrCat("page ", ShortKey(key), ": parent ", ShortKey(*parent),
                           " is not indexed"));
  }
  // Seek left p's id in the cursor.
  const NodeId p_id = p != nullptr ? cursor.last_id : 0;
  // One probe for both the lookup and the insertion of a new page.
  Node* created = nullptr;
  NodeId created_id = 0;
  NodeSlab* const slab = slab_.get();
  if (slab->Full() && Find(key) == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("page ", ShortKey(key), ": the index holds its maximum of 2^32 - 1 pages"));
  }
  auto it = nodes_.lazy_emplace(key, [&](const auto& construct) {
    auto [memory, id] = slab->Allocate();  // Not full: checked above.
    created = new (memory) Node;
    created->key = key;
    created_id = id;
    construct(id);
  });
  Node* n = At(*it);
  if (created == nullptr) {
    if (n->parent != p_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("page ", ShortKey(key), " is indexed under another parent"));
    }
    return n;
  }
  n->parent = p_id;
  // Double the set at 5/8 load rather than absl's 7/8. At a steady page count, erased pages
  // leave tombstones that absl clears with a whole-table rehash whenever its growth budget runs
  // out: near 7/8 load that came every ~15% of the capacity in inserts (19% of insert+evict time
  // in bench_index.cc); below 5/8, at most every ~25%. Costs up to ~6 bytes per page.
  if (nodes_.size() * 8 > nodes_.capacity() * 5) nodes_.reserve(nodes_.capacity());
  ShardState* shards = n->shards();
  for (int s = 0; s < shards_per_page_; ++s) new (&shards[s]) ShardState;
  if (p != nullptr) {
    n->next_sibling = p->first_child;
    if (p->first_child != 0) At(p->first_child)->prev_sibling = created_id;
    p->first_child = created_id;
  }
  ++counters_.pages;
  return n;
}

void RadixIndex::FreeNode(Node* n) {
  if (Node* p = At(n->parent); p != nullptr) {
    (n->prev_sibling != 0 ? At(n->prev_sibling)->next_sibling : p->first_child) = n->next_sibling;
    if (n->next_sibling != 0) At(n->next_sibling)->prev_sibling = n->prev_sibling;
  }
  const auto it = nodes_.find(n->key);
  const NodeId id = *it;
  nodes_.erase(it);
  if (!labels_.empty()) {
    if (auto it = labels_.find(n); it != labels_.end()) {
      label_bytes_ -= LabelBytes(*it->second);
      labels_.erase(it);
    }
  }
  n->~Node();
  slab_->Free(id);
  --counters_.pages;
}

void RadixIndex::CollectUpwards(Node* n) {
  // An empty leaf holds nothing and keeps up no descendant (a pinned page always holds L2).
  while (n != nullptr && n->Empty() && n->first_child == 0) {
    Node* p = At(n->parent);
    FreeNode(n);
    n = p;
  }
}

void RadixIndex::NotifyIfEvictable(Node* n) {
  if (n->Evictable()) policy_->OnEligible(&n->hook);
}

void RadixIndex::AfterL2Change(Node* n, bool held_l2_before) {
  const bool holds = n->HoldsL2();
  if (holds == held_l2_before || n->parent == 0) return;
  Node* p = At(n->parent);
  if (holds) {
    ++p->l2_children;
  } else if (--p->l2_children == 0) {
    NotifyIfEvictable(p);
  }
}

// --- Match -------------------------------------------------------------------------------------

absl::StatusOr<MatchResult> RadixIndex::Match(absl::Span<const PageKey> keys,
                                              const MatchOptions& options) {
  if (absl::Status s = CheckShardSet(options.shards); !s.ok()) return s;
  for (size_t g = 0; hybrid_ && g < groups_.size(); ++g) {
    if ((options.shards & GroupMask(g)) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("match: shard set names no object of group ", g));
    }
  }
  const ShardMask need = options.shards;
  MatchResult result;
  absl::MutexLock lock(&mu_);
  scratch_.clear();
  if (hybrid_) return MatchGroupsLocked(keys, options);

  // keys[i+1] must be a child of keys[i]: a sequence that is not a chain stops the match.
  const size_t slab_ahead = kSlabPrefetchNodes * slab_->node_bytes() + offsetof(Node, key);
  int far_links = 0;
  bool probing = false;             // Switched to pipelined hash probes.
  Node* ahead[kResolveAhead] = {};  // ahead[j % kResolveAhead]: Find(keys[j]), j in (i, i + 8].
  auto next = [&](Node* prev, size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Node* {
    if (probing) {
      Node* n = ahead[i % kResolveAhead];
      if (i + 2 * kResolveAhead < keys.size()) nodes_.prefetch(keys[i + 2 * kResolveAhead]);
      if (i + kResolveAhead < keys.size()) {
        ahead[i % kResolveAhead] = Find(keys[i + kResolveAhead]);
      }
      return n != nullptr && At(n->parent) == prev ? n : nullptr;
    }
    Node* n = FindChild(prev, keys[i]);
    if (n == nullptr) return n;
    // The key, and the links and shard masks read next (within the following line). Integer
    // arithmetic: the guess may lie past the end of n's chunk, where a prefetch is harmless.
    const uintptr_t guess = reinterpret_cast<uintptr_t>(n) + slab_ahead;
    __builtin_prefetch(reinterpret_cast<const void*>(guess));
    __builtin_prefetch(reinterpret_cast<const void*>(guess + 64));
    const auto distance = reinterpret_cast<uintptr_t>(n) - reinterpret_cast<uintptr_t>(prev);
    if (distance + kNearBytes > 2 * kNearBytes && ++far_links >= kFarLinks &&
        static_cast<size_t>(far_links) * kFarRatio > i) {
      probing = true;
      ++counters_.matches_probed;
      const size_t end = std::min(keys.size(), i + 1 + 2 * kResolveAhead);
      for (size_t j = i + 1; j < end; ++j) nodes_.prefetch(keys[j]);
      for (size_t j = i + 1; j < std::min(end, i + 1 + kResolveAhead); ++j) {
        ahead[j % kResolveAhead] = Find(keys[j]);
      }
    }
    return n;
  };

  // L2: every needed shard committed.
  size_t i = 0;
  Node* n = keys.empty() ? nullptr : Find(keys[0]);
  while (n != nullptr && (n->resident & need) == need && !n->doomed) {
    scratch_.push_back(n);
    if (++i == keys.size()) {
      n = nullptr;  // Whole query in L2: nothing left for L3.
      break;
    }
    n = next(n, i);
  }
  result.l2_pages = static_cast<uint32_t>(i);

  // L3, from the first page that missed L2: each tier's run of pages it holds every shard of.
  uint32_t active = (1u << l3_tiers_) - 1;
  while (n != nullptr && active != 0 && !n->doomed) {
    uint32_t have = active;
    for (ShardMask m = need; m != 0; m &= m - 1) have &= n->shards()[LowBit(m)].l3_tiers;
    active = have;
    for (uint32_t a = active; a != 0; a &= a - 1) ++result.l3_pages[LowBit(a)];
    if (++i == keys.size()) break;
    n = next(n, i);
  }
  for (int t = 0; t < l3_tiers_; ++t) {
    if (result.l3_pages[t] > result.best_l3_pages) {
      result.best_l3_pages = result.l3_pages[t];
      result.best_l3_tier = t;
    }
  }

  TouchAndPinHitLocked(options, &result);
  return result;
}

void RadixIndex::TouchAndPinHitLocked(const MatchOptions& options, MatchResult* result) {
  // Deepest page first, so that under LRU a parent ends up more recent than its children.
  for (size_t j = scratch_.size(); j-- > 0;) policy_->OnAccess(&scratch_[j]->hook);
  if (options.pin.has_value()) {
    for (Node* hit : scratch_) AddPin(hit, options.pin->owner, options.pin->deadline);
    result->pinned_pages = result->l2_pages;
  }
}

ShardMask RadixIndex::GroupMask(size_t g) const {
  const int per_group = shards_per_page_ / static_cast<int>(groups_.size());
  return AllShards(per_group) << (static_cast<int>(g) * per_group);
}

ShardMask RadixIndex::NeededObjects(ShardMask shards, uint32_t hit_pages, uint32_t page) const {
  if (!hybrid_) return shards;
  ShardMask needed = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupRule& rule = groups_[g];
    bool used = false;
    switch (rule.kind) {
      case GroupKind::kFull:
        used = page < hit_pages;
        break;
      case GroupKind::kWindow:
        used = page < hit_pages && page + rule.window_pages >= hit_pages;
        break;
      case GroupKind::kState:
        used = page + 1 == hit_pages;
        break;
    }
    if (used) needed |= shards & GroupMask(g);
  }
  return needed;
}

MatchResult RadixIndex::MatchGroupsLocked(absl::Span<const PageKey> keys,
                                          const MatchOptions& options) {
  MatchResult result;
  // The path: the chain's indexed pages holding some L2 or L3 copy (a tombstone or a doomed page
  // ends it: nothing after it can be loaded under one pin).
  Node* n = keys.empty() ? nullptr : Find(keys[0]);
  for (size_t i = 0; n != nullptr && (n->resident != 0 || n->l3_copies != 0) && !n->doomed;) {
    scratch_.push_back(n);
    if (++i == keys.size()) break;
    n = FindChild(n, keys[i]);
  }
  // Boundary b = i + 1 is a hit when every full group has pages [0, b), every window group its
  // last min(b, window_pages) pages before b, and every state group page b - 1.
  ShardMask full_need = 0;
  ShardMask state_need = 0;
  absl::InlinedVector<std::pair<ShardMask, uint32_t>, 4> windows;  // (needed objects, pages)
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ShardMask need = options.shards & GroupMask(g);
    switch (groups_[g].kind) {
      case GroupKind::kFull:
        full_need |= need;
        break;
      case GroupKind::kWindow:
        windows.push_back({need, groups_[g].window_pages});
        break;
      case GroupKind::kState:
        state_need |= need;
        break;
    }
  }
  absl::InlinedVector<uint32_t, 4> runs(windows.size(), 0);
  // The longest boundary over the objects have(page) says are there; a page holding none of
  // them ends the walk.
  auto longest = [&](auto have_of) {
    std::fill(runs.begin(), runs.end(), 0);
    uint32_t hit = 0;
    for (size_t i = 0; i < scratch_.size(); ++i) {
      const ShardMask have = have_of(scratch_[i]);
      if (have == 0 || (have & full_need) != full_need) break;
      bool ok = (have & state_need) == state_need;
      for (size_t w = 0; w < windows.size(); ++w) {
        runs[w] = (have & windows[w].first) == windows[w].first ? runs[w] + 1 : 0;
        ok = ok && runs[w] >= std::min<uint32_t>(static_cast<uint32_t>(i + 1), windows[w].second);
      }
      if (ok) hit = static_cast<uint32_t>(i + 1);
    }
    return hit;
  };
  const uint32_t hit = longest([](const Node* p) { return p->resident; });
  // Per tier: how far the boundary reaches over L2 and that tier together. The objects a
  // prefetch reads for it are those NeededObjects names that L2 lacks; the window pages before
  // the L2 boundary are in L2 by the L2 hit's own rule.
  for (int t = 0; t < l3_tiers_; ++t) {
    const uint8_t bit = uint8_t{1} << t;
    const uint32_t reach = longest([&](const Node* p) {
      ShardMask have = p->resident;
      const ShardState* shards = p->shards();
      for (int s = 0; s < shards_per_page_; ++s) {
        if ((shards[s].l3_tiers & bit) != 0) have |= ShardMask{1} << s;
      }
      return have;
    });
    result.l3_pages[t] = reach > hit ? reach - hit : 0;
    if (result.l3_pages[t] > result.best_l3_pages) {
      result.best_l3_pages = result.l3_pages[t];
      result.best_l3_tier = t;
    }
  }
  scratch_.resize(hit);
  result.l2_pages = hit;
  TouchAndPinHitLocked(options, &result);
  return result;
}

// --- Writes ------------------------------------------------------------------------------------

absl::Status RadixIndex::BeginWriteLocked(const WriteRequest& request, Cursor& cursor) {
  if (request.shard >= shards_per_page_) {
    return absl::InvalidArgumentError(
        absl::StrCat("write: shard ", request.shard, " >= shards_per_page ", shards_per_page_));
  }
  if (!request.slot.valid()) return absl::InvalidArgumentError("write: slot is invalid");
  absl::StatusOr<Node*> found = FindOrCreate(request.key, request.parent, cursor);
  if (!found.ok()) return found.status();
  Node* n = *found;
  const ShardMask bit = ShardMask{1} << request.shard;
  if (n->HoldsSlot(request.shard)) {
    return absl::AlreadyExistsError(
        absl::StrCat("write: page ", ShortKey(request.key), " shard ", request.shard,
                     (n->resident & bit) ? " is in L2" : " is being written"));
  }
  const bool held = n->HoldsL2();
  ++n->writing;
  ShardState& s = n->shards()[request.shard];
  s.slot = request.slot;
  s.write_kind = request.kind;
  ++counters_.l2_inflight_objects;
  AfterL2Change(n, held);
  return absl::OkStatus();
}

size_t RadixIndex::BeginWrite(absl::Span<const WriteRequest> requests,
                              absl::Span<absl::Status> statuses) {
  size_t accepted = 0;
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  // A new page's insertion probes the hash set at a random place: a cache miss once the index
  // outgrows the caches. Prefetching the probe of the request kWriteAhead later overlaps them
  // (a 2048-page Backup into a 10M-page index: 633 -> 293 us p50, bench_index.cc BM_IndexScale).
  for (size_t i = 0; i < std::min(requests.size(), kWriteAhead); ++i) {
    nodes_.prefetch(requests[i].key);
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    if (i + kWriteAhead < requests.size()) nodes_.prefetch(requests[i + kWriteAhead].key);
    statuses[i] = BeginWriteLocked(requests[i], cursor);
    accepted += statuses[i].ok();
  }
  return accepted;
}

absl::Status RadixIndex::BeginWrite(const WriteRequest& request) {
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  return BeginWriteLocked(request, cursor);
}

absl::Status RadixIndex::CommitLocked(const ObjectId& object, Cursor& cursor) {
  Node* n = object.shard < shards_per_page_ ? Seek(cursor, object.key) : nullptr;
  if (n == nullptr || !n->Writing(object.shard)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "commit: page ", ShortKey(object.key), " shard ", object.shard, " is not in flight"));
  }
  --n->writing;
  const ShardMask before = n->resident;
  const bool first = before == 0;
  n->resident |= ShardMask{1} << object.shard;
  --counters_.l2_inflight_objects;
  ++counters_.l2_objects;
  if (first) {
    ++counters_.l2_pages;
    policy_->OnInsert(&n->hook, KeyFingerprint(n->key));
  } else {
    NotifyIfEvictable(n);  // It may have been parked for this shard's write.
  }
  if (sink_ != nullptr && (first || hybrid_)) {
    EmitL2(IndexEvent::Kind::kStored, n, before, n->resident);
  }
  return absl::OkStatus();
}

size_t RadixIndex::Commit(absl::Span<const ObjectId> objects, absl::Span<absl::Status> statuses) {
  size_t committed = 0;
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  for (size_t i = 0; i < objects.size(); ++i) {
    statuses[i] = CommitLocked(objects[i], cursor);
    committed += statuses[i].ok();
  }
  return committed;
}

absl::Status RadixIndex::Commit(const ObjectId& object) {
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  return CommitLocked(object, cursor);
}

size_t RadixIndex::Abort(absl::Span<const ObjectId> objects,
                         std::vector<ReleasedObject>* released) {
  size_t aborted = 0;
  absl::MutexLock lock(&mu_);
  for (const ObjectId& object : objects) {
    if (object.shard >= shards_per_page_) continue;
    Node* n = Find(object.key);
    if (n == nullptr || !n->Writing(object.shard)) continue;
    const bool held = n->HoldsL2();
    --n->writing;
    ShardState& s = n->shards()[object.shard];
    released->push_back({n->key, object.shard, s.slot, s.l3_tiers});
    s.slot = SlotRef{};
    --counters_.l2_inflight_objects;
    ++aborted;
    AfterL2Change(n, held);
    NotifyIfEvictable(n);
    CollectUpwards(n);
  }
  return aborted;
}

// --- Pins --------------------------------------------------------------------------------------

void RadixIndex::AddPin(Node* n, OwnerId owner, absl::Time deadline) {
  if (n->pins == 0) {
    n->pin_slot = static_cast<uint32_t>(pinned_.size());
    pinned_.push_back({n, {}});
    ++counters_.pinned_pages;
  }
  PinList& list = pinned_[n->pin_slot].entries;
  auto it = std::find_if(list.begin(), list.end(),
                         [owner](const PinEntry& e) { return e.owner == owner; });
  if (it != list.end()) {
    ++it->count;
    it->deadline = std::max(it->deadline, deadline);
  } else {
    list.push_back({owner, deadline, 1});
  }
  ++n->pins;
  ++counters_.pins;
}

void RadixIndex::DropPins(Node* n, uint32_t count) {
  n->pins -= count;
  counters_.pins -= count;
  if (n->pins != 0) return;
  // Swap-remove the record: pinned_ stays dense, so sweeps cost O(pinned pages).
  const uint32_t slot = n->pin_slot;
  if (slot + 1 != pinned_.size()) {
    pinned_[slot] = std::move(pinned_.back());
    pinned_[slot].node->pin_slot = slot;
  }
  pinned_.pop_back();
  --counters_.pinned_pages;
  NotifyIfEvictable(n);
}

size_t RadixIndex::Pin(OwnerId owner, absl::Span<const PageKey> keys, absl::Time deadline) {
  size_t pinned = 0;
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  for (const PageKey& key : keys) {
    Node* n = Seek(cursor, key);
    if (n == nullptr || n->resident == 0) continue;
    AddPin(n, owner, deadline);
    ++pinned;
  }
  return pinned;
}

size_t RadixIndex::Unpin(OwnerId owner, absl::Span<const PageKey> keys) {
  size_t dropped = 0;
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  for (const PageKey& key : keys) {
    Node* n = Seek(cursor, key);
    if (n == nullptr || n->pins == 0) continue;
    PinList& list = pinned_[n->pin_slot].entries;
    auto e = std::find_if(list.begin(), list.end(),
                          [owner](const PinEntry& p) { return p.owner == owner; });
    if (e == list.end()) continue;
    if (--e->count == 0) list.erase(e);
    DropPins(n, 1);  // Removes the record when that was the page's last pin.
    ++dropped;
  }
  return dropped;
}

template <typename Pred>
size_t RadixIndex::DropPinsWhere(Pred pred) {
  size_t dropped = 0;
  // Backwards: DropPins swap-removes record i with the last one, which was already visited.
  for (size_t i = pinned_.size(); i-- > 0;) {
    PinList& list = pinned_[i].entries;
    uint32_t gone = 0;
    for (size_t k = 0; k < list.size();) {
      if (pred(list[k])) {
        gone += list[k].count;
        ++dropped;
        list.erase(list.begin() + k);
      } else {
        ++k;
      }
    }
    if (gone != 0) DropPins(pinned_[i].node, gone);
  }
  return dropped;
}

size_t RadixIndex::ExpireLeases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  const size_t dropped = DropPinsWhere([now](const PinEntry& e) { return e.deadline <= now; });
  counters_.expired_pins += dropped;
  return dropped;
}

size_t RadixIndex::ReleaseOwner(OwnerId owner) {
  absl::MutexLock lock(&mu_);
  return DropPinsWhere([owner](const PinEntry& e) { return e.owner == owner; });
}

// --- L3 ----------------------------------------------------------------------------------------

absl::Status RadixIndex::UpdateL3Locked(const L3Update& update) {
  if (update.shard >= shards_per_page_) {
    return absl::InvalidArgumentError(
        absl::StrCat("l3 update: shard ", update.shard, " >= shards_per_page ", shards_per_page_));
  }
  if (update.tier >= l3_tiers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("l3 update: tier ", update.tier, " >= l3_tiers ", l3_tiers_));
  }
  const uint8_t bit = uint8_t{1} << update.tier;
  Node* n = Find(update.key);
  if (update.present) {
    if (n == nullptr) {
      Cursor cursor;
      absl::StatusOr<Node*> created = FindOrCreate(update.key, update.parent, cursor);
      if (!created.ok()) return created.status();
      n = *created;
    }
    if (update.label != nullptr) AttachLabelLocked(n, update.label, /*max_label_bytes=*/0);
    ShardState& s = n->shards()[update.shard];
    if ((s.l3_tiers & bit) == 0) {
      EmitL3(IndexEvent::Kind::kStored, n, update.shard, update.tier);  // Before: first copy?
      s.l3_tiers |= bit;
      ++n->l3_copies;
      ++counters_.l3_objects[update.tier];
    }
    return absl::OkStatus();
  }
  if (n == nullptr) return absl::OkStatus();
  ShardState& s = n->shards()[update.shard];
  if ((s.l3_tiers & bit) != 0) {
    s.l3_tiers &= ~bit;
    --n->l3_copies;
    --counters_.l3_objects[update.tier];
    EmitL3(IndexEvent::Kind::kRemoved, n, update.shard, update.tier);  // After: last copy?
    CollectUpwards(n);
  }
  return absl::OkStatus();
}

size_t RadixIndex::UpdateL3(absl::Span<const L3Update> updates, absl::Span<absl::Status> statuses) {
  size_t applied = 0;
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < updates.size(); ++i) {
    statuses[i] = UpdateL3Locked(updates[i]);
    applied += statuses[i].ok();
  }
  return applied;
}

// --- Eviction ----------------------------------------------------------------------------------

size_t RadixIndex::EvictOne(std::vector<ReleasedObject>* evicted) {
  const Candidates candidates;
  EvictionHook* h = policy_->PickVictim(candidates);
  if (h == nullptr) return 0;
  return EvictNode(Node::FromHook(h), evicted);
}

size_t RadixIndex::EvictNode(Node* n, std::vector<ReleasedObject>* evicted) {
  size_t objects = 0;
  ShardState* shards = n->shards();
  for (ShardMask m = n->resident; m != 0; m &= m - 1) {
    const int s = LowBit(m);
    evicted->push_back({n->key, static_cast<uint16_t>(s), shards[s].slot, shards[s].l3_tiers});
    shards[s].slot = SlotRef{};
    ++objects;
  }
  const ShardMask before = n->resident;
  n->resident = 0;
  n->doomed = false;  // Its L2 copies are gone; a later write makes it visible again.
  counters_.l2_objects -= objects;
  --counters_.l2_pages;
  if (sink_ != nullptr) EmitL2(IndexEvent::Kind::kRemoved, n, before, 0);
  ++counters_.evicted_pages;
  counters_.evicted_objects += objects;
  AfterL2Change(n, /*held_l2_before=*/true);
  CollectUpwards(n);  // Stays as a tombstone while an L3 tier holds it or it has children.
  return objects;
}

size_t RadixIndex::EvictPages(size_t max_pages, std::vector<ReleasedObject>* evicted) {
  absl::MutexLock lock(&mu_);
  size_t pages = 0;
  while (pages < max_pages && EvictOne(evicted) != 0) ++pages;
  return pages;
}

uint64_t RadixIndex::EvictBytesLocked(uint64_t bytes, std::vector<ReleasedObject>* evicted) {
  uint64_t freed = 0;
  while (freed < bytes) {
    const size_t objects = EvictOne(evicted);
    if (objects == 0) break;
    freed += objects * object_bytes();
  }
  return freed;
}

uint64_t RadixIndex::EvictBytes(uint64_t bytes, std::vector<ReleasedObject>* evicted) {
  absl::MutexLock lock(&mu_);
  return EvictBytesLocked(bytes, evicted);
}

HolderEvictResult RadixIndex::EvictHolders(absl::Span<const SlotHolder> holders, bool dry_run,
                                           std::vector<ReleasedObject>* evicted) {
  HolderEvictResult result;
  absl::MutexLock lock(&mu_);
  // The holder pages and every descendant reachable through pages holding L2. All the L2-holding
  // children of a page in the set are in the set, so `waiting` (its children in the set not gone
  // yet) starts at l2_children and the set empties bottom-up (Kahn's order: a page goes once its
  // last L2 child went). A tombstone child holds nothing and blocks nothing: not entered.
  absl::flat_hash_map<Node*, uint32_t> waiting;
  absl::flat_hash_set<Node*> holder_pages;
  std::vector<Node*> stack;
  for (const SlotHolder& h : holders) {
    Node* n = h.shard < shards_per_page_ ? Find(h.key) : nullptr;
    if (n == nullptr || !n->HoldsSlot(h.shard) || !(n->shards()[h.shard].slot == h.slot)) {
      ++result.absent;
      continue;
    }
    ++result.held;
    holder_pages.insert(n);
    stack.push_back(n);
    while (!stack.empty()) {
      Node* m = stack.back();
      stack.pop_back();
      if (!waiting.try_emplace(m, m->l2_children).second) continue;
      for (Node* c = At(m->first_child); c != nullptr; c = At(c->next_sibling)) {
        if (c->HoldsL2()) stack.push_back(c);
      }
    }
  }
  std::vector<Node*> ready;
  for (const auto& [n, w] : waiting) {
    if (w == 0 && n->resident != 0 && !n->Busy()) ready.push_back(n);
  }
  // Pages that went; those may be freed by now (EvictNode collects empty leaves), so after
  // this loop only their addresses are compared, never dereferenced.
  absl::flat_hash_set<const Node*> gone;
  while (!ready.empty()) {
    Node* n = ready.back();
    ready.pop_back();
    Node* p = At(n->parent);
    ++result.pages;
    gone.insert(n);
    if (dry_run) {
      result.objects += static_cast<uint64_t>(std::popcount(n->resident));
    } else {
      policy_->OnRemove(&n->hook);  // EvictNode takes a page the policy no longer tracks.
      result.objects += EvictNode(n, evicted);
    }
    // p, if in the set, still holds L2 (it has not gone), so EvictNode did not free it.
    auto it = p != nullptr ? waiting.find(p) : waiting.end();
    if (it != waiting.end() && --it->second == 0 && p->resident != 0 && !p->Busy()) {
      ready.push_back(p);
    }
  }
  for (const Node* n : holder_pages) result.blocked += !gone.contains(n);
  return result;
}

void RadixIndex::SetEventSink(IndexEventSink* sink) {
  absl::MutexLock lock(&mu_);
  sink_ = sink;
}

void RadixIndex::EmitL2(IndexEvent::Kind kind, const Node* n, ShardMask before, ShardMask after) {
  if (!hybrid_) {
    Emit(kind, kMediumL2, n);
    return;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ShardMask mask = GroupMask(g);
    if (((before & mask) != 0) != ((after & mask) != 0)) {
      Emit(kind, kMediumL2, n, static_cast<int16_t>(g));
    }
  }
}

void RadixIndex::Emit(IndexEvent::Kind kind, int8_t medium, const Node* n, int16_t group,
                      uint8_t l3_tiers) {
  IndexEvent event;
  event.kind = kind;
  event.medium = medium;
  event.group = group;
  event.l3_tiers = l3_tiers;
  event.key = n->key;
  event.hash = HashOf(n, labels_.empty() ? nullptr : &event.label);
  if (const Node* p = At(n->parent); kind == IndexEvent::Kind::kStored && p != nullptr) {
    event.has_parent = true;
    event.parent = p->key;
    event.parent_hash = HashOf(p, nullptr);
  }
  sink_->OnIndexEvent(event);
}

uint64_t RadixIndex::HashOf(const Node* n, std::shared_ptr<const PageLabel>* label) const {
  if (!labels_.empty()) {
    if (auto it = labels_.find(n); it != labels_.end()) {
      if (label != nullptr) *label = it->second;
      if (it->second->has_engine_hash) return it->second->engine_hash;
    }
  }
  return IntBlockHash(n->key);
}

uint64_t RadixIndex::LabelBytes(const PageLabel& label) {
  // The map's slot (key and shared_ptr) and the shared_ptr's control block beside the label.
  return label.MemoryBytes() + sizeof(const Node*) + sizeof(std::shared_ptr<const PageLabel>) + 16;
}

size_t RadixIndex::Label(absl::Span<const PageKey> keys,
                         absl::Span<const std::shared_ptr<const PageLabel>> labels,
                         uint64_t max_label_bytes, std::vector<bool>* attached) {
  size_t count = 0;
  if (attached != nullptr) attached->assign(keys.size(), false);
  absl::MutexLock lock(&mu_);
  Cursor cursor;
  for (size_t i = 0; i < keys.size() && i < labels.size(); ++i) {
    if (labels[i] == nullptr) continue;
    Node* n = Seek(cursor, keys[i]);
    if (n == nullptr) continue;
    if (!AttachLabelLocked(n, labels[i], max_label_bytes)) continue;
    if (attached != nullptr) (*attached)[i] = true;
    ++count;
  }
  return count;
}

bool RadixIndex::AttachLabelLocked(const Node* n, const std::shared_ptr<const PageLabel>& label,
                                   uint64_t max_label_bytes) {
  if (labels_.contains(n)) return false;
  const uint64_t bytes = LabelBytes(*label);
  if (max_label_bytes != 0 && label_bytes_ + bytes > max_label_bytes) return false;
  labels_.emplace(n, label);
  label_bytes_ += bytes;
  return true;
}

void RadixIndex::ForEachLabel(
    absl::FunctionRef<void(const PageKey& key, const std::shared_ptr<const PageLabel>& label)> fn)
    const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [node, label] : labels_) fn(node->key, label);
}

std::shared_ptr<const PageLabel> RadixIndex::LabelOf(const PageKey& key) const {
  absl::ReaderMutexLock lock(&mu_);
  const Node* n = Find(key);
  if (n == nullptr) return nullptr;
  auto it = labels_.find(n);
  return it == labels_.end() ? nullptr : it->second;
}

uint8_t RadixIndex::PageTiers(const Node* n, ShardMask mask) const {
  uint8_t tiers = 0;
  const ShardState* shards = n->shards();
  for (ShardMask m = mask & AllShards(shards_per_page_); m != 0; m &= m - 1) {
    tiers |= shards[LowBit(m)].l3_tiers;
  }
  return tiers;
}

void RadixIndex::EmitL3(IndexEvent::Kind kind, const Node* n, uint16_t shard, uint8_t tier) {
  if (sink_ == nullptr) return;
  const uint8_t tiers = PageTiers(n, GroupMask(GroupOf(shard)));
  if ((tiers >> tier & 1) != 0) return;  // Another copy there still speaks for it.
  // Stored: called before the copy is added; removed: after the last one went.
  const uint8_t after =
      kind == IndexEvent::Kind::kStored ? static_cast<uint8_t>(tiers | 1u << tier) : tiers;
  Emit(kind, static_cast<int8_t>(tier), n, hybrid_ ? static_cast<int16_t>(GroupOf(shard)) : -1,
       after);
}

uint64_t RadixIndex::L2BytesLocked() const {
  return (counters_.l2_objects + counters_.l2_inflight_objects) * object_bytes();
}

void RadixIndex::SetCapacity(uint64_t capacity_bytes) {
  absl::MutexLock lock(&mu_);
  capacity_bytes_ = capacity_bytes;
}

bool RadixIndex::NeedsEviction() const {
  absl::ReaderMutexLock lock(&mu_);
  return capacity_bytes_ != 0 && static_cast<double>(L2BytesLocked()) >
                                     high_watermark_ * static_cast<double>(capacity_bytes_);
}

uint64_t RadixIndex::EvictToLowWatermark(std::vector<ReleasedObject>* evicted) {
  absl::MutexLock lock(&mu_);
  if (capacity_bytes_ == 0) return 0;
  const auto target = static_cast<uint64_t>(low_watermark_ * static_cast<double>(capacity_bytes_));
  const uint64_t used = L2BytesLocked();
  return used > target ? EvictBytesLocked(used - target, evicted) : 0;
}

// --- Removal -----------------------------------------------------------------------------------

void RadixIndex::DropCopies(Node* n, std::vector<ReleasedObject>* released) {
  const bool held = n->HoldsL2();
  // Per group (the page as a whole without groups): the tiers whose copies go.
  absl::InlinedVector<uint8_t, 4> tiers(groups_.size(), 0);
  for (size_t g = 0; sink_ != nullptr && g < groups_.size(); ++g) {
    tiers[g] = PageTiers(n, GroupMask(g));
  }
  ShardState* shards = n->shards();
  for (int s = 0; s < shards_per_page_; ++s) {
    const bool resident = (n->resident >> s) & 1;
    if (!resident && shards[s].l3_tiers == 0) continue;
    released->push_back({n->key, static_cast<uint16_t>(s), shards[s].slot, shards[s].l3_tiers});
    if (resident) --counters_.l2_objects;
    for (uint32_t t = shards[s].l3_tiers; t != 0; t &= t - 1) --counters_.l3_objects[LowBit(t)];
    shards[s] = ShardState{};
  }
  n->l3_copies = 0;
  n->doomed = false;
  if (n->resident != 0) {
    const ShardMask before = n->resident;
    n->resident = 0;
    --counters_.l2_pages;
    policy_->OnRemove(&n->hook);
    if (sink_ != nullptr) EmitL2(IndexEvent::Kind::kRemoved, n, before, 0);
  }
  for (size_t g = 0; g < tiers.size(); ++g) {
    for (uint32_t t = tiers[g]; t != 0; t &= t - 1) {
      // The tiers not announced yet are the ones left.
      Emit(IndexEvent::Kind::kRemoved, static_cast<int8_t>(LowBit(t)), n,
           hybrid_ ? static_cast<int16_t>(g) : -1, static_cast<uint8_t>(t & (t - 1)));
    }
  }
  AfterL2Change(n, held);
}

RemoveCounts RadixIndex::RemovePages(absl::Span<const PageKey> keys,
                                     std::vector<ReleasedObject>* released) {
  RemoveCounts counts;
  absl::MutexLock lock(&mu_);
  for (const PageKey& key : keys) {
    Node* n = Find(key);
    if (n == nullptr) {
      ++counts.missing_keys;
    } else if (n->Busy()) {
      ++counts.busy_pages;
    } else {
      DropCopies(n, released);
      ++counts.removed_pages;
      CollectUpwards(n);
    }
  }
  return counts;
}

void RadixIndex::RemoveSubtreeLocked(Node* root, std::vector<ReleasedObject>* released,
                                     RemoveCounts* counts) {
  // Pre-order (each node before its descendants), then processed in reverse, so every node is
  // handled after all of its descendants. Iterative: chains can be 100k pages deep.
  std::vector<Node*> order;
  std::vector<Node*> stack = {root};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    order.push_back(n);
    for (Node* c = At(n->first_child); c != nullptr; c = At(c->next_sibling)) stack.push_back(c);
  }
  Node* above = At(root->parent);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* n = *it;
    if (n->Busy()) {
      ++counts->busy_pages;
      continue;
    }
    DropCopies(n, released);
    ++counts->removed_pages;
    // Not busy, so now empty: it goes unless a busy descendant keeps it. Its parent is
    // processed later, or is `above`, collected below.
    if (n->first_child == 0) FreeNode(n);
  }
  CollectUpwards(above);
}

RemoveCounts RadixIndex::RemoveSubtree(const PageKey& key, std::vector<ReleasedObject>* released) {
  RemoveCounts counts;
  absl::MutexLock lock(&mu_);
  Node* root = Find(key);
  if (root == nullptr) {
    counts.missing_keys = 1;
  } else {
    RemoveSubtreeLocked(root, released, &counts);
  }
  return counts;
}

RemoveCounts RadixIndex::Clear(std::vector<ReleasedObject>* released) {
  RemoveCounts counts;
  absl::MutexLock lock(&mu_);
  std::vector<Node*> roots;
  for (NodeId id : nodes_) {
    if (Node* n = At(id); n->parent == 0) roots.push_back(n);
  }
  for (Node* root : roots) RemoveSubtreeLocked(root, released, &counts);
  return counts;
}

// --- Admin scope -------------------------------------------------------------------------------

void RadixIndex::ScopeNodesLocked(const std::optional<PageKey>& subtree,
                                  std::vector<Node*>* order) const {
  std::vector<Node*> stack;
  if (subtree.has_value()) {
    if (Node* root = Find(*subtree); root != nullptr) stack.push_back(root);
  } else {
    for (NodeId id : nodes_) {
      if (Node* n = At(id); n->parent == 0) stack.push_back(n);
    }
  }
  // Pre-order: every node before its descendants. Iterative: chains can be 100k pages deep.
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    order->push_back(n);
    for (Node* c = At(n->first_child); c != nullptr; c = At(c->next_sibling)) stack.push_back(c);
  }
}

ScopeUsage RadixIndex::Usage(const std::optional<PageKey>& subtree) const {
  ScopeUsage usage;
  absl::ReaderMutexLock lock(&mu_);
  std::vector<Node*> order;
  ScopeNodesLocked(subtree, &order);
  for (const Node* n : order) {
    if (n->resident == 0) continue;
    ++usage.l2_pages;
    usage.l2_objects += static_cast<uint64_t>(std::popcount(n->resident));
  }
  return usage;
}

std::vector<PageKey> RadixIndex::ScopeKeys(const std::optional<PageKey>& subtree) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<Node*> order;
  ScopeNodesLocked(subtree, &order);
  std::vector<PageKey> keys;
  keys.reserve(order.size());
  for (const Node* n : order) keys.push_back(n->key);
  return keys;
}

AdminEvictResult RadixIndex::EvictScope(const std::optional<PageKey>& subtree,
                                        uint64_t max_objects, bool dry_run,
                                        std::vector<ReleasedObject>* evicted) {
  AdminEvictResult result;
  absl::MutexLock lock(&mu_);
  std::vector<Node*> order;
  ScopeNodesLocked(subtree, &order);
  for (const Node* n : order) {
    if (!n->HoldsL2() || !n->Busy()) continue;
    if (n->pins != 0) {
      ++result.skipped_pinned_pages;
    } else {
      ++result.skipped_in_flight_pages;
    }
  }
  const auto done = [&] { return max_objects != 0 && result.objects >= max_objects; };

  if (dry_run) {
    // What the real run would take: pages that become evictable once their L2 children are gone
    // (children before parents: reverse pre-order). With a target, the policy picks which; every
    // page of a namespace has the same size, so the count is the same whichever it picks.
    absl::flat_hash_set<const Node*> blocked;  // Holds L2 that will stay.
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const Node* n = *it;
      if (!n->HoldsL2()) continue;
      bool stays = n->resident == 0 || n->Busy();
      for (const Node* c = At(n->first_child); c != nullptr && !stays; c = At(c->next_sibling)) {
        stays = blocked.contains(c);
      }
      if (stays) {
        blocked.insert(n);
      } else if (!done()) {
        ++result.pages;
        result.objects += static_cast<uint64_t>(std::popcount(n->resident));
      }
    }
    return result;
  }

  // The policy's own order (PickVictim), restricted to the scope. Out-of-scope pages it offers
  // are refused, which parks them; they are unparked afterwards, back at the tail in their order,
  // so the next ordinary eviction sees the queue as it was.
  class ScopedCandidates final : public EvictionCandidates {
   public:
    ScopedCandidates(const absl::flat_hash_set<const Node*>* scope, std::vector<Node*>* refused)
        : scope_(scope), refused_(refused) {}
    bool Evictable(const EvictionHook& hook) const override {
      const Node* n = Node::FromHook(&hook);
      if (!n->Evictable()) return false;
      if (scope_ == nullptr || scope_->contains(n)) return true;
      refused_->push_back(const_cast<Node*>(n));
      return false;
    }
    uint64_t Fingerprint(const EvictionHook& hook) const override {
      return KeyFingerprint(Node::FromHook(&hook)->key);
    }

   private:
    const absl::flat_hash_set<const Node*>* scope_;
    std::vector<Node*>* refused_;
  };
  absl::flat_hash_set<const Node*> scope;
  if (subtree.has_value()) {
    if (order.empty()) return result;
    scope.insert(order.begin(), order.end());
  }
  std::vector<Node*> refused;
  const ScopedCandidates candidates(subtree.has_value() ? &scope : nullptr, &refused);
  while (!done()) {
    EvictionHook* h = policy_->PickVictim(candidates);
    if (h == nullptr) break;
    ++result.pages;
    result.objects += EvictNode(Node::FromHook(h), evicted);
  }
  for (auto it = refused.rbegin(); it != refused.rend(); ++it) policy_->OnEligible(&(*it)->hook);
  return result;
}

RemoveCounts RadixIndex::ClearScope(const std::optional<PageKey>& subtree, bool dry_run,
                                    std::vector<ReleasedObject>* released) {
  RemoveCounts counts;
  absl::MutexLock lock(&mu_);
  std::vector<Node*> order;
  ScopeNodesLocked(subtree, &order);
  if (subtree.has_value() && order.empty()) {
    counts.missing_keys = 1;
    return counts;
  }
  if (dry_run) {
    for (const Node* n : order) {
      if (n->Empty()) continue;
      // The real call runs after the caller revoked the Match pins, so a pinned page counts as
      // removed; only a write in flight is sure to defer it (a Load's copy pin, which the dry
      // run cannot tell from a Match pin, is short-lived).
      if (n->writing != 0) {
        ++counts.busy_pages;
        continue;
      }
      ++counts.removed_pages;
      for (int s = 0; s < shards_per_page_; ++s) {
        const ShardState& st = n->shards()[s];
        if (n->HoldsSlot(s) || st.l3_tiers != 0) {
          released->push_back({n->key, static_cast<uint16_t>(s), st.slot, st.l3_tiers});
        }
      }
    }
    return counts;
  }
  // Doom the busy pages first (RemoveSubtreeLocked leaves them as they are).
  for (Node* n : order) {
    if (n->Busy() && !n->Empty() && !n->doomed) {
      n->doomed = true;
      doomed_.push_back(n->key);
    }
  }
  Node* above = subtree.has_value() ? At(order.front()->parent) : nullptr;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* n = *it;
    if (n->Busy()) {
      counts.busy_pages += !n->Empty();
      continue;
    }
    if (!n->Empty()) ++counts.removed_pages;
    DropCopies(n, released);
    if (n->first_child == 0) FreeNode(n);
  }
  if (above != nullptr) CollectUpwards(above);
  return counts;
}

size_t RadixIndex::ReapDoomed(std::vector<ReleasedObject>* released) {
  absl::MutexLock lock(&mu_);
  size_t reaped = 0;
  size_t kept = 0;
  for (const PageKey& key : doomed_) {
    Node* n = Find(key);
    if (n == nullptr || !n->doomed) continue;  // Evicted or removed meanwhile.
    if (n->Busy()) {
      doomed_[kept++] = key;
      continue;
    }
    DropCopies(n, released);  // Clears `doomed`.
    ++reaped;
    CollectUpwards(n);
  }
  doomed_.resize(kept);
  return reaped;
}

size_t RadixIndex::DoomedPages() const {
  absl::ReaderMutexLock lock(&mu_);
  return doomed_.size();
}

// --- Queries -----------------------------------------------------------------------------------

size_t RadixIndex::GetL2Slots(absl::Span<const PageKey> keys, uint16_t shard,
                              absl::Span<SlotRef> slots) const {
  size_t found = 0;
  absl::ReaderMutexLock lock(&mu_);
  Cursor cursor;
  for (size_t i = 0; i < keys.size(); ++i) {
    const Node* n = shard < shards_per_page_ ? Seek(cursor, keys[i]) : nullptr;
    if (n != nullptr && ((n->resident >> shard) & 1)) {
      slots[i] = n->shards()[shard].slot;
      ++found;
    } else {
      slots[i] = SlotRef{};
    }
  }
  return found;
}

size_t RadixIndex::GetParents(absl::Span<const PageKey> keys,
                              absl::Span<std::optional<PageKey>> parents) const {
  size_t found = 0;
  absl::ReaderMutexLock lock(&mu_);
  Cursor cursor;
  for (size_t i = 0; i < keys.size(); ++i) {
    const Node* n = Seek(cursor, keys[i]);
    parents[i] = std::nullopt;
    if (n == nullptr) continue;
    ++found;
    if (const Node* p = At(n->parent); p != nullptr) parents[i] = p->key;
  }
  return found;
}

std::optional<PageInfo> RadixIndex::Inspect(const PageKey& key) const {
  absl::ReaderMutexLock lock(&mu_);
  const Node* n = Find(key);
  if (n == nullptr) return std::nullopt;
  PageInfo info;
  info.key = n->key;
  if (const Node* p = At(n->parent); p != nullptr) info.parent = p->key;
  for (const Node* c = At(n->first_child); c != nullptr; c = At(c->next_sibling)) ++info.children;
  info.l2_children = n->l2_children;
  info.pins = n->pins;
  info.evictable = n->Evictable();
  info.shards.resize(shards_per_page_);
  for (int s = 0; s < shards_per_page_; ++s) {
    ShardInfo& si = info.shards[s];
    const ShardState& st = n->shards()[s];
    si.l2 = ((n->resident >> s) & 1) ? L2State::kResident
            : n->Writing(s)          ? L2State::kWriting
                                     : L2State::kAbsent;
    si.write_kind = st.write_kind;
    si.slot = st.slot;
    si.l3_tiers = st.l3_tiers;
  }
  return info;
}

uint64_t RadixIndex::MemoryBytesLocked() const {
  return sizeof(*this) + slab_->MemoryBytes() + nodes_.capacity() * (sizeof(NodeId) + 1) +
         pinned_.capacity() * sizeof(PinRecord) + scratch_.capacity() * sizeof(Node*) +
         policy_->MemoryBytes() + label_bytes_;
}

RadixIndexStats RadixIndex::Stats() const {
  absl::ReaderMutexLock lock(&mu_);
  RadixIndexStats stats = counters_;
  stats.l2_bytes = L2BytesLocked();
  stats.l2_inflight_bytes = counters_.l2_inflight_objects * object_bytes();
  stats.memory_bytes = MemoryBytesLocked();
  stats.labelled_pages = labels_.size();
  stats.label_bytes = label_bytes_;
  // pinned_ is dense: O(pinned pages), not O(index).
  for (const PinRecord& r : pinned_) {
    stats.pinned_bytes += (std::popcount(r.node->resident) + r.node->writing) * object_bytes();
  }
  return stats;
}

bool RadixIndex::Empty() const {
  absl::MutexLock lock(&mu_);
  return nodes_.empty() && doomed_.empty();
}

absl::Status RadixIndex::ResetObjectBytes(uint64_t object_bytes) {
  if (object_bytes == 0) return absl::InvalidArgumentError("radix index: object_bytes must be > 0");
  absl::MutexLock lock(&mu_);
  if (!nodes_.empty() || !doomed_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("radix index: object_bytes can change only while no page is indexed (",
                     nodes_.size(), " are)"));
  }
  object_bytes_.store(object_bytes, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status RadixIndex::CheckInvariants() const {
  absl::ReaderMutexLock lock(&mu_);
  auto fail = [](const Node* n, absl::string_view what) {
    return absl::InternalError(absl::StrCat("radix index: page ", ShortKey(n->key), ": ", what));
  };
  RadixIndexStats c;
  absl::flat_hash_set<uint64_t> slots;
  size_t linked_children = 0;
  const ShardMask all = AllShards(shards_per_page_);
  const size_t id_bound = slab_->IdBound();
  for (const NodeId id : nodes_) {
    const Node* n = At(id);
    NodeId found = 0;
    if (Find(n->key, &found) != n || found != id) {
      return fail(n, "hash set lookup does not find the node");
    }
    if (n->parent != 0 && (n->parent >= id_bound || !nodes_.contains(n->parent))) {
      return fail(n, "parent not indexed");
    }
    if (n->parent == 0 && (n->prev_sibling != 0 || n->next_sibling != 0)) {
      return fail(n, "root with siblings");
    }
    uint32_t l2_children = 0;
    NodeId prev = 0;
    for (NodeId c = n->first_child; c != 0; prev = c, c = At(c)->next_sibling) {
      if (c >= id_bound || !nodes_.contains(c)) return fail(n, "child not indexed");
      const Node* ch = At(c);
      if (ch->parent != id) return fail(n, "child whose parent is another node");
      if (ch->prev_sibling != prev) return fail(n, "broken sibling link");
      if (++linked_children > nodes_.size()) return fail(n, "child list cycle");
      l2_children += ch->HoldsL2();
    }
    if (l2_children != n->l2_children) return fail(n, "l2_children count is wrong");
    if ((n->resident & ~all) != 0) return fail(n, "shard beyond shards_per_page");
    uint32_t l3_copies = 0;
    int writing = 0;
    for (int s = 0; s < shards_per_page_; ++s) {
      const ShardState& st = n->shards()[s];
      writing += n->Writing(s);
      if (((n->resident >> s) & 1) && !st.slot.valid()) {
        return fail(n, "committed shard without a slot");
      }
      if (st.slot.valid() && !slots.insert(st.slot.Packed()).second) {
        return fail(n, "slot held twice");
      }
      if ((st.l3_tiers >> l3_tiers_) != 0) return fail(n, "copy in a tier beyond l3_tiers");
      l3_copies += std::popcount(st.l3_tiers);
      for (uint32_t t = st.l3_tiers; t != 0; t &= t - 1) ++c.l3_objects[LowBit(t)];
    }
    if (l3_copies != n->l3_copies) return fail(n, "l3_copies count is wrong");
    if (writing != n->writing) return fail(n, "count of shards in flight is wrong");
    if (n->Empty() && n->first_child == 0) return fail(n, "empty leaf left in the tree");
    if (n->pins != 0 && n->resident == 0) return fail(n, "pinned page without L2 data");
    if (n->pins != 0) {
      if (n->pin_slot >= pinned_.size() || pinned_[n->pin_slot].node != n) {
        return fail(n, "pinned page without its pin record");
      }
      uint32_t pins = 0;
      for (const PinEntry& e : pinned_[n->pin_slot].entries) pins += e.count;
      if (pins != n->pins) return fail(n, "pin count disagrees with the pin record");
    }
    if ((n->hook.queue != 0) != (n->resident != 0)) {
      return fail(n, "policy tracks the page iff it has committed L2 data: violated");
    }
    if (policy_->Parked(n->hook) && n->Evictable()) return fail(n, "parked while evictable");
    ++c.pages;
    c.l2_pages += n->resident != 0;
    c.l2_objects += std::popcount(n->resident);
    c.l2_inflight_objects += n->writing;
    c.pinned_pages += n->pins != 0;
    c.pins += n->pins;
  }
  size_t with_parent = 0;
  for (const NodeId id : nodes_) with_parent += At(id)->parent != 0;
  if (with_parent != linked_children) {
    return absl::InternalError("radix index: a node is missing from its parent's child list");
  }
  for (size_t r = 0; r < pinned_.size(); ++r) {
    const Node* n = pinned_[r].node;
    const PinList& list = pinned_[r].entries;
    if (Find(n->key) != n) {
      return absl::InternalError("radix index: pin record of a freed page");
    }
    if (n->pins == 0 || n->pin_slot != r) {
      return absl::InternalError("radix index: pin record its page does not point to");
    }
    if (list.empty()) return absl::InternalError("radix index: empty pin record kept");
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].count == 0) return absl::InternalError("radix index: pin entry with count 0");
      for (size_t j = 0; j < i; ++j) {
        if (list[j].owner == list[i].owner) {
          return absl::InternalError("radix index: two pin entries for one owner");
        }
      }
    }
  }
  if (policy_->Tracked() != c.l2_pages) {
    return absl::InternalError(absl::StrCat("radix index: policy tracks ", policy_->Tracked(),
                                            " pages, L2 holds ", c.l2_pages));
  }
  if (absl::Status s = policy_->CheckConsistency(); !s.ok()) return s;
  const RadixIndexStats& k = counters_;
  if (c.pages != k.pages || c.l2_pages != k.l2_pages || c.l2_objects != k.l2_objects ||
      c.l2_inflight_objects != k.l2_inflight_objects || c.l3_objects != k.l3_objects ||
      c.pinned_pages != k.pinned_pages || c.pins != k.pins) {
    return absl::InternalError(absl::StrCat(
        "radix index: counters disagree with the tree: pages ", k.pages, "/", c.pages, " l2_pages ",
        k.l2_pages, "/", c.l2_pages, " l2_objects ", k.l2_objects, "/", c.l2_objects, " inflight ",
        k.l2_inflight_objects, "/", c.l2_inflight_objects, " pinned ", k.pinned_pages, "/",
        c.pinned_pages, " pins ", k.pins, "/", c.pins));
  }
  return absl::OkStatus();
}

}  // namespace kvcellar::core
