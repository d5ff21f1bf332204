// CacheService: the engine data path (kvcellar.v1.CacheService): registration and leases, Match,
// Load, Backup, WaitOps and Release. See DESIGN.md, "Engine data path", and docs/api.md.
//
// This class is the composition root and the RPC handlers: each handler finds the session,
// validates the request (request_validation.h: all or nothing, errors name the field), calls the
// component that does the work, and turns the result into a reply or a gRPC status with the
// kvcellar-error-reason / kvcellar-error-field trailing metadata (status_util.h). The components:
//
//   NamespaceRegistry  namespaces, their page geometry and radix index       namespace_registry.h
//   SessionRegistry    sessions, instances, leases, busy blocks and slots   session_registry.h
//   PinTable           Match pins with per-rank holds and leases            pin_table.h
//   OpTable            async ops, the completion thread, WaitOps waiters    op_table.h
//   DeviceMover        Load and Backup as batched device ops                device_mover.h
//   Matcher            group-consistent lookups and the step memo           matcher.h
//   L2Space            pool slots, eviction on a full pool, watermarks      l2_space.h
//   SimSignalPump      SIM engines' layer and ready counters                 sim_signal_pump.h
//   L3Writer           L2 -> L3 writes under the write policies              l3_writer.h
//   L3Prefetcher       L3 -> L2 prefetch ops                                 l3_prefetcher.h
//   CacheAdmin         AdminService listings, stats, Evict and Clear         cache_admin.h
//
// Threads: RPCs on gRPC's callback threads, concurrently; no handler blocks except
// UnregisterEngine (for its drain, at most ServerLimits.max_wait_ms). Owned threads: the op
// completion thread (OpTable), the SIM signal pump, and the housekeeper, which every
// housekeeping_interval reaps sessions whose lease lapsed (their ops cancelled, pins dropped,
// mappings closed), expires pin leases, forgets old op results and memoized Match answers, frees
// pages an admin Clear doomed once their copies ended, and evicts L2 down to the low watermark
// when the pool is above the high one.
//
// Without L3 tiers (storage.tiers = ""), Match reports no L3 hits, Prefetch answers an op whose
// pages are ALREADY_PRESENT or MISS, and every page stays in L2 only.
#ifndef KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_
#define KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/host_pool.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"
#include "server/admin/cache_admin.h"
#include "server/config/cache_limits.h"
#include "server/metrics/cache_metrics.h"
#include "server/config/config.h"
#include "server/datapath/device_mover.h"
#include "server/admin/daemon_info.h"
#include "server/datapath/device_set.h"
#include "server/l3/l3_prefetcher.h"
#include "server/l3/l3_tiers.h"
#include "server/l3/l3_writer.h"
#include "server/l2/l2_space.h"
#include "server/datapath/matcher.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"
#include "server/datapath/sim_signal_pump.h"

namespace kvcellar::server {

struct CacheServiceOptions {
  Config config;
  core::HostPool* pool = nullptr;  // Required; outlives the service.
  // The devices engines' memory is on, by kind; empty: none (WORKER registrations are refused
  // with DEVICE_UNAVAILABLE). The backends outlive the service.
  DeviceSet devices;
  uint64_t daemon_epoch = 0;
  // nullptr: DefaultRegistry(). Outlives the service.
  MetricsRegistry* metrics = nullptr;
  // The L3 tiers; nullptr or empty: none. Outlives the service.
  L3Tiers* l3 = nullptr;
  // How often the housekeeper runs. Pin and session leases lapse at most this late.
  absl::Duration housekeeping_interval = absl::Milliseconds(20);
};

class CacheServiceImpl final : public kvcellar::v1::CacheService::CallbackService {
 public:
  explicit CacheServiceImpl(CacheServiceOptions options);
  // Ends every session (ops cancelled, mappings closed) and stops the threads. The gRPC server
  // must have been shut down first.
  ~CacheServiceImpl() override;
  CacheServiceImpl(const CacheServiceImpl&) = delete;
  CacheServiceImpl& operator=(const CacheServiceImpl&) = delete;

  grpc::ServerUnaryReactor* RegisterEngine(grpc::CallbackServerContext* context,
                                           const v1::RegisterEngineRequest* request,
                                           v1::RegisterEngineResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterEngine(grpc::CallbackServerContext* context,
                                             const v1::UnregisterEngineRequest* request,
                                             v1::UnregisterEngineResponse* response) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* context,
                                  const v1::MatchRequest* request,
                                  v1::MatchResponse* response) override;
  grpc::ServerUnaryReactor* Prefetch(grpc::CallbackServerContext* context,
                                     const v1::PrefetchRequest* request,
                                     v1::PrefetchResponse* response) override;
  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* context,
                                 const v1::LoadRequest* request,
                                 v1::LoadResponse* response) override;
  grpc::ServerUnaryReactor* Backup(grpc::CallbackServerContext* context,
                                   const v1::BackupRequest* request,
                                   v1::BackupResponse* response) override;
  grpc::ServerUnaryReactor* WaitOps(grpc::CallbackServerContext* context,
                                    const v1::WaitOpsRequest* request,
                                    v1::WaitOpsResponse* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;

  // The daemon is shutting down: new registrations and data ops get UNAVAILABLE (NOT_READY),
  // Heartbeat says draining, and pending WaitOps return at once.
  void SetDraining();

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
  // The primary device's kind (UNSPECIFIED without one) and every kind served.
  v1::DeviceKind device_kind() const { return devices_.primary_kind(); }
  const DeviceSet& devices() const { return devices_; }
  const CacheLimits& limits() const { return limits_; }
  // For tests and admin tools: the namespaces and their indexes.
  NamespaceRegistry& namespaces() { return namespaces_; }
  // For tests: L2 space (region releases), the L3 writer and prefetcher (idle without L3 tiers).
  L2Space& l2() { return l2_; }
  L3Writer& l3_writer() { return writer_; }
  L3Prefetcher& l3_prefetcher() { return prefetcher_; }
  // The AdminService's view of the cache (listings, statistics, Evict, Clear).
  CacheAdmin& admin() { return admin_; }

  // Runs one housekeeping pass now (tests; the housekeeper thread runs it periodically).
  void Housekeep();

 private:
  struct EndCounts {
    uint32_t ops_completed = 0;
    uint32_t ops_cancelled = 0;
    uint32_t pins_released = 0;
  };

  absl::Status DoRegister(grpc::CallbackServerContext* context,
                          const v1::RegisterEngineRequest& request,
                          v1::RegisterEngineResponse* response);
  absl::Status DoUnregister(const v1::UnregisterEngineRequest& request,
                            v1::UnregisterEngineResponse* response);
  absl::Status DoMatch(const v1::MatchRequest& request, v1::MatchResponse* response);
  absl::Status DoPrefetch(const v1::PrefetchRequest& request, v1::PrefetchResponse* response);
  absl::Status DoLoad(const v1::LoadRequest& request, v1::LoadResponse* response);
  absl::Status DoBackup(const v1::BackupRequest& request, v1::BackupResponse* response);
  absl::Status DoRelease(const v1::ReleaseRequest& request, v1::ReleaseResponse* response);

  // The live session, or SESSION_UNKNOWN.
  absl::StatusOr<std::shared_ptr<Session>> FindSession(uint64_t session_id) const;
  absl::Status CheckNotDraining() const;
  // Ends a session already removed from the registry: waits up to `drain` for its ops, cancels
  // the rest, closes its mapping (after which no copy touches engine memory) and drops its pins.
  EndCounts EndSession(const std::shared_ptr<Session>& session, bool last_of_instance,
                       absl::Duration drain, absl::string_view reason);
  void HousekeeperLoop();
  void AddCollectors();

  const Config config_;
  const CacheLimits limits_;
  const uint64_t daemon_epoch_;
  const DeviceSet devices_;
  const absl::Duration housekeeping_interval_;
  std::atomic<bool> draining_{false};

  // Declaration order is construction order; destruction runs backwards, so every component is
  // destroyed before what it points to.
  CacheMetrics metrics_;
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
  DeviceMover mover_;
  Matcher matcher_;
  CacheAdmin admin_;

  absl::Mutex housekeeper_mu_;
  bool stop_ ABSL_GUARDED_BY(housekeeper_mu_) = false;
  std::thread housekeeper_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_CACHE_SERVICE_H_
