// L3Recovery: puts what the file and Redis tiers hold back in the radix index after a restart
// (DESIGN.md "Restart and fleet"), so that a Match finds them as L3 hits without asking the
// backends; and takes out of it what a file tier removes by itself while the daemon runs.
//
// Removals: a file tier evicts its coldest objects when a write would exceed its capacity, and
// unlinks objects it finds corrupt (FileBackend::SetRemovalSink). Each becomes an UpdateL3
// "gone" for that tier in its namespace's index, so the next Match no longer names the page as
// an L3 hit and the index announces BlockRemoved on the tier's medium (docs/events.md). An
// object still pending here (its namespace has no index yet) is dropped from what will enter.
//
// A Redis tier reads its index back instead (storage/redis_index.h: one HSCAN'd entry per object,
// with the same parent link); its result arrives through RedisBackend::SetIndexSink in the same
// shape and takes the same path below. Its entries are hints: one whose object expired or was
// evicted becomes an L3 hit that the prefetch then misses (and removes from the index). While
// the daemon runs, the server's own expirations and evictions arrive as keyspace notifications
// (storage/redis_watch.h, RedisBackend::SetRemovalSink) and take OnRemoved's path, as a file
// tier's removals do.
//
// Each file tier scans its directory at start (storage/file_startup_scan.h): it lists the objects
// and reads their headers, which carry the page's parent link (storage/object_format.h). Its result
// comes here once (FileBackend::SetScanSink). A namespace's index exists only once its first
// worker registered and fixed the page geometry (session/namespace_registry.h), so the objects of
// a namespace wait here until then; they enter its index on the registration (OnIndexed) or at
// once when the namespace already has one.
//
// Prefix-closed: a page enters only under a parent that is indexed, or as the first page of its
// sequence. The pages of a namespace's tier are inserted breadth-first from those roots (and from
// pages whose parent the index already holds: L2 pages backed up since the start, another tier's
// copy), parents before children, so every page whose chain is whole enters. A page whose parent
// never appears is an orphan (its parent's object was lost, evicted or torn): counted, not
// inserted; a Match lookup (l3_lookup_timeout_ms) can still find it. Objects of version 1 (no
// parent link) are not placed either (counted as legacy) and stay reachable the same way. Objects
// whose size or shard does not fit the namespace's geometry are counted and skipped (a Get would
// refuse them as foreign).
//
// Visibility: in the background. The scan runs on the tier's scanner thread after a short budget
// inside Open, and the daemon serves meanwhile: a Match before a namespace's pages are inserted
// misses them in the index (or finds them through a lookup), and finds them once inserted. This
// keeps a large tier (millions of objects: a header read each) from delaying readiness for
// minutes, while a page becomes a hit only after every page before it in its chain is indexed.
// Insertion holds a namespace's index lock for kInsertChunk updates at a time.
//
// Payload checksums are not checked here (the scan checks each header, its CRC and the file's
// length); every read from L3 checks the payload CRC before the page becomes visible in L2, so a
// damaged payload is a miss, removed and counted, never served.
//
// Threads: OnScanned on a tier's scanner thread (or the constructor's), OnIndexed on registration
// handlers, Collect and Stats at scrape and GetStatus time. One mutex guards the pending objects
// and the counts; it is held while inserting (the index lock nests inside it), so a namespace's
// objects are inserted once, whichever of the two paths gets them.
#ifndef KVCELLAR_SERVER_L3_L3_RECOVERY_H_
#define KVCELLAR_SERVER_L3_L3_RECOVERY_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/page_key.h"
#include "server/events/label_log.h"
#include "server/l3/l3_tiers.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "storage/file_backend.h"

namespace kvcellar::server {

// One tier's startup scan or index readback and what became of its objects.
struct L3ScanStats {
  bool file_tier = false;   // File tiers scan their directory,
  bool redis_tier = false;  // Redis tiers with index=true read it back; the rest are zero.
  bool complete = false;    // The scan finished and its result arrived.
  bool partial = false;     // Redis: the readback was cut short (node down, time bound).
  // From the scan (storage/file_backend.h FileScanResult).
  uint64_t found = 0;
  uint64_t legacy = 0;
  uint64_t newer = 0;  // A later format's objects: kept for the daemons that read them.
  uint64_t dropped = 0;
  uint64_t temps_removed = 0;
  uint64_t evicted = 0;
  uint64_t payload_bytes = 0;
  double seconds = 0;
  // Into the index, in pages (a page is all its scanned shards).
  uint64_t pages_inserted = 0;
  uint64_t pages_orphaned = 0;     // Parent never indexed.
  uint64_t pages_legacy = 0;       // No parent link (version 1 objects).
  uint64_t pages_mismatched = 0;   // Size or shard does not fit the namespace's geometry.
  uint64_t objects_pending = 0;    // Waiting for their namespace's first worker.
};

class L3Recovery {
 public:
  // All outlive the recovery. Subscribes to every file tier's scan result: a scan that already
  // finished is taken (and applied) here, on this thread. `labels` (nullptr: none) gives each
  // page found its label from before the restart (server/events/label_log.h).
  L3Recovery(L3Tiers* tiers, NamespaceRegistry* namespaces, LabelLog* labels = nullptr);
  // Unsubscribes: after it, no scan result arrives.
  ~L3Recovery();
  L3Recovery(const L3Recovery&) = delete;
  L3Recovery& operator=(const L3Recovery&) = delete;

  // `ns` has an index now (a worker registered): its pending objects enter it.
  void OnIndexed(Namespace& ns) ABSL_LOCKS_EXCLUDED(mu_);

  // Every tier's scan or readback has arrived and every object found has entered its
  // namespace's index (or was dropped): no recovered label is wanted any more.
  bool Settled() const ABSL_LOCKS_EXCLUDED(mu_);
  // Per tier, in tier order.
  std::vector<L3ScanStats> Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // kvcellar_l3_scan_* samples, by tier (file tiers only).
  void Collect(MetricWriter& out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    uint8_t tier = 0;
    storage::FileStartupScan::Found object;
  };

  // Tier `tier` removed `removed` (evicted or corrupt): out of the index, or of what is pending.
  void OnRemoved(size_t tier, absl::Span<const storage::FileObjectId> removed)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `partial`: the result is what a Redis readback read before it was cut short.
  void OnScanned(size_t tier, storage::FileScanResult result, bool partial = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Inserts the pending objects of `ns`, if any and if it has an index.
  void ApplyLocked(Namespace& ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One tier's objects of one namespace, prefix-closed.
  void InsertTier(Namespace& ns, uint8_t tier, const std::vector<Pending>& objects)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  L3Tiers* const tiers_;
  NamespaceRegistry* const namespaces_;
  LabelLog* const labels_;

  mutable absl::Mutex mu_;
  // By namespace digest; the objects in tier order (tier 0's first), so a later tier's pages can
  // hang under an earlier tier's.
  absl::flat_hash_map<core::PageKey, std::vector<Pending>> pending_ ABSL_GUARDED_BY(mu_);
  // Pending objects removed since (by tier): skipped when their namespace's objects enter.
  absl::flat_hash_set<std::pair<uint8_t, storage::FileObjectId>> removed_pending_
      ABSL_GUARDED_BY(mu_);
  std::vector<L3ScanStats> stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_RECOVERY_H_
