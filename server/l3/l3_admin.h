// L3Admin: the seam through which AdminService reports and changes the storage tiers (L3).
//
// AdminService owns the L2 side itself (cache_admin.h). The L3 side belongs to whatever wires the
// storage backends into the daemon; it implements this interface and hands a pointer to the
// AdminService constructors. A null pointer means no L3 is configured: requests naming TIER_L3
// then succeed with nothing to report, and naming a backend is INVALID_ARGUMENT (no backend has
// that name).
//
// Threads: AdminService calls it from gRPC callback threads, concurrently; implementations are
// thread-safe. Calls may block on I/O (admin RPCs are off the engine hot path).
#ifndef KVCELLAR_SERVER_L3_L3_ADMIN_H_
#define KVCELLAR_SERVER_L3_L3_ADMIN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/page_key.h"

namespace kvcellar::server {

// Which objects an L3 operation applies to: one namespace, optionally one subtree of it (the
// page and every page below it), on the named backends (empty: all).
struct L3Scope {
  core::PageKey ns_digest;
  std::optional<core::PageKey> subtree_root;
  std::vector<std::string> backends;
};

// Usage of one backend (the TierUsage of TIER_L3).
struct L3BackendUsage {
  std::string backend;  // Its configured name.
  uint64_t objects = 0;
  uint64_t pages = 0;
  uint64_t bytes = 0;
};

class L3Admin {
 public:
  virtual ~L3Admin() = default;

  // The backends' configured names, in lookup order.
  virtual std::vector<std::string> Backends() const = 0;
  // Usage in scope, one entry per backend in scope, in lookup order.
  virtual absl::StatusOr<std::vector<L3BackendUsage>> Usage(const L3Scope& scope) = 0;
  // Evicts unpinned objects in scope, coldest first, until `target_bytes` are gone (0: every
  // eligible one); dry_run reports without removing. Returns what went, per backend.
  virtual absl::StatusOr<std::vector<L3BackendUsage>> Evict(const L3Scope& scope,
                                                           uint64_t target_bytes,
                                                           bool dry_run) = 0;
  // Removes every object in scope the daemon's index knows; dry_run reports without removing.
  virtual absl::StatusOr<std::vector<L3BackendUsage>> Clear(const L3Scope& scope,
                                                           bool dry_run) = 0;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_ADMIN_H_
