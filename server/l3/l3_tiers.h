// L3Tiers: the daemon's ordered list of L3 storage backends (DESIGN.md "Tiers"), opened from
// `storage.tiers` (server/config/l3_tier_spec.h), with what the layers above need to know of each:
// its name, its admission threshold, whether other nodes share it.
//
// Tier i is bit i of the index's per-shard L3 mask (core/radix_index.h) and index i of
// MatchResult.l3_hit_pages_by_tier and RegisterEngineResponse.l3_tier_names. Lookup order is
// list order: the first tier holding a page is the one it is read from.
//
// Opening fails only for configuration the daemon cannot serve (a file tier's directory that
// cannot be created or used); an unreachable Redis server is an L3 that is down, not a startup
// error: its objects miss (kRetry) until it answers.
//
// Threads: immutable after Open; the backends are thread-safe. Collect() runs at scrape time.
#ifndef KVCELLAR_SERVER_L3_L3_TIERS_H_
#define KVCELLAR_SERVER_L3_L3_TIERS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/config/config.h"
#include "server/config/l3_tier_spec.h"
#include "server/metrics/metrics.h"
#include "storage/backend.h"
#include "storage/file_backend.h"
#include "storage/redis_backend.h"

namespace kvcellar::server {

struct L3Tier {
  L3TierSpec spec;
  std::unique_ptr<storage::Backend> backend;
  // The backend when it is a file tier (its startup scan, l3_recovery.h); else nullptr.
  storage::FileBackend* file() const {
    return spec.kind == L3TierSpec::Kind::kFile ? static_cast<storage::FileBackend*>(backend.get())
                                                : nullptr;
  }
  // The backend when it is a Redis tier that keeps an index (spec.index: its readback at start,
  // l3_recovery.h); else nullptr.
  storage::RedisBackend* redis_index() const {
    return spec.kind != L3TierSpec::Kind::kFile && spec.index
               ? static_cast<storage::RedisBackend*>(backend.get())
               : nullptr;
  }
  // The backend when it is a Redis tier; else nullptr.
  storage::RedisBackend* redis() const {
    return spec.kind != L3TierSpec::Kind::kFile ? static_cast<storage::RedisBackend*>(backend.get())
                                                : nullptr;
  }
  // Other nodes write to this tier too: the index never knows all of it (lookups ask it).
  bool shared = false;
};

class L3Tiers {
 public:
  // No tiers configured gives an empty list (size() == 0): L2 only.
  static absl::StatusOr<std::unique_ptr<L3Tiers>> Open(const StorageConfig& config);
  // The empty list.
  static std::unique_ptr<L3Tiers> None() { return std::unique_ptr<L3Tiers>(new L3Tiers()); }
  // Waits for every batch in flight (their callbacks included) while destroying the backends.
  ~L3Tiers();

  size_t size() const { return tiers_.size(); }
  bool empty() const { return tiers_.empty(); }
  L3Tier& tier(size_t i) { return tiers_[i]; }
  const L3Tier& tier(size_t i) const { return tiers_[i]; }
  std::vector<std::string> names() const;
  // Some tier has an admission threshold (admit_after > 0).
  bool any_admission() const;

  // Backend statistics as Prometheus samples (kvcellar_l3_*), labelled by tier name.
  void Collect(MetricWriter& out) const;

 private:
  L3Tiers() = default;
  std::vector<L3Tier> tiers_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L3_L3_TIERS_H_
