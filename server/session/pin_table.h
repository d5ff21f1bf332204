// PinTable: the pins Match hands out, which keep L2 pages from being evicted until the engine
// has loaded them (docs/api.md, "Leases").
//
// A pin belongs to an engine instance, with one hold per TP rank (tp_size holds: every rank loads
// the pages into its own blocks). A rank's Load(release_pin) drops its hold; Release drops the
// whole pin; the pages unpin when every hold is gone, when the pin's lease lapses, or when the
// instance's last session ends. A worker session that ends drops its rank's holds.
//
// In the index (core/radix_index.h) a pin's pages are pinned with the pin id as the owner: ids
// come from the daemon-wide id sequence, so they never collide with another pin or an op's
// own copy pin, and ReleaseOwner(pin id) drops exactly this pin. The index enforces the lease
// on the pages (ExpireLeases); this table forgets the record at the same deadline, so Heartbeat
// reports it unknown and Load treats it as expired.
//
// Threads: any gRPC handler, the op completion thread and the housekeeper. One mutex guards the
// table; it is never held while calling an index.
#ifndef KVCELLAR_SERVER_SESSION_PIN_TABLE_H_
#define KVCELLAR_SERVER_SESSION_PIN_TABLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/page_key.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

class PinTable {
 public:
  PinTable() = default;

  // Records pin `id`, whose pages `keys` the caller already pinned in `ns`'s index with owner
  // `id` and deadline now + lease. `holds` is the number of ranks that must each release it.
  void Add(uint64_t id, const std::string& instance_id, std::shared_ptr<Namespace> ns,
           std::vector<core::PageKey> keys, uint32_t holds, absl::Duration lease,
           absl::Time deadline, uint64_t session_id = 0) ABSL_LOCKS_EXCLUDED(mu_);

  // A prefetch landed `keys` under pin `id`: pins them in the index until the pin's deadline and
  // adds them to the pin (renewals cover them). Returns false, pinning nothing, when the pin has
  // ended.
  bool Extend(uint64_t id, absl::Span<const core::PageKey> keys) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops `rank`'s hold on pin `id` of `instance_id`; the pin ends with its last hold. Unknown
  // pins (expired, released, another instance's) are ignored. Returns whether the pin ended.
  bool DropHold(uint64_t id, const std::string& instance_id, uint32_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the whole pin. Returns false when unknown to this instance.
  bool Release(uint64_t id, const std::string& instance_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Extends each pin of the instance by its own lease from `now`; returns the unknown ids.
  std::vector<uint64_t> Renew(absl::Span<const uint64_t> ids, const std::string& instance_id,
                              absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every pin whose lease lapsed at `now`. Returns how many.
  size_t ExpireDue(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // The instance's last session ended: ends all its pins. Returns how many.
  size_t ReleaseInstance(const std::string& instance_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A worker of the instance ended: drops its rank's holds. Returns the pins that ended.
  size_t DropRankHolds(const std::string& instance_id, uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);

  // Admin Clear: ends every pin for which `revoke(namespace, keys)` is true, unpinning its pages
  // (called under the table's lock: keep it cheap and call no index). Returns how many; their
  // later Loads miss and Heartbeat reports them unknown.
  size_t Revoke(
      absl::FunctionRef<bool(const Namespace& ns, absl::Span<const core::PageKey> keys)> revoke)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Live pins and the pages under them, by the session whose Match created them (ListEngines).
  struct Usage {
    uint32_t pins = 0;
    uint64_t pages = 0;
  };
  absl::flat_hash_map<uint64_t, Usage> UsageBySession() const ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pin {
    std::string instance_id;
    uint64_t session_id = 0;  // The session whose Match created it; 0: unknown.
    std::shared_ptr<Namespace> ns;
    std::vector<core::PageKey> keys;
    std::vector<bool> held;  // Per rank.
    uint32_t holds_left = 0;
    absl::Duration lease;
    absl::Time deadline;
  };
  // Unpins a removed pin's pages in its index (outside the table's lock).
  static void Unpin(uint64_t id, const Pin& pin);
  // Ends every pin for which pred(pin) is true (pred may change the pin; it runs under the
  // lock), then unpins them. Returns how many ended.
  template <typename Pred>
  size_t EndWhere(Pred pred) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Pin> pins_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_PIN_TABLE_H_
