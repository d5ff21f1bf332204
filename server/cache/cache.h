// Cache: the composition root of the engine data path. It builds every component in dependency
// order, owns them, and ends sessions; the RPC handlers (rpc/cache_service.h), the AdminService
// and the daemon reach the components through it. See docs/architecture.md for the room map.
//
//   NamespaceRegistry  namespaces, their page geometry and radix index   session/namespace_registry.h
//   SessionRegistry    sessions, instances, leases, busy blocks, slots   session/session_registry.h
//   PinTable           Match pins with per-rank holds and leases         session/pin_table.h
//   OpTable            async ops, the completion thread, WaitOps waiters session/op_table.h
//   L2Space            pool slots, eviction on a full pool, watermarks   l2/l2_space.h
//   SimSignalPump      SIM engines' layer and ready counters             datapath/sim_signal_pump.h
//   L3Writer           L2 -> L3 writes under the write policies          l3/l3_writer.h
//   L3Prefetcher       L3 -> L2 prefetch ops                             l3/l3_prefetcher.h
//   L3Recovery         file tiers' startup scans back into the index     l3/l3_recovery.h
//   L2 recovery        a re-attached pool's journal back into the index  l2/l2_recovery.h
//   DeviceMover        Load and Backup as batched device ops             datapath/device_mover.h
//   Matcher            group-consistent lookups and the step memo        datapath/matcher.h
//   CacheAdmin         AdminService listings, stats, Evict and Clear     admin/cache_admin.h
//   Housekeeper        leases, pruning, doomed pages, watermarks         housekeeper.h
//   SessionCloser      the end of sessions whose drain is over           session_closer.h
//
// Without L3 tiers (storage.tiers = ""), Match reports no L3 hits, Prefetch answers an op whose
// pages are ALREADY_PRESENT or MISS, and every page stays in L2 only.
//
// Threads: any; each component states its own. Owned threads: the op completion thread
// (OpTable), the SIM signal pump, the housekeeper and the session closer. No Cache call waits for
// a session's ops to end (EndSession returns at once and calls back); EndSessionNow waits only
// for device work it has just cancelled.
#ifndef KVCELLAR_SERVER_CACHE_CACHE_H_
#define KVCELLAR_SERVER_CACHE_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/host_pool.h"
#include "platform/engine_memory_access.h"
#include "server/admin/cache_admin.h"
#include "server/admin/daemon_info.h"
#include "server/cache/housekeeper.h"
#include "server/cache/session_closer.h"
#include "server/config/cache_limits.h"
#include "server/config/config.h"
#include "server/datapath/device_mover.h"
#include "server/datapath/device_set.h"
#include "server/datapath/matcher.h"
#include "server/datapath/sim_signal_pump.h"
#include "server/events/event_hub.h"
#include "server/l2/l2_recovery.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_prefetcher.h"
#include "server/l3/l3_recovery.h"
#include "server/l3/l3_tiers.h"
#include "server/l3/l3_writer.h"
#include "server/metrics/cache_metrics.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"
#include "server/session/tenant_ledger.h"
#include "server/session/tenant_metrics.h"

namespace kvcellar::server {

struct CacheOptions {
  Config config;
  core::HostPool* pool = nullptr;  // Required; outlives the cache.
  // The devices engines' memory is on, by kind; empty: none (WORKER registrations are refused
  // with DEVICE_UNAVAILABLE). The backends outlive the cache.
  DeviceSet devices;
  uint64_t daemon_epoch = 0;
  // nullptr: DefaultRegistry(). Outlives the cache.
  MetricsRegistry* metrics = nullptr;
  // The L3 tiers; nullptr or empty: none. Outlives the cache.
  L3Tiers* l3 = nullptr;
  // Warm restart (l2/l2_recovery.h): the pool's slot journal, nullptr without pool.shm_name.
  // When `journal_attached`, the pool and journal survived from an earlier daemon and the cache
  // rebuilds L2 from them before serving; otherwise `cold_reason` says why L2 starts empty.
  core::SlotJournal* journal = nullptr;
  bool journal_attached = false;
  std::string cold_reason;
  // How often the housekeeper runs. Pin and session leases lapse at most this late.
  absl::Duration housekeeping_interval = absl::Milliseconds(20);
  // Where the indexes report pages stored and removed (KV events); nullptr: nowhere. Outlives
  // the cache.
  EventHub* events = nullptr;
  // Where pages' labels are kept for a restart and read back from (events.label_log); nullptr:
  // nowhere. Outlives the cache.
  LabelLog* labels = nullptr;
  // The daemon's own shared-memory objects (the pool and its journal, when named): never mapped
  // for an engine, whoever names them (platform/engine_memory_access.h).
  std::vector<platform::DaemonObject> daemon_objects;
};

class Cache {
 public:
  explicit Cache(CacheOptions options);
  // Ends every session (ops cancelled, mappings closed) and stops the threads. The gRPC server
  // must have been shut down first.
  ~Cache();
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  // The daemon is shutting down: new registrations and data ops get UNAVAILABLE (NOT_READY),
  // Heartbeat says draining, and pending WaitOps return at once.
  void SetDraining();
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // OK, or UNAVAILABLE / NOT_READY while draining.
  absl::Status CheckNotDraining() const;
  // The live session, or SESSION_UNKNOWN.
  absl::StatusOr<std::shared_ptr<Session>> FindSession(uint64_t session_id) const;

  using EndCounts = SessionEndCounts;
  // Ends a session already removed from the registry, without blocking: no new op can start on
  // it now; once its ops have ended or `drain` has passed (or the daemon drains), the session
  // closer cancels the rest, closes its mapping (after which no copy touches engine memory),
  // drops its pins, and calls `done` (may be empty) with the counts, on the closer thread.
  void EndSession(std::shared_ptr<Session> session, bool last_of_instance, absl::Duration drain,
                  std::string reason, std::function<void(const EndCounts&)> done);
  // The same without a drain, finished on the calling thread before it returns (replacement,
  // daemon shutdown): waits only for the device to end the ops it cancels.
  EndCounts EndSessionNow(const std::shared_ptr<Session>& session, bool last_of_instance,
                          absl::string_view reason);

  struct Counts {
    size_t sessions = 0;
    size_t instances = 0;
    size_t namespaces = 0;
  };
  Counts GetCounts() const;
  // L2 occupancy summed over the namespaces' indexes: the numbers behind the kvcellar_l2_*
  // gauges and GetStatus's pool fields, read at call time.
  struct L2Usage {
    uint64_t pages = 0;              // Pages with a committed shard.
    uint64_t objects = 0;            // Committed (page, shard) objects.
    uint64_t in_flight_objects = 0;  // Objects being written (slot held, invisible).
    uint64_t in_flight_bytes = 0;    // Their slot bytes.
    uint64_t pinned_pages = 0;
    uint64_t pinned_bytes = 0;       // Slot bytes of pinned pages' objects.
    uint64_t bytes = 0;              // Slot bytes of all objects, in flight included.
  };
  L2Usage GetL2Usage() const;
  // The cache's part of DaemonInfo (GetStatus): sessions, instances, namespaces, and the pool's
  // pinned and in-flight bytes, from the same sources as the metrics.
  void FillInfo(DaemonInfo* info) const;

  // Runs one housekeeping pass now (tests; the housekeeper thread runs it periodically).
  void Housekeep() { housekeeper_->RunOnce(); }

  // The components.
  const Config& config() const { return config_; }
  const CacheLimits& limits() const { return limits_; }
  uint64_t daemon_epoch() const { return daemon_epoch_; }
  // The primary device's kind (UNSPECIFIED without one) and every kind served.
  v1::DeviceKind device_kind() const { return devices_.primary_kind(); }
  const DeviceSet& devices() const { return devices_; }
  const std::vector<platform::DaemonObject>& daemon_objects() const { return daemon_objects_; }
  CacheMetrics& metrics() { return metrics_; }
  NamespaceRegistry& namespaces() { return namespaces_; }
  L2Space& l2() { return l2_; }
  SessionRegistry& sessions() { return sessions_; }
  PinTable& pins() { return pins_; }
  OpTable& ops() { return ops_; }
  SimSignalPump& pump() { return pump_; }
  L3Tiers& l3() { return *l3_; }
  L3Writer& l3_writer() { return writer_; }
  L3Prefetcher& l3_prefetcher() { return prefetcher_; }
  L3Recovery& l3_recovery() { return recovery_; }
  // What this start recovered of L2 (immutable after construction).
  const L2RecoveryStats& l2_recovery() const { return l2_recovery_; }
  DeviceMover& mover() { return mover_; }
  Matcher& matcher() { return matcher_; }
  // The AdminService's view of the cache (listings, statistics, Evict, Clear).
  CacheAdmin& admin() { return admin_; }
  // Per-tenant L2 bytes, quotas and evictions.
  const TenantLedger& tenants() const { return tenants_; }
  // Per tenant: its account joined with its namespaces' counters (GetStatus, metrics).
  std::vector<TenantUsage> TenantUsages() const;

 private:
  void AddCollectors();
  // The second half of ending a session (after its drain): cancels, closes, unpins, logs.
  EndCounts FinishEnd(SessionEnd& end);
  // Recovers L2 from the journal, or says why it starts empty (l2_recovery_), before serving.
  void StartL2(const CacheOptions& options);

  const Config config_;
  const CacheLimits limits_;
  const uint64_t daemon_epoch_;
  const DeviceSet devices_;
  const std::vector<platform::DaemonObject> daemon_objects_;
  std::atomic<bool> draining_{false};

  // Declaration order is construction order; destruction runs backwards, so every component is
  // destroyed before what it points to.
  CacheMetrics metrics_;
  TenantLedger tenants_;  // Accounts and quotas (tenants.quotas), resolved against the pool.
  NamespaceRegistry namespaces_;
  L2Space l2_;
  SessionRegistry sessions_;
  PinTable pins_;
  OpTable ops_;
  SimSignalPump pump_;
  std::unique_ptr<L3Tiers> no_l3_;  // The empty list, when options.l3 is nullptr.
  L3Tiers* const l3_;
  L3Writer writer_;
  L3Prefetcher prefetcher_;
  L3Recovery recovery_;
  L2RecoveryStats l2_recovery_;
  DeviceMover mover_;
  Matcher matcher_;
  CacheAdmin admin_;
  SessionCloser closer_;
  // Last: it runs over everything above, and stops first.
  std::unique_ptr<Housekeeper> housekeeper_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CACHE_CACHE_H_
