// L3TierAdmin: AdminService's view of the L3 tiers (server/l3/l3_admin.h), over the daemon's tiers
// (l3_tiers.h) and what each namespace's index knows of them.
//
// The index is what this daemon knows: copies it wrote, read, or learned of through a Match
// lookup. Shared tiers also hold other nodes' objects, which a daemon neither counts nor removes
// (they are theirs); a file tier's own total is kvcellar_l3_used_bytes. Usage counts the index's
// marks; Clear deletes every marked object in scope from its backend and clears the marks;
// Evict does the same deepest pages first (a page before its parent) until the target bytes.
// L3 keeps no access order of its own here, so "coldest first" for L3 is "leaves first".
//
// Threads: any (gRPC callback threads); calls block on backend deletes, bounded by their timeouts.
#ifndef KVCELLAR_SERVER_L3_L3_TIER_ADMIN_H_
#define KVCELLAR_SERVER_L3_L3_TIER_ADMIN_H_

#include <string>
#include <vector>

#include "server/l3/l3_admin.h"
#include "server/l3/l3_tiers.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

class L3TierAdmin final : public L3Admin {
 public:
  // Both outlive this object.
  L3TierAdmin(L3Tiers* tiers, NamespaceRegistry* namespaces)
      : tiers_(tiers), namespaces_(namespaces) {}

  std::vector<std::string> Backends() const override { return tiers_->names(); }
  absl::StatusOr<std::vector<L3BackendUsage>> Usage(const L3Scope& scope) override;
  absl::StatusOr<std::vector<L3BackendUsage>> Evict(const L3Scope& scope, uint64_t target_bytes,
                                                   bool dry_run) override;
  absl::StatusOr<std::vector<L3BackendUsage>> Clear(const L3Scope& scope, bool dry_run) override;

 private:
  // Removes (or counts, dry) marked objects in scope, deepest page first, until `target_bytes`
  // (0: all).
  absl::StatusOr<std::vector<L3BackendUsage>> Remove(const L3Scope& scope, uint64_t target_bytes,
                                                    bool dry_run);
  // Tier indexes the scope names (all when it names none), in lookup order.
  std::vector<size_t> TiersIn(const L3Scope& scope) const;
  // One empty entry per tier, named.
  std::vector<L3BackendUsage> ZeroUsage(const std::vector<size_t>& tiers) const;

  L3Tiers* const tiers_;
  NamespaceRegistry* const namespaces_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_TIER_ADMIN_H_
