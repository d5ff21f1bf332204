// DaemonInfo: what kvcellard reports about itself (AdminService.GetStatus, kvcellarctl status).
#ifndef KVCELLAR_SERVER_ADMIN_DAEMON_INFO_H_
#define KVCELLAR_SERVER_ADMIN_DAEMON_INFO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/l2/l2_recovery.h"
#include "server/l3/l3_recovery.h"
#include "server/session/tenant_metrics.h"

namespace kvcellar::server {

struct ListenerInfo {
  enum class Kind { kUnix, kAdmin, kTcp, kHttp };
  enum class Security { kUnixPermissions, kPlaintext, kTls, kMtls };
  Kind kind;
  std::string address;  // A socket path, or host:port as bound (port 0 resolved).
  Security security;
};

// One L3 tier as GetStatus reports it (the backend's own statistics).
struct L3TierInfo {
  std::string name;
  std::string kind;  // "file", "redis", "redis-cluster"
  bool healthy = true;
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  std::string last_error;  // "" if none since start
  int64_t last_error_unix_ms = 0;
  L3ScanStats recovery;  // Its startup scan or index readback (l3_recovery.h).
};

struct DaemonInfo {
  absl::Time start_time;
  uint64_t epoch = 0;  // Random per start: clients tell a restarted daemon apart.
  std::vector<ListenerInfo> listeners;
  std::string config_digest;
  std::string config_file;  // "" when running on defaults and overrides.
  uint64_t pool_capacity_bytes = 0;
  uint64_t pool_used_bytes = 0;
  // Of the used bytes: slots of pinned pages, and slots being written (CacheServiceImpl's
  // L2Usage, as kvcellar_l2_pinned_bytes and kvcellar_l2_in_flight_bytes).
  uint64_t pool_pinned_bytes = 0;
  uint64_t pool_in_flight_bytes = 0;
  bool pool_huge_pages = false;
  L2RecoveryStats l2_recovery;  // What this start recovered of L2 (Cache::l2_recovery).
  // CacheService: live sessions, distinct instances among them, namespaces known; the device
  // backend ("sim", "cuda", or "" when none).
  uint64_t sessions = 0;
  uint64_t instances = 0;
  uint64_t namespaces = 0;
  std::string device_kind;
  bool ready = false;
  bool draining = false;
  std::vector<L3TierInfo> l3_tiers;  // In lookup order.
  std::vector<TenantUsage> tenants;  // In account order (server/session/tenant_metrics.h).
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_ADMIN_DAEMON_INFO_H_
