// RadixIndex: which pages of one namespace exist, in which tier, and who holds them (DESIGN.md
// "Index").
//
// A page-granular prefix tree over page keys, plus a hash set from key to node for O(1) access.
// Each node knows, per shard, its L2 slot (committed or being written) and which L3 tiers hold a
// checked copy; its pins and their leases; its eviction-policy state; its children (first-child /
// sibling links: most nodes have zero or one child, a shared system prompt may have thousands).
//
// Invariants (checked by CheckInvariants, after every operation in the model-based test):
//  - Prefix-closed: a node exists only when its parent does; BeginWrite and UpdateL3 refuse a page
//    whose parent is not indexed (FailedPrecondition), so Match never sees a hole in the tree.
//  - A node exists only while it holds something (an L2 slot, an L3 copy) or has children. A page
//    that lost its last copy but has descendants stays as an empty tombstone: removing it would
//    orphan them, and they still make sense once the page is written again.
//  - In-flight shards are invisible: Match counts a page in L2 only when every needed shard is
//    committed, and a shard is in L3 only once the storage layer marked the checked copy there.
//  - Eviction takes only unpinned pages with nothing in flight and no child holding L2 (leaf-first
//    in L2 terms); it frees all L2 shards of the page. A page still in an L3 tier stays in the
//    tree (no L2 slot) and keeps counting for L3 hits; a page no tier holds leaves the tree when it
//    is a leaf.
//  - Every pin has a lease (owner, deadline). A crashed owner's pins expire (ExpireLeases) or are
//    dropped at once (ReleaseOwner). A pinned page always holds committed L2 data.
//  - The index owns no memory of the host pool: it stores SlotRefs the caller allocated, and every
//    operation that lets go of one (Abort, eviction, removal) hands it back to the caller to free.
//    Each SlotRef given to BeginWrite is returned exactly once.
//
// Pins. A pinned page keeps a small list of (owner, deadline, count) in a side table of pinned
// pages; a node itself carries only its total count and the index of its record, so the 99% of
// pages that are not pinned pay 8 bytes. Per-owner entries make ReleaseOwner exact and keep one
// owner's renewals from extending another's pins (a single count plus the latest deadline would let
// a live engine keep a crashed engine's pins alive). ExpireLeases and ReleaseOwner scan the side
// table, which holds only pages pinned now: pins are transient (a match until its load completes),
// so that table is small. (A deadline-ordered heap would make ExpireLeases O(expired) but cost a
// heap push per pinned page on the Match path; the sweep runs once per lease period, off the hot
// path.)
//
// Namespaces: one RadixIndex per namespace. Keys of different namespaces never collide (they
// chain from different ns_digests); the shard count and object size are per-namespace constants,
// so every node of an index has one size and comes from a slab; and each namespace has its own
// mutex. The host pool is shared, so the server either gives each namespace a capacity
// (SetCapacity, watermarks) or calls EvictBytes on the namespaces it chooses under pool pressure.
//
// Threads: any gRPC handler thread, the movers and the lease sweeper call it concurrently.
// Locking model: one absl::Mutex per index guards all its state, the nodes (reachable only through
// guarded members) and the eviction policy. Every public method takes it exactly once for the
// whole batch, and holds it for work proportional to the batch: no I/O, no callbacks, no host-pool
// calls. bench_index.cc measures how long a 2048-page Match holds it.
#ifndef KVCELLAR_CORE_RADIX_INDEX_H_
#define KVCELLAR_CORE_RADIX_INDEX_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/eviction_policy.h"
#include "core/index_events.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/slot_ref.h"

namespace kvcellar::core {

// Shards per page: an MHA/GQA group of TP size T stores T shards, MLA one. 64 keeps a page's shard
// set in one machine word (ShardMask).
inline constexpr int kMaxShardsPerPage = 64;
// L3 tiers: one bit each in a byte per shard.
inline constexpr int kMaxL3Tiers = 8;

using ShardMask = uint64_t;  // Bit s: shard s.
using OwnerId = uint64_t;    // Who holds a pin: an engine session.

inline ShardMask AllShards(int shards_per_page) {
  return shards_per_page >= 64 ? ~ShardMask{0} : (ShardMask{1} << shards_per_page) - 1;
}

// KV groups of a hybrid model (docs/keys.md "Groups"). A page is the KV of P tokens of every
// group at once: one node, whose objects are group-major, `shards_per_page / groups` objects
// (the TP shards) per group: object (g, r) is shard g * (shards_per_page / groups) + r. What a
// hit at a token boundary needs of each group depends on its kind (GroupKind).
struct GroupRule {
  GroupKind kind = GroupKind::kFull;
  // kWindow: pages a hit needs before its boundary, ceil((W - 1) / P) for a window of W tokens
  // and pages of P tokens (a hit at a shorter boundary needs every page before it).
  uint32_t window_pages = 0;
};

struct RadixIndexOptions {
  // 1 for MLA; the TP size for MHA/GQA; times the number of groups for a hybrid model. At most
  // kMaxShardsPerPage.
  int shards_per_page = 1;
  // Empty: one full-attention group (every namespace of a model that is not hybrid). Otherwise
  // one rule per group, and shards_per_page a multiple of their number.
  std::vector<GroupRule> groups;
  // Number of L3 tiers the storage layer has, in its order of preference. At most kMaxL3Tiers.
  int l3_tiers = 0;
  // Bytes of one (page, shard) object, for byte accounting (watermarks, EvictBytes). Pass the
  // slot size rather than the object size to account for what the pool actually spends.
  uint64_t object_bytes = 0;
  // L2 bytes this namespace may use, for the watermarks; 0 means no limit. See SetCapacity.
  uint64_t capacity_bytes = 0;
  // NeedsEviction once L2 bytes exceed high * capacity; EvictToLowWatermark goes down to low.
  double high_watermark = 0.95;
  double low_watermark = 0.85;
  EvictionPolicyKind policy = EvictionPolicyKind::kS3Fifo;
};

// Why an L2 write is in flight (both are invisible until Commit).
enum class WriteKind : uint8_t {
  kBackup = 0,    // Gathered from an engine's GPU blocks.
  kPrefetch = 1,  // Read back from an L3 tier (and checked before Commit).
};

// BeginWrite: reserve (key, shard) with a slot the caller allocated.
struct WriteRequest {
  PageKey key;
  std::optional<PageKey> parent;  // nullopt: the first page of a sequence.
  uint16_t shard = 0;
  SlotRef slot;
  WriteKind kind = WriteKind::kBackup;
};

// One object: a page's shard.
struct ObjectId {
  PageKey key;
  uint16_t shard = 0;
};

// An object the index let go of. The caller frees `slot` to the host pool when it is valid.
// `l3_tiers` lists the tiers holding a copy at that moment: after eviction those copies stay
// indexed; after removal they are no longer indexed and the caller deletes them.
struct ReleasedObject {
  PageKey key;
  uint16_t shard = 0;
  SlotRef slot;
  uint8_t l3_tiers = 0;
};

struct PinLease {
  OwnerId owner = 0;
  absl::Time deadline;  // The pin lapses at ExpireLeases(now) once now >= deadline.
};

struct MatchOptions {
  // Shards that must all be present for a page to count (a whole TP group, or one for MLA).
  ShardMask shards = 1;
  // Pin the L2 hit under this lease, atomically with the match.
  std::optional<PinLease> pin;
};

struct MatchResult {
  // Leading pages with every needed shard committed in L2. With groups: the longest boundary at
  // which every group has what a hit needs (see GroupKind) committed in L2, every page before it
  // holding committed L2 data; only those objects are what a Load may copy (NeededObjects).
  uint32_t l2_pages = 0;
  // Per tier: pages after the L2 hit with every needed shard in that tier. With groups: how
  // many pages further the boundary reaches over L2 and that tier together (each page's objects
  // a hit there needs, NeededObjects, in one or the other).
  std::array<uint32_t, kMaxL3Tiers> l3_pages{};
  // The best tier (the longest run; the earlier tier on a tie) and its length; -1 and 0 if none.
  int best_l3_tier = -1;
  uint32_t best_l3_pages = 0;
  // Pages pinned: l2_pages when a pin was asked for, else 0.
  uint32_t pinned_pages = 0;
};

// UpdateL3: the storage layer reports a copy written and checked (present) or gone (not).
struct L3Update {
  PageKey key;
  // Needed only when the page is not indexed yet (a copy found in L3 at startup); as WriteRequest.
  std::optional<PageKey> parent;
  uint16_t shard = 0;
  uint8_t tier = 0;
  bool present = true;
  // Attached (RadixIndex::Label, no bound) when the page has no label yet, before its stored
  // event: what a restarted daemon read back for it (server/events/label_log.h).
  std::shared_ptr<const PageLabel> label = nullptr;
};

struct RemoveCounts {
  size_t removed_pages = 0;  // Pages whose copies were dropped.
  size_t busy_pages = 0;     // Pinned or in flight: left untouched.
  size_t missing_keys = 0;   // Not indexed.
};

// Admin usage of a scope (the whole index or one subtree): committed L2 only.
struct ScopeUsage {
  uint64_t l2_pages = 0;
  uint64_t l2_objects = 0;
};

// What EvictScope evicted (or, dry, would evict), and the pages in scope it had to leave.
struct AdminEvictResult {
  uint64_t pages = 0;
  uint64_t objects = 0;
  uint64_t skipped_pinned_pages = 0;     // Holding L2 and pinned (a Match pin or a Load's copy).
  uint64_t skipped_in_flight_pages = 0;  // Holding L2, unpinned, a write in flight.
};

// An object the caller believes holds `slot` (a host pool owner record; see EvictHolders).
struct SlotHolder {
  PageKey key;
  uint16_t shard = 0;
  SlotRef slot;
};

// What EvictHolders evicted (or, dry, would evict).
struct HolderEvictResult {
  uint64_t pages = 0;    // Holder pages and their descendants that went.
  uint64_t objects = 0;  // All their L2 objects, in the holders' slots or elsewhere.
  uint64_t held = 0;     // Holders the index holds at that slot (committed or in flight).
  uint64_t blocked = 0;  // Of those, pages that stay: busy, or with a busy descendant.
  uint64_t absent = 0;   // Holders the index does not hold at that slot.
};

enum class L2State : uint8_t { kAbsent, kWriting, kResident };

struct ShardInfo {
  L2State l2 = L2State::kAbsent;
  WriteKind write_kind = WriteKind::kBackup;  // Meaningful when l2 == kWriting.
  SlotRef slot;
  uint8_t l3_tiers = 0;
};

// A snapshot of one page, for admin tools and tests.
struct PageInfo {
  PageKey key;
  std::optional<PageKey> parent;
  size_t children = 0;
  uint32_t l2_children = 0;  // Children holding L2 (committed or in flight).
  std::vector<ShardInfo> shards;
  uint32_t pins = 0;
  bool evictable = false;
};

struct RadixIndexStats {
  uint64_t pages = 0;                // Nodes in the tree, tombstones included.
  uint64_t l2_pages = 0;             // Pages with at least one committed L2 shard.
  uint64_t l2_objects = 0;           // Committed (page, shard) objects in L2.
  uint64_t l2_inflight_objects = 0;  // Objects being written to L2: slot held, invisible.
  uint64_t l2_bytes = 0;             // (l2_objects + l2_inflight_objects) * object_bytes.
  uint64_t l2_inflight_bytes = 0;    // l2_inflight_objects * object_bytes.
  std::array<uint64_t, kMaxL3Tiers> l3_objects{};  // Objects per L3 tier.
  uint64_t pinned_pages = 0;
  // Slot bytes of pinned pages' L2 objects (committed or being written): what pins keep from
  // eviction. Computed by Stats() over the pinned pages.
  uint64_t pinned_bytes = 0;
  uint64_t pins = 0;          // Sum of pin counts over pages and owners.
  uint64_t memory_bytes = 0;  // Heap memory of the index: nodes, hash set, pins, policy, labels.
  uint64_t labelled_pages = 0;  // Pages with a label (RadixIndex::Label).
  uint64_t label_bytes = 0;     // Their labels' heap bytes, part of memory_bytes.
  // Cumulative.
  uint64_t evicted_pages = 0;
  uint64_t evicted_objects = 0;
  uint64_t expired_pins = 0;
  // Matches that found the query's pages scattered in memory and switched from child links to
  // pipelined hash probes (a diagnostic of node layout; see radix_index.cc).
  uint64_t matches_probed = 0;
};

class RadixIndex {
 public:
  // InvalidArgument naming the option when one is out of range.
  static absl::StatusOr<std::unique_ptr<RadixIndex>> Create(const RadixIndexOptions& options);
  // With a policy of the caller's (options.policy is ignored).
  static absl::StatusOr<std::unique_ptr<RadixIndex>> Create(const RadixIndexOptions& options,
                                                            std::unique_ptr<EvictionPolicy> policy);

  ~RadixIndex();
  RadixIndex(const RadixIndex&) = delete;
  RadixIndex& operator=(const RadixIndex&) = delete;

  // Longest-prefix match of a key sequence (keys[i+1] must be the child of keys[i]; the first key
  // may be any indexed page). Counts the leading pages with every needed shard committed in L2,
  // then per L3 tier the pages after them with every needed shard in that tier. The L2 hit counts
  // as an access for the eviction policy and is pinned under options.pin when given, under the
  // same lock, so no eviction can take it between match and load. InvalidArgument for an empty
  // shard set or a shard beyond shards_per_page.
  //
  // With groups, options.shards names the needed objects of every group (the same ranks in each)
  // and the L2 hit is the longest boundary every group serves (GroupKind); each tier's count is
  // how far that boundary reaches when the tier's objects join L2's.
  absl::StatusOr<MatchResult> Match(absl::Span<const PageKey> keys, const MatchOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Reserves each (key, shard) as in flight with the caller's slot. statuses[i] answers
  // requests[i] (the spans have equal sizes): FailedPrecondition when the parent is not indexed
  // or the page is indexed under another parent; AlreadyExists when the shard is committed or in
  // flight already (the caller frees its slot); InvalidArgument for a bad shard or slot. Requests
  // run in order, so a batch may hold a chain whose pages are all new. Returns the number accepted.
  size_t BeginWrite(absl::Span<const WriteRequest> requests, absl::Span<absl::Status> statuses)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status BeginWrite(const WriteRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Makes in-flight shards visible. FailedPrecondition for an object that is not in flight.
  size_t Commit(absl::Span<const ObjectId> objects, absl::Span<absl::Status> statuses)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Commit(const ObjectId& object) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops in-flight shards and appends their slots to `released`; objects not in flight are
  // skipped. Returns the number aborted.
  size_t Abort(absl::Span<const ObjectId> objects, std::vector<ReleasedObject>* released)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Pins each indexed page holding committed L2 data for `owner` until `deadline` (a page pinned
  // again by the same owner counts twice and keeps the later deadline). Returns pages pinned.
  size_t Pin(OwnerId owner, absl::Span<const PageKey> keys, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops one pin of `owner` on each page. Returns pins dropped.
  size_t Unpin(OwnerId owner, absl::Span<const PageKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every pin whose deadline is <= now. Returns the (owner, page) leases dropped.
  size_t ExpireLeases(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every pin of `owner` (its session ended or its engine crashed). Returns leases dropped.
  size_t ReleaseOwner(OwnerId owner) ABSL_LOCKS_EXCLUDED(mu_);

  // Sets or clears L3 copies. statuses[i] answers updates[i]: FailedPrecondition for a new page
  // whose parent is not indexed; InvalidArgument for a bad shard or tier. Clearing a copy that is
  // not indexed is OK (idempotent). Returns the number applied.
  size_t UpdateL3(absl::Span<const L3Update> updates, absl::Span<absl::Status> statuses)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Evicts up to `max_pages` pages from L2 through the policy, appending their objects to
  // `evicted` (the caller frees the slots). Returns the pages evicted: fewer when no other page
  // is evictable.
  size_t EvictPages(size_t max_pages, std::vector<ReleasedObject>* evicted)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts whole pages until at least `bytes` of L2 (objects * object_bytes) are freed or nothing
  // else is evictable. Returns the bytes freed.
  uint64_t EvictBytes(uint64_t bytes, std::vector<ReleasedObject>* evicted)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Region release (server/l2/l2_space.h): evicts the pages holding the given slots, and with each
  // every descendant holding L2, since eviction is leaf first and L2 stays prefix-closed. A page
  // goes only when neither it nor any of those descendants is busy (pinned or in flight); such a
  // page and its ancestors among the holders stay (blocked). A holder whose page does not hold
  // exactly that slot is skipped (absent: its slot is in other hands, or the record is stale).
  // Each page goes through EvictNode, the path every eviction takes (counted as evicted; L3
  // copies stay indexed), children before parents, and its objects are appended to `evicted`.
  // dry_run changes nothing and appends nothing but counts the same.
  HolderEvictResult EvictHolders(absl::Span<const SlotHolder> holders, bool dry_run,
                                 std::vector<ReleasedObject>* evicted) ABSL_LOCKS_EXCLUDED(mu_);

  // Watermarks are fractions of this capacity. 0 disables them.
  void SetCapacity(uint64_t capacity_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // L2 bytes (in flight included: their slots are spent) above the high watermark.
  bool NeedsEviction() const ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts until L2 bytes are at most the low watermark or nothing else is evictable. Returns
  // the bytes freed.
  uint64_t EvictToLowWatermark(std::vector<ReleasedObject>* evicted) ABSL_LOCKS_EXCLUDED(mu_);

  // Admin removal. Drops every copy (L2 slots and L3 marks) of each page and appends them to
  // `released`. A page with descendants stays as an empty tombstone (its descendants come back
  // to use if it is written again). Pinned or in-flight pages are left untouched (busy).
  RemoveCounts RemovePages(absl::Span<const PageKey> keys, std::vector<ReleasedObject>* released)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The page and all its descendants. Busy pages (and so their ancestors) stay.
  RemoveCounts RemoveSubtree(const PageKey& key, std::vector<ReleasedObject>* released)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every page. Busy pages (and so their ancestors) stay.
  RemoveCounts Clear(std::vector<ReleasedObject>* released) ABSL_LOCKS_EXCLUDED(mu_);

  // Admin operations on a scope: `subtree` is a page and everything below it, nullopt the whole
  // index. A subtree root that is not indexed is an empty scope.
  //
  // Committed L2 pages and objects in scope.
  ScopeUsage Usage(const std::optional<PageKey>& subtree) const ABSL_LOCKS_EXCLUDED(mu_);
  // The keys of every page in scope, tombstones included.
  std::vector<PageKey> ScopeKeys(const std::optional<PageKey>& subtree) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts L2 pages in scope in the policy's order (PickVictim, the path every eviction takes),
  // leaf first and never busy pages, until `max_objects` objects are gone (0: every eligible
  // page), appending them to `evicted`. Out-of-scope pages the policy offers are refused and put
  // back where they were. dry_run changes nothing and appends nothing: it counts the pages that
  // would become evictable, children before parents.
  AdminEvictResult EvictScope(const std::optional<PageKey>& subtree, uint64_t max_objects,
                              bool dry_run, std::vector<ReleasedObject>* evicted)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Admin Clear: drops every copy of every page in scope into `released` (as RemoveSubtree).
  // A busy page (a write in flight, or pinned: by now only copies in flight hold pins, the caller
  // revoked the Match pins) is doomed instead: invisible to Match from now on, left in place,
  // and its copies dropped by ReapDoomed once it is no longer busy, so no slot a copy still uses
  // is ever handed back. busy_pages counts the doomed pages. dry_run changes nothing; it appends
  // the objects that would go (their slots are still in use: the caller must not free them) and
  // counts as the real call would after the caller revoked the Match pins: pinned pages count as
  // removed, pages with a write in flight as busy.
  RemoveCounts ClearScope(const std::optional<PageKey>& subtree, bool dry_run,
                          std::vector<ReleasedObject>* released) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the copies of doomed pages that are no longer busy into `released`. Returns pages.
  size_t ReapDoomed(std::vector<ReleasedObject>* released) ABSL_LOCKS_EXCLUDED(mu_);
  // Doomed pages not reaped yet.
  size_t DoomedPages() const ABSL_LOCKS_EXCLUDED(mu_);

  // The committed L2 slot of `shard` for each key, invalid where absent (what Load copies from).
  // Returns the number of valid slots.
  size_t GetL2Slots(absl::Span<const PageKey> keys, uint16_t shard, absl::Span<SlotRef> slots) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The parent of each key: its key, or nullopt for the first page of its sequences and for a key
  // that is not indexed (a caller that holds the pages, e.g. pinned, knows they are). What an L3
  // write records in the object's header. Returns the number of keys indexed.
  size_t GetParents(absl::Span<const PageKey> keys,
                    absl::Span<std::optional<PageKey>> parents) const ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<PageInfo> Inspect(const PageKey& key) const ABSL_LOCKS_EXCLUDED(mu_);
  RadixIndexStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Walks the whole tree and checks every invariant above, the counters behind Stats, the
  // policy's queues and that no slot is held twice. O(pages); for tests and debugging.
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

  int shards_per_page() const { return shards_per_page_; }
  // The index's groups (one kFull group when created without any).
  absl::Span<const GroupRule> groups() const { return groups_; }
  // Which of `shards` a Load of a hit of `hit_pages` pages copies for its page `page`: the full
  // groups' objects on every page, a window group's on the last window_pages, a state group's on
  // the last page only. All of `shards` without groups.
  ShardMask NeededObjects(ShardMask shards, uint32_t hit_pages, uint32_t page) const;
  int l3_tiers() const { return l3_tiers_; }
  uint64_t object_bytes() const { return object_bytes_.load(std::memory_order_acquire); }

  // True when the index holds no page at all: no node (no L2 or L3 copy, nothing in flight,
  // pinned or doomed).
  bool Empty() const ABSL_LOCKS_EXCLUDED(mu_);
  // Sets object_bytes anew, only while Empty() (a namespace whose geometry nobody holds any more
  // takes the next engine's): FailedPrecondition otherwise, and nothing changes.
  absl::Status ResetObjectBytes(uint64_t object_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  absl::string_view policy_name() const { return policy_name_; }

  // Reports every page's first copy and last copy per medium to `sink` from now on
  // (core/index_events.h); nullptr stops. `sink` outlives the index or is reset first.
  void SetEventSink(IndexEventSink* sink) ABSL_LOCKS_EXCLUDED(mu_);

  // Attaches labels[i] to the page keys[i] when it is indexed and has none yet (a label is never
  // replaced: events already sent named it). A label lives as long as its page is indexed, in any
  // medium. Not attached once the labels' heap bytes would pass `max_label_bytes` (0: no limit);
  // returns how many were attached, and which in *attached (resized to keys.size()) if given.
  size_t Label(absl::Span<const PageKey> keys,
               absl::Span<const std::shared_ptr<const PageLabel>> labels, uint64_t max_label_bytes,
               std::vector<bool>* attached = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The label of `key`, or nullptr.
  std::shared_ptr<const PageLabel> LabelOf(const PageKey& key) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every labelled page's key and label, in no order, under the index's read lock (fn must not
  // call back into the index).
  void ForEachLabel(
      absl::FunctionRef<void(const PageKey& key, const std::shared_ptr<const PageLabel>& label)> fn)
      const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Node;
  struct ShardState;
  class NodeSlab;
  class Candidates;

  // A node's place in the slab (NodeSlab::At): 32-bit links and hash slots instead of pointers
  // save 24 bytes per page (bench_index.cc BM_IndexScale). 0 is no node.
  using NodeId = uint32_t;

  // Hash set of node ids looked up by key (heterogeneous): 4 bytes per slot instead of 40 for a
  // key-to-pointer map, and Match reads the node anyway. Both functors read keys from the slab.
  struct NodeHash {
    using is_transparent = void;
    const NodeSlab* slab;
    size_t operator()(const PageKey& key) const;
    size_t operator()(NodeId id) const;
  };
  struct NodeEq {
    using is_transparent = void;
    const NodeSlab* slab;
    bool operator()(NodeId a, NodeId b) const { return a == b; }
    bool operator()(NodeId a, const PageKey& b) const;
    bool operator()(const PageKey& a, NodeId b) const { return (*this)(b, a); }
  };

  struct PinEntry {
    OwnerId owner;
    absl::Time deadline;
    uint32_t count;
  };
  using PinList = absl::InlinedVector<PinEntry, 1>;
  struct PinRecord {
    Node* node;
    PinList entries;  // One per owner, each with its count and latest deadline.
  };
  // Batches list a chain's pages in order, often one entry per shard of each page: a cursor
  // remembers the last node, so that the next lookup is a key compare or a child link (a node a
  // Backup batch allocated next to it) rather than a hash probe into a large table. Only for
  // operations that free no node while it is in use.
  struct Cursor {
    Node* last = nullptr;
    NodeId last_id = 0;
  };

  RadixIndex(const RadixIndexOptions& options, std::unique_ptr<EvictionPolicy> policy);

  // The node of `key` or nullptr; its id into *id when given.
  Node* Find(const PageKey& key, NodeId* id = nullptr) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The node with `id`; nullptr for 0.
  Node* At(NodeId id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The child of `parent` with `key`, or nullptr; its id into *id when given.
  Node* FindChild(Node* parent, const PageKey& key, NodeId* id = nullptr) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Find, starting from the cursor's last node. A node found becomes the cursor's last.
  Node* Seek(Cursor& cursor, const PageKey& key) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Finds or creates the node for (key, parent); FailedPrecondition as BeginWrite describes.
  absl::StatusOr<Node*> FindOrCreate(const PageKey& key, const std::optional<PageKey>& parent,
                                     Cursor& cursor) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BeginWriteLocked(const WriteRequest& request, Cursor& cursor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CommitLocked(const ObjectId& object, Cursor& cursor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status UpdateL3Locked(const L3Update& update) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Called after a change of n's L2 shards: keeps the parent's count of L2-holding children
  // and tells the policy when that made the parent evictable.
  void AfterL2Change(Node* n, bool held_l2_before) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyIfEvictable(Node* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddPin(Node* n, OwnerId owner, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `count` pins off n (their entries are already gone from its record); drops the record
  // with the last pin.
  void DropPins(Node* n, uint32_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops pin entries matching `pred`; returns entries dropped.
  template <typename Pred>
  size_t DropPinsWhere(Pred pred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the policy's next victim; returns its object count, 0 when none is evictable.
  size_t EvictOne(std::vector<ReleasedObject>* evicted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts n, a victim the policy just returned (so no longer tracked). Returns its objects.
  size_t EvictNode(Node* n, std::vector<ReleasedObject>* evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends the nodes of a scope (see Usage) in pre-order: each before its descendants.
  void ScopeNodesLocked(const std::optional<PageKey>& subtree, std::vector<Node*>* order) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t EvictBytesLocked(uint64_t bytes, std::vector<ReleasedObject>* evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops every copy of n (not busy) into `released`.
  void DropCopies(Node* n, std::vector<ReleasedObject>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveSubtreeLocked(Node* root, std::vector<ReleasedObject>* released, RemoveCounts* counts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unlinks n (an empty leaf) from its parent and the hash set, and frees it.
  void FreeNode(Node* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes n and then each ancestor while it is an empty leaf.
  void CollectUpwards(Node* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t L2BytesLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The sink's events for n: stored (with n's parent) or removed, in `medium`.
  void Emit(IndexEvent::Kind kind, int8_t medium, const Node* n, int16_t group = -1,
            uint8_t l3_tiers = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // n's integer block hash for events (IndexEvent::hash), and its label into *label if given.
  uint64_t HashOf(const Node* n, std::shared_ptr<const PageLabel>* label) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // What one label costs the index, in heap bytes.
  static uint64_t LabelBytes(const PageLabel& label);
  // Attaches `label` to n unless it has one or the bound would pass; true when attached.
  bool AttachLabelLocked(const Node* n, const std::shared_ptr<const PageLabel>& label,
                         uint64_t max_label_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The L2 events of a change of n's committed objects from `before` to `after`: the page's,
  // or with groups one per group whose objects went from none to some (or some to none).
  void EmitL2(IndexEvent::Kind kind, const Node* n, ShardMask before, ShardMask after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bit t: some shard of n in `shards` has a copy in L3 tier t.
  uint8_t PageTiers(const Node* n, ShardMask shards) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The KV group object `shard` belongs to (0 without groups).
  size_t GroupOf(uint16_t shard) const {
    return shard / (shards_per_page_ / static_cast<int>(groups_.size()));
  }
  // The L3 event of tier `tier` gaining its first copy of n or losing its last: the page's, or
  // with groups the group of `shard`'s. Called before a copy is added and after one is dropped:
  // emits only when no other copy of that scope is in the tier.
  void EmitL3(IndexEvent::Kind kind, const Node* n, uint16_t shard, uint8_t tier)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MemoryBytesLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckShardSet(ShardMask shards) const;
  // Match for an index with groups: the walk, the boundary rule, the access and the pin.
  MatchResult MatchGroupsLocked(absl::Span<const PageKey> keys, const MatchOptions& options)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The objects of group g (every object of a page without groups).
  ShardMask GroupMask(size_t g) const;
  // The end of every Match: scratch_ holds the L2 hit's pages (result->l2_pages of them); counts
  // them as an access for the policy and pins them under options.pin when given.
  void TouchAndPinHitLocked(const MatchOptions& options, MatchResult* result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Immutable after construction, but object_bytes_, which changes only while the index is
  // empty (ResetObjectBytes, under mu_).
  const int shards_per_page_;
  const std::vector<GroupRule> groups_;
  // True when groups_ is more than the one full-attention group: Match takes MatchGroupsLocked.
  const bool hybrid_;
  const int l3_tiers_;
  std::atomic<uint64_t> object_bytes_;
  const double high_watermark_;
  const double low_watermark_;
  const absl::string_view policy_name_;

  mutable absl::Mutex mu_;
  uint64_t capacity_bytes_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<NodeSlab> slab_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<NodeId, NodeHash, NodeEq> nodes_ ABSL_GUARDED_BY(mu_);
  // One record per pinned page (dense, swap-removed; Node::pin_slot indexes it).
  std::vector<PinRecord> pinned_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_) ABSL_PT_GUARDED_BY(mu_);
  // Match's list of L2-hit nodes, kept to touch and pin them after the walk (reused: no
  // allocation per call once grown).
  std::vector<Node*> scratch_ ABSL_GUARDED_BY(mu_);
  // Keys of doomed pages (ClearScope) not reaped yet.
  std::vector<PageKey> doomed_ ABSL_GUARDED_BY(mu_);
  // Counters behind Stats.
  RadixIndexStats counters_ ABSL_GUARDED_BY(mu_);
  IndexEventSink* sink_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Labels of the pages that have one, and their heap bytes (PageLabel::MemoryBytes plus the
  // map's share): only where engines send what events say of their pages.
  absl::flat_hash_map<const Node*, std::shared_ptr<const PageLabel>> labels_ ABSL_GUARDED_BY(mu_);
  uint64_t label_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_RADIX_INDEX_H_
