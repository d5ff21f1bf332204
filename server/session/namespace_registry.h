// NamespaceRegistry: the namespaces the daemon serves, each with its radix index and the page
// geometry that every engine sharing it must match.
//
// A namespace (tenant, model, revision, dtype, page size, layout kind, shard spec) is what makes
// pages interchangeable between engines (DESIGN.md "Page keys"). It is created by the first
// session that registers it and lives for the daemon's life: its pages outlive the engines that
// wrote them (that is the point of a node-wide cache), and the number of distinct namespaces is
// the number of models served, which is small.
//
// Geometry. The host object format is fixed by the KvLayout (core/kv_layout.h): per layer the K
// bytes then the V bytes. Two engines may share objects only when they agree on the layer count
// and every buffer's bytes per block; otherwise the same bytes would mean different things. The
// first WORKER registration fixes the geometry and creates the index; later ones are checked
// against it (FAILED_PRECONDITION, ERROR_REASON_GROUP_MISMATCH, naming the field). The geometry
// binds only while something holds it: a WORKER session that adopted it (until ReleaseLayout) or
// a page of the namespace in the index (any tier, in flight, pinned). Once neither is left (the
// engines ended, the pages were evicted or cleared), the next worker's layout is adopted anew,
// so a stray registration cannot lock a namespace's geometry for the daemon's life. SCHEDULER
// sessions register no layout: until a worker arrives the namespace has no index and every Match
// misses.
//
// Threads: any gRPC handler, the op completion thread and the housekeeper. The registry's map is
// guarded by its mutex; a Namespace's geometry by its own. index() is lock-free once set: the
// index is created once, never replaced, and destroyed with the Namespace.
#ifndef KVCELLAR_SERVER_SESSION_NAMESPACE_REGISTRY_H_
#define KVCELLAR_SERVER_SESSION_NAMESPACE_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/eviction_policy.h"
#include "core/host_pool.h"
#include "core/index_events.h"
#include "core/kv_layout.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/radix_index.h"
#include "core/slot_journal.h"
#include "server/session/namespace_counters.h"
#include "server/session/tenant_ledger.h"

namespace kvcellar::server {

class Namespace {
 public:
  // `l3_tiers`: how many L3 tiers the daemon has (the index keeps a bit per tier). `id`: the
  // registry's number for it (see id()).
  // `journal` (nullable, outlives it): where a fixed geometry is logged for a warm restart.
  // `events` (nullable, outlives it): where its index reports pages stored and removed.
  // `tenant` (nullable, outlives it): its tenant's account of L2 bytes and quota.
  Namespace(core::NamespaceSpec spec, core::HostPool* pool, core::EvictionPolicyKind policy,
            int l3_tiers = 0, uint32_t id = 0, core::SlotJournal* journal = nullptr,
            core::IndexEventSink* events = nullptr, TenantAccount* tenant = nullptr);
  ~Namespace();
  Namespace(const Namespace&) = delete;
  Namespace& operator=(const Namespace&) = delete;

  const core::NamespaceSpec& spec() const { return spec_; }
  const core::PageKey& digest() const { return digest_; }
  // Small number, unique in the registry, from 1: what host pool owner records name
  // (core::SlotOwner::ns). 0 for a namespace made outside a registry.
  uint32_t id() const { return id_; }
  // Objects per page: tp_size for MHA/GQA, 1 for MLA; times the number of KV groups of a hybrid
  // model (object (g, r) is index shard g * ShardsPerPage() + r: core/radix_index.h).
  int shards() const { return shards_; }
  // The index shard of a rank's object of KV group `group`.
  uint16_t GroupShard(uint32_t group, uint16_t shard) const {
    return static_cast<uint16_t>(group * spec_.ShardsPerPage() + shard);
  }
  // Every shard bit a group-consistent hit needs.
  core::ShardMask group_shards() const { return core::AllShards(shards_); }

  // The key the index stores for a page key as the engine sent it (32 bytes): the key itself in
  // a chained namespace, ScopeOpaqueKey(digest, key) in an opaque one (core/page_key.h).
  core::PageKey IndexKey(const char* raw) const;
  // Appends the index keys of a blob of N concatenated 32-byte keys (length checked before).
  void AppendIndexKeys(absl::string_view blob, std::vector<core::PageKey>* out) const;

  // nullptr until the first WORKER fixed the geometry; never changes after (a new geometry
  // reconfigures the same, empty, index).
  core::RadixIndex* index() const { return index_.load(std::memory_order_acquire); }
  // Bytes of one (page, shard) object (of a hybrid model: its largest group's), and of the pool
  // slot that holds it; 0 before the geometry.
  uint64_t object_bytes() const { return object_bytes_.load(std::memory_order_acquire); }
  // Bytes of one object of KV group `group` (what a copy of it moves); 0 before the geometry.
  uint64_t group_object_bytes(uint32_t group) const {
    return group < group_object_bytes_.size()
               ? group_object_bytes_[group].load(std::memory_order_acquire)
               : 0;
  }
  // Bytes of index shard `shard`'s object: its group's (object_bytes() without groups).
  uint64_t shard_object_bytes(uint16_t shard) const {
    return group_object_bytes(shard / spec_.ShardsPerPage());
  }
  uint64_t slot_bytes() const { return slot_bytes_.load(std::memory_order_acquire); }

  // Fixes the geometry from `layout` (the first worker, or the first once nothing holds the old
  // geometry) or checks `layout` against it, and on success counts the caller as holding it
  // until ReleaseLayout. Errors: FAILED_PRECONDITION / GROUP_MISMATCH naming the differing field
  // ("layout.layers[3].v.bytes_per_block"); INVALID_ARGUMENT when the page object is larger than
  // the pool's largest slot. Nothing changes on error.
  absl::Status AdoptLayout(const core::KvLayout& layout);
  // A session that adopted the layout ended (or its registration failed after adopting).
  void ReleaseLayout();
  // Warm restart (server/l2/l2_recovery.h): fixes the geometry a previous daemon logged, per
  // layer (K or latent bytes per block, V bytes: JournalBuffers), with no session holding it; the
  // recovered pages then hold it as pages do. FailedPrecondition when a geometry is fixed already;
  // INVALID_ARGUMENT when the object no longer fits a slot.
  absl::Status RestoreGeometry(const std::vector<std::pair<uint64_t, uint64_t>>& buffer_bytes,
                               uint16_t geometry_epoch);
  // How many times the geometry was fixed (1 for the first; core/slot_journal.h: a record of
  // another epoch is of another geometry), modulo 2^16.
  uint16_t geometry_epoch() const { return geometry_epoch_.load(std::memory_order_acquire); }

  // Its tenant's account (tenant_ledger.h); nullptr when the daemon keeps none (tests).
  TenantAccount* tenant_account() const { return tenant_account_; }

  // Lookups, hits and churn of this namespace since daemon start.
  NamespaceCounters& counters() const { return counters_; }

 private:
  struct Geometry {
    uint32_t layers = 0;
    // Per layer: K (or MLA latent) bytes per block, then V bytes (0 for MLA).
    std::vector<std::pair<uint64_t, uint64_t>> buffer_bytes;
    // Per layer: its KV group (all 0 for a model of one group).
    std::vector<uint32_t> layer_group;
  };
  // The journal's per-layer pairs (core/slot_journal.h) for `g`, and back: a layer's group rides
  // in the top 16 bits of its V size (bytes per block are far below 2^48), so a journal written
  // before groups existed reads as group 0 everywhere.
  static std::vector<std::pair<uint64_t, uint64_t>> JournalBuffers(const Geometry& g);
  static Geometry FromJournal(const std::vector<std::pair<uint64_t, uint64_t>>& buffer_bytes);
  // OK when `layout` has the current geometry; else GROUP_MISMATCH naming the field.
  absl::Status CheckGeometry(const core::KvLayout& layout) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Makes `g` the geometry: creates the index, or resets an empty one's object size (Aborted
  // when a page arrived meanwhile). Nothing changes on error.
  absl::Status FixGeometryLocked(Geometry g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const core::NamespaceSpec spec_;
  const core::PageKey digest_;
  const int shards_;
  core::HostPool* const pool_;
  const core::EvictionPolicyKind policy_;
  const int l3_tiers_;
  const uint32_t id_;
  core::SlotJournal* const journal_;
  core::IndexEventSink* const events_;
  TenantAccount* const tenant_account_;

  absl::Mutex mu_;
  bool has_geometry_ ABSL_GUARDED_BY(mu_) = false;
  Geometry geometry_ ABSL_GUARDED_BY(mu_);
  // Sessions holding the geometry (AdoptLayout minus ReleaseLayout).
  int holders_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<core::RadixIndex> owned_index_ ABSL_GUARDED_BY(mu_);
  std::atomic<core::RadixIndex*> index_{nullptr};
  std::atomic<uint64_t> object_bytes_{0};
  std::vector<std::atomic<uint64_t>> group_object_bytes_;  // Sized once: one per group.
  std::atomic<uint64_t> slot_bytes_{0};
  std::atomic<uint16_t> geometry_epoch_{0};
  mutable NamespaceCounters counters_;
};

class NamespaceRegistry {
 public:
  // The events sink of a new namespace (its id and spec), or nullptr (server/events).
  using EventSinkFactory =
      std::function<core::IndexEventSink*(uint32_t id, const core::NamespaceSpec& spec)>;

  // `pool` outlives the registry; so do the sinks `event_sinks` returns, and `tenants`
  // (nullable: no per-tenant accounts), which gives each namespace its tenant's account.
  NamespaceRegistry(core::HostPool* pool, core::EvictionPolicyKind policy, int l3_tiers = 0,
                    EventSinkFactory event_sinks = nullptr, TenantLedger* tenants = nullptr);

  // The namespace of `spec` (which passed Validate()), created on first use.
  std::shared_ptr<Namespace> GetOrCreate(const core::NamespaceSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  // Warm restart: the same, for a namespace the pool's journal logged already (so it is not
  // logged again). Recreated in log order on an empty registry, each gets its old id.
  std::shared_ptr<Namespace> Recreate(const core::NamespaceSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  // Every namespace, in the order they were created (namespaces are never removed, so a prefix
  // of this list never changes: per-namespace metric series rely on it).
  std::vector<std::shared_ptr<Namespace>> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // The namespace numbered `id` (Namespace::id), or nullptr.
  std::shared_ptr<Namespace> ById(uint32_t id) const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  std::shared_ptr<Namespace> Create(const core::NamespaceSpec& spec, bool journal)
      ABSL_LOCKS_EXCLUDED(mu_);

  core::HostPool* const pool_;
  const core::EvictionPolicyKind policy_;
  const int l3_tiers_;
  const EventSinkFactory event_sinks_;
  TenantLedger* const tenants_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<core::PageKey, std::shared_ptr<Namespace>> by_digest_ ABSL_GUARDED_BY(mu_);
  // by_id_[id - 1], which is also creation order; namespaces are never removed, so ids are dense.
  std::vector<std::shared_ptr<Namespace>> by_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_NAMESPACE_REGISTRY_H_
