// CacheAdmin: the AdminService RPCs that read or change the cache itself: ListEngines,
// ListNamespaces, GetStats, Evict and Clear (admin_service.proto). AdminServiceImpl checks the
// caller's identity and turns the absl::Status into gRPC; this class does the work on the
// CacheService's components and fills the reply.
//
// Evict and Clear reuse the data path's own machinery: eviction is the index's policy order
// (RadixIndex::EvictScope through L2Space, as pool-full and watermark eviction), slots go back to
// the host pool through L2Space once each, pins are revoked through PinTable. Pages a copy is
// still using are never freed: Evict skips them; Clear revokes the Match pins in scope, removes
// the rest, and dooms pages under an in-flight copy (invisible to Match at once, freed by the
// housekeeper when the copy ends: L2Space::ReapDoomed).
//
// L3: through the optional L3Admin seam (l3_admin.h); null when no storage tier is configured,
// and then TIER_L3 contributes nothing.
//
// Threads: gRPC callback threads, concurrently. No state of its own; its components are
// thread-safe. Evict and Clear on the same namespace may interleave: each page still goes once.
#ifndef KVCELLAR_SERVER_ADMIN_CACHE_ADMIN_H_
#define KVCELLAR_SERVER_ADMIN_CACHE_ADMIN_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcellar/v1/admin_service.pb.h"
#include "server/metrics/cache_metrics.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_admin.h"
#include "server/session/namespace_registry.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

class CacheAdmin {
 public:
  // Every pointer outlives this object.
  CacheAdmin(NamespaceRegistry* namespaces, SessionRegistry* sessions, PinTable* pins, L2Space* l2,
             CacheMetrics* metrics, absl::Time start_time);

  absl::Status ListEngines(const v1::ListEnginesRequest& request,
                           v1::ListEnginesResponse* response) const;
  absl::Status ListNamespaces(const v1::ListNamespacesRequest& request, L3Admin* l3,
                              v1::ListNamespacesResponse* response) const;
  absl::Status GetStats(const v1::GetStatsRequest& request, v1::GetStatsResponse* response) const;
  absl::Status Evict(const v1::EvictRequest& request, L3Admin* l3, v1::EvictResponse* response);
  // FAILED_PRECONDITION (CONFIRM_REQUIRED) without confirm, unless dry_run.
  absl::Status Clear(const v1::ClearRequest& request, L3Admin* l3, v1::ClearResponse* response);

 private:
  NamespaceRegistry* const namespaces_;
  SessionRegistry* const sessions_;
  PinTable* const pins_;
  L2Space* const l2_;
  CacheMetrics* const metrics_;
  const absl::Time start_time_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_ADMIN_CACHE_ADMIN_H_
