// L3Prefetcher: L3 -> L2 prefetch ops (proto PrefetchPolicy; DESIGN.md "Engine data path" step 2).
//
// An op fetches chains of pages (consecutive pages of one sequence). A page's objects are every
// shard of it; of a hybrid model's page, those a hit at the end of the chain needs
// (RadixIndex::NeededObjects: a window's last pages, the state at the boundary only). Per chain,
// in order:
//   - a page whose objects are all committed in L2 is ALREADY_PRESENT;
//   - one being written into L2 by another op is PENDING: this op reports what became of it
//     (OK if it landed by the time this op's own reads end, else MISS);
//   - otherwise each object not in L2 gets an L2 slot (NO_SPACE when none can be had), enters the
//     index as an in-flight prefetch write (invisible to Match; PARENT_MISSING when its parent is
//     not indexed) and is read from the first tier the index says holds it (MISS when none
//     does). Past storage.max_pending_prefetch_bytes a page is THROTTLED.
// The first page that cannot be fetched ends its chain: the rest are SKIPPED.
//
// Reads are checked by the backend (header, key, namespace, CRC32C) before a page is committed,
// so nothing corrupt becomes visible. A read that fails frees its slots; NotFound or a checksum
// error also clears the tier's mark in the index (the copy is gone). Final statuses: OK, MISS,
// L3_ERROR, CHECKSUM_ERROR.
//
// The op and the resources are decoupled. The op is DONE when every read has ended, or at its
// deadline (policy: timeout = request or base + per-1K-tokens, capped; best_effort and
// wait_complete = ServerLimits.max_prefetch_timeout_ms), when pages still arriving are reported
// TIMEOUT. The reads themselves keep their slots until the backend calls back (bounded by its own
// timeout): a page that lands after the deadline is still committed, for later Matches. A session
// that ends cancels its ops the same way (CANCELLED).
//
// With a pin id, pages are added to that pin as they land (PinTable::Extend), so a Match's pin
// grows over its prefetch, as the proto promises. A BEST_EFFORT op is abandoned (CANCELLED, as
// Release(cancel_op_ids) does) once the engine Loads or Releases with one of its pins: the engine
// has scheduled the request with what had landed.
//
// Threads: Start from gRPC handlers; read callbacks on backend threads; completion on the op
// table's thread. Holds no lock of its own across calls out.
#ifndef KVCELLAR_SERVER_L3_L3_PREFETCHER_H_
#define KVCELLAR_SERVER_L3_L3_PREFETCHER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/page_key.h"
#include "kvcellar/v1/common.pb.h"
#include "server/config/cache_limits.h"
#include "server/metrics/cache_metrics.h"
#include "server/config/config.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_tiers.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

// Consecutive pages of one sequence to bring into L2.
struct PrefetchChain {
  std::optional<core::PageKey> parent;  // The page before keys[0]; nullopt for page 0.
  // False when the caller does not know keys[0]'s parent (keys sent from a page > 0): the index's
  // record of the page says it, and a page the index does not know is a MISS.
  bool parent_known = true;
  std::vector<core::PageKey> keys;      // Index keys.
  // Per page, the tier to read; -1 = the first tier the index marks (MISS when none).
  std::vector<int> tiers;
  uint64_t pin_id = 0;  // Pin to extend over the pages as they land; 0 = none.
};

class L3Prefetcher {
 public:
  // Every pointer outlives the prefetcher.
  L3Prefetcher(L3Tiers* tiers, L2Space* l2, OpTable* ops, PinTable* pins, CacheMetrics* metrics,
               const CacheLimits* limits, const StorageConfig& config);
  // Waits for every read in flight to call back (their slots freed or committed).
  ~L3Prefetcher();
  L3Prefetcher(const L3Prefetcher&) = delete;
  L3Prefetcher& operator=(const L3Prefetcher&) = delete;

  // UNSPECIFIED -> the configured default.
  v1::PrefetchPolicy Resolve(v1::PrefetchPolicy policy) const;
  // The op's deadline from submission: see the file comment. `timeout_ms` is the request's (0 =
  // none); `pages` the pages to fetch.
  absl::Duration Deadline(v1::PrefetchPolicy policy, uint32_t timeout_ms, uint64_t tokens) const;

  struct Started {
    std::shared_ptr<OpRecord> op;  // nullptr when nothing was fetched and !always_op.
    std::vector<uint32_t> fetching;  // Per chain: pages being read (PENDING of our own).
  };
  // Starts one op of `session` over `chains`. With always_op an op is created even when nothing
  // needs fetching (the Prefetch RPC always answers with one).
  Started Start(const SessionInfo& session, std::vector<PrefetchChain> chains,
                v1::PrefetchPolicy policy, absl::Duration deadline, bool always_op);

  // The engine Loaded or Released with pin `pin_id`: cancels the BEST_EFFORT op that pin grows
  // over, if one is still running.
  void Abandon(uint64_t pin_id, const std::string& instance_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until no read is in flight (tests, shutdown).
  void Drain();
  uint64_t pending_bytes() const { return pending_bytes_.load(std::memory_order_relaxed); }

 private:
  struct Fetch;
  class FetchOp;
  class Completion;

  struct Plan;
  struct PageState;

  // The phases of Start, in order.
  // Plans one chain's pages: each page's status, and for those to read a slot per shard, an
  // in-flight entry in the index and a read from its tier. Returns how many pages it fetches.
  uint32_t PlanChain(const PrefetchChain& chain, Plan& plan, Fetch& fetch);
  // What `index` says of `key`'s first `shards` shards.
  static PageState Inspect(const core::RadixIndex& index, int shards, const core::PageKey& key);
  // The tier a page is read from: the one the Match attributed, else the first tier holding
  // every shard read (`tiers_holding`); -1 when none does.
  int ReadTier(int matched_tier, uint8_t tiers_holding) const;
  // Reserves `bytes` of max_pending_bytes; false when they do not fit (THROTTLED).
  bool ReservePending(uint64_t bytes);
  // A slot (appended to `slots`, per shard; invalid for a shard not read) and an in-flight write
  // for each shard of `key` in `read`; on failure undoes them and returns the page's status
  // (UNSPECIFIED on success).
  v1::PageStatus BeginPage(Plan& plan, const core::PageKey& key,
                           std::optional<core::PageKey> parent, core::ShardMask read,
                           std::vector<core::SlotRef>* slots);
  // The op's record (it takes the plan's seq_begin), registered as in flight.
  std::unique_ptr<OpRecord> NewRecord(const SessionInfo& session,
                                      const std::vector<PrefetchChain>& chains, Plan& plan,
                                      absl::Duration deadline, const std::shared_ptr<Fetch>& fetch);
  // The reads, per tier in batches of at most the backend's max_batch_items; lands the fetch
  // when the last one completes (at once when there is none).
  void SubmitReads(const Plan& plan, const std::shared_ptr<Fetch>& fetch);
  void Land(Fetch& fetch);

  L3Tiers* const tiers_;
  L2Space* const l2_;
  OpTable* const ops_;
  PinTable* const pins_;
  CacheMetrics* const metrics_;
  const CacheLimits* const limits_;
  const v1::PrefetchPolicy default_policy_;
  const absl::Duration base_timeout_;
  const absl::Duration per_1k_tokens_;
  const uint64_t max_pending_bytes_;

  std::atomic<uint64_t> pending_bytes_{0};
  absl::Mutex mu_;
  size_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  // Running BEST_EFFORT ops by the pins they grow; an entry goes when its op lands.
  absl::flat_hash_map<uint64_t, uint64_t> best_effort_by_pin_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_PREFETCHER_H_
