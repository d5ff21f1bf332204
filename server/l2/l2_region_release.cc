// L2Space's region release: moving a whole host-pool region from one size class to another by
// evicting exactly the pages whose slots live in it (server/l2/l2_space.h, "Region release").
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "server/l2/l2_space.h"

namespace kvcellar::server {
namespace {

// Regions held per class now: out[c].
std::vector<uint32_t> RegionsPerClass(const core::HostPool& pool) {
  std::vector<uint32_t> out(pool.slot_sizes().size(), 0);
  for (const core::SizeClassStats& s : pool.Stats()) out[s.size_class] = s.regions;
  return out;
}

// The pool's regions over the classes holding any, `c` included; at least 1.
uint32_t FairShare(const core::HostPool& pool, const std::vector<uint32_t>& regions, uint16_t c) {
  uint32_t active = regions[c] == 0 ? 1 : 0;
  for (uint32_t n : regions) active += n > 0;
  return std::max<uint32_t>(1, pool.region_count() / active);
}

}  // namespace

bool L2Space::UnderShare(uint16_t c) const {
  const std::vector<uint32_t> regions = RegionsPerClass(*pool_);
  return regions[c] < FairShare(*pool_, regions, c);
}

L2Space::RegionEviction L2Space::EvictRegion(uint32_t r, uint16_t size_class, bool dry_run) {
  RegionEviction out;
  std::vector<core::OwnedSlot> slots;
  if (!pool_->RegionSlots(r, size_class, &slots).ok()) return out;  // Emptied meanwhile.
  // One index call per namespace (a size class may serve several).
  absl::flat_hash_map<uint32_t, std::vector<core::SlotHolder>> by_ns;
  for (const core::OwnedSlot& s : slots) {
    if (s.owner.ns == 0) {
      out.blocked = true;  // Allocated without an owner record: nobody can say what it holds.
      continue;
    }
    by_ns[s.owner.ns].push_back({s.owner.key, s.owner.shard, s.slot});
  }
  if (dry_run && out.blocked) return out;
  for (auto& [id, holders] : by_ns) {
    std::shared_ptr<Namespace> ns = namespaces_->ById(id);
    core::RadixIndex* index = ns != nullptr ? ns->index() : nullptr;
    if (index == nullptr) {
      out.blocked = true;
      continue;
    }
    std::vector<core::ReleasedObject> evicted;
    const core::HolderEvictResult result = index->EvictHolders(holders, dry_run, &evicted);
    out.objects += result.objects;
    out.pages += result.pages;
    out.blocked |= result.blocked > 0;
    out.waiting |= result.absent > 0;
    if (!dry_run) {
      FinishEviction(*ns, evicted, EvictReason::kRegionRelease, TenantEvictCause::kRegionRelease);
    }
  }
  return out;
}

absl::StatusOr<core::SlotRef> L2Space::ReleaseRegionFor(uint16_t c, const core::SlotOwner& owner,
                                                        bool anyway) {
  absl::MutexLock lock(&release_mu_);
  // Another thread may have released a region while this one waited.
  absl::StatusOr<core::SlotRef> slot = pool_->AllocateInClass(c, owner);
  if (slot.ok() || slot.status().code() != absl::StatusCode::kResourceExhausted) return slot;

  // Releases already under way first: evict what is left in them (a page whose write was in
  // flight has committed since), give up those that hold a busy page, wait for the rest.
  const std::vector<core::RegionInfo> infos = pool_->RegionInfos();
  uint32_t waiting = 0;
  for (const core::RegionInfo& info : infos) {
    if (!info.draining) continue;
    const RegionEviction e = EvictRegion(info.region, info.size_class, /*dry_run=*/false);
    slot = pool_->AllocateInClass(c, owner);
    if (slot.ok()) return slot;
    if (e.blocked) {
      pool_->UndrainRegion(info.region, info.size_class);
    } else {
      ++waiting;
    }
  }
  if (waiting >= kMaxDraining) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host pool full: ", waiting, " regions being released are waiting for their slots"));
  }

  // Victim regions: of classes above their fair share (or, `anyway`, well above c).
  const std::vector<uint32_t> regions = RegionsPerClass(*pool_);
  const uint32_t share = FairShare(*pool_, regions, c);
  auto victim_class = [&](uint16_t v) {
    if (v == c) return false;
    if (regions[v] > share) return true;
    return anyway && (regions[v] >= regions[c] + 2 || (regions[c] == 0 && regions[v] > 0));
  };
  std::vector<core::RegionInfo> candidates;
  for (const core::RegionInfo& info : infos) {
    if (!info.draining && victim_class(info.size_class)) candidates.push_back(info);
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const core::RegionInfo& a, const core::RegionInfo& b) { return a.used < b.used; });
  if (candidates.size() > kReleaseCandidates) candidates.resize(kReleaseCandidates);
  const core::RegionInfo* best = nullptr;
  uint64_t best_objects = 0;
  for (const core::RegionInfo& info : candidates) {
    const RegionEviction e = EvictRegion(info.region, info.size_class, /*dry_run=*/true);
    if (e.blocked || e.waiting) continue;
    if (best == nullptr || e.objects < best_objects) {
      best = &info;
      best_objects = e.objects;
    }
  }
  if (best == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool full: no region of another size class can be released for class ",
                     c, " (", candidates.size(), " candidates, each holding a busy page)"));
  }

  const core::RegionInfo victim = *best;
  if (!pool_->DrainRegion(victim.region, victim.size_class).ok()) {
    return pool_->AllocateInClass(c, owner);  // It emptied and changed hands meanwhile.
  }
  const RegionEviction e = EvictRegion(victim.region, victim.size_class, /*dry_run=*/false);
  regions_released_.fetch_add(1, std::memory_order_relaxed);
  KVLOG(Info, "l2 region released",
        {{"region", victim.region},
         {"from_slot_bytes", pool_->slot_sizes()[victim.size_class]},
         {"to_slot_bytes", pool_->slot_sizes()[c]},
         {"evicted_pages", e.pages},
         {"evicted_objects", e.objects},
         {"waiting", e.waiting},
         {"blocked", e.blocked}});
  slot = pool_->AllocateInClass(c, owner);
  if (slot.ok()) return slot;
  // A page became busy since the dry run: the region stays with its class. Otherwise slots are
  // still held (write-back, or an allocation on its way to the index): a later Allocate finds
  // the region free or evicts the rest.
  if (e.blocked) pool_->UndrainRegion(victim.region, victim.size_class);
  return slot;
}

}  // namespace kvcellar::server
