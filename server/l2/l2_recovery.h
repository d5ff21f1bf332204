// L2 warm restart: rebuilds the L2 tier from a re-attached pool and its slot journal
// (core/slot_journal.h), so that every page that was whole before the daemon stopped (SIGTERM,
// an upgrade) or died (SIGKILL, OOM) is a hit again, and none that was not is ever served.
//
// Runs once, in the Cache's constructor, before the daemon serves:
//   1. Namespaces: each logged namespace is created again in log order, so it gets the same id
//      the records name, and its logged page geometry is fixed with no session holding it (the
//      recovered pages hold it, as pages do; an engine of another geometry is refused while they
//      remain). The caller's `on_indexed` runs for it then (the cache hands it to L3Recovery, so
//      L3 objects waiting for that namespace enter its index before the L2 pages do).
//   2. Records, in parallel over the pool's regions: a record that is torn (its own checksum
//      fails), still WRITING (its copy was in flight), LANDED but not yet sealed (its checksum
//      was never computed: the sealer had not reached it), names an unknown namespace or a geometry
//      that does not fit (shard, size class, length), or whose slot bytes fail their CRC-32C is
//      dropped and counted by reason; its record is cleared. Every byte of every kept page is
//      read once here: that is the price of never serving a torn page.
//   3. The kept slots are handed back to the pool (HostPool::Restore) with their owner records.
//   4. Each namespace's pages enter its index prefix-closed: breadth-first from first pages and
//      from pages whose parent the index already holds (an L3 copy), parents before children.
//      A page whose parent is neither is an orphan: dropped and counted, its slots freed.
// Incompatible journals (format, geometry) never reach here: the daemon formats them and starts
// empty, saying why (daemon.cc).
//
// Threads: the constructor's thread, plus `threads` workers for step 2 that it joins.
#ifndef KVCELLAR_SERVER_L2_L2_RECOVERY_H_
#define KVCELLAR_SERVER_L2_L2_RECOVERY_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "core/host_pool.h"
#include "core/slot_journal.h"
#include "server/events/label_log.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

// What the start did with L2. GetStatus, kvcellarctl status, the log and the metrics show it.
struct L2RecoveryStats {
  bool enabled = false;     // The pool is a named shm object with a journal (pool.shm_name).
  bool warm = false;        // The pool and its journal were re-attached and read.
  std::string cold_reason;  // When enabled and not warm: why the pool started empty.
  uint64_t namespaces = 0;  // Namespaces recreated from the journal.
  uint64_t pages = 0;       // Pages indexed again (a page is all its recovered shards).
  uint64_t objects = 0;     // (page, shard) objects indexed again.
  uint64_t bytes = 0;       // Their object bytes.
  // Dropped objects, by reason. A page that was being written when the daemon stopped is
  // `in_flight`; one torn mid-record `torn`; bytes that fail their checksum `checksum`.
  uint64_t dropped_in_flight = 0;
  uint64_t dropped_unsealed = 0;  // Landed, checksum not computed before the stop.
  uint64_t dropped_torn = 0;
  uint64_t dropped_checksum = 0;
  uint64_t dropped_mismatch = 0;  // Unknown namespace, or a shard/class/length that does not fit.
  uint64_t dropped_orphan = 0;    // Parent neither recovered nor indexed.
  uint64_t dropped_bytes = 0;     // Object bytes of the checksum and orphan drops.
  uint64_t labelled_pages = 0;    // Pages given their label back (events.label_log).
  double seconds = 0;             // Steps 1-4.

  uint64_t dropped() const {
    return dropped_in_flight + dropped_unsealed + dropped_torn + dropped_checksum +
           dropped_mismatch + dropped_orphan;
  }
};

// Steps 1-4 above. `pool` is fresh (nothing allocated) over the re-attached memory and has the
// journal set. `threads` >= 1 verify the records.
// `labels` (nullptr: none) gives each page indexed again its label from before the restart, so
// its stored event carries its tokens (server/events/label_log.h).
L2RecoveryStats RecoverL2(
    core::HostPool& pool, core::SlotJournal& journal, NamespaceRegistry& namespaces, int threads,
    absl::FunctionRef<void(Namespace&)> on_indexed = [](Namespace&) {}, LabelLog* labels = nullptr);

// kvcellar_l2_recovery_* samples (zeros when L2 started empty).
void CollectL2Recovery(const L2RecoveryStats& stats, MetricWriter& out);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L2_L2_RECOVERY_H_
