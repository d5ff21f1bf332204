#include "server/l2/l2_space.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/slot_journal.h"
#include "platform/log.h"

namespace kvcellar::server {

L2Space::L2Space(core::HostPool* pool, NamespaceRegistry* namespaces, double high_watermark,
                 double low_watermark, CacheMetrics* metrics, TenantLedger* tenants)
    : pool_(pool),
      namespaces_(namespaces),
      high_watermark_(high_watermark),
      low_watermark_(low_watermark),
      metrics_(metrics),
      tenants_(tenants),
      sealer_(pool->journal() != nullptr ? std::make_unique<L2Sealer>(pool, pool->journal())
                                         : nullptr) {}

L2Space::~L2Space() = default;

absl::StatusOr<core::SlotRef> L2Space::TryAllocate(Namespace& ns, const core::PageKey& key,
                                                   uint16_t shard) {
  TenantAccount* account = AccountOf(ns);
  const uint64_t slot_bytes = ns.slot_bytes();
  if (account != nullptr && !account->TryCharge(slot_bytes)) {
    return absl::ResourceExhaustedError("the tenant is at its L2 ceiling");
  }
  absl::StatusOr<core::SlotRef> slot = pool_->Allocate(ns.object_bytes(), Owner(ns, key, shard));
  if (!slot.ok() && account != nullptr) account->Discharge(slot_bytes);
  return slot;
}

absl::StatusOr<core::SlotRef> L2Space::Allocate(Namespace& ns, const core::PageKey& key,
                                                uint16_t shard, uint64_t evict_bytes) {
  TenantAccount* account = AccountOf(ns);
  const uint64_t slot_bytes = ns.slot_bytes();
  if (account != nullptr && !account->TryCharge(slot_bytes)) {
    // At its ceiling: room comes from its own pages only, the requesting namespace's first.
    const uint64_t want = std::max(evict_bytes, slot_bytes);
    if (EvictFrom(ns, want, EvictReason::kPoolFull, TenantEvictCause::kOwn) == 0) {
      for (const std::shared_ptr<Namespace>& other : namespaces_->Snapshot()) {
        if (other.get() == &ns || other->tenant_account() != account ||
            other->slot_bytes() != slot_bytes) {
          continue;
        }
        if (EvictFrom(*other, want, EvictReason::kPoolFull, TenantEvictCause::kOwn) > 0) break;
      }
    }
    if (!account->TryCharge(slot_bytes)) {
      account->CountCeilingRefusal();
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant '", ns.spec().tenant.substr(0, 80), "' is at its L2 ceiling (",
                       account->ceiling_bytes(), " bytes) and none of its pages can go now"));
    }
  }
  absl::StatusOr<core::SlotRef> slot = AllocateCharged(ns, key, shard, evict_bytes);
  if (!slot.ok() && account != nullptr) account->Discharge(slot_bytes);
  return slot;
}

absl::StatusOr<core::SlotRef> L2Space::AllocateCharged(Namespace& ns, const core::PageKey& key,
                                                       uint16_t shard, uint64_t evict_bytes) {
  const uint64_t object_bytes = ns.object_bytes();
  const core::SlotOwner owner = Owner(ns, key, shard);
  absl::StatusOr<core::SlotRef> slot = pool_->Allocate(object_bytes, owner);
  if (slot.ok() || slot.status().code() != absl::StatusCode::kResourceExhausted) return slot;
  absl::StatusOr<uint16_t> c = pool_->ClassFor(object_bytes);
  if (!c.ok()) return c.status();

  // A class under its share of the pool grows by a whole region of another class.
  if (UnderShare(*c)) {
    slot = ReleaseRegionFor(*c, owner, /*anyway=*/false);
    if (slot.ok()) return slot;
  }
  // Otherwise it makes room within itself. Only same-class evictions help: another class's freed
  // slots are scattered over its regions and would not free one (that is what region release is
  // for). The order (see "Tenant quotas" in the header): tenants above their guarantee first,
  // the requesting namespace before the others, the others largest first; then the requester's
  // own tenant below its guarantee.
  evict_bytes = std::max(evict_bytes, ns.slot_bytes());
  // The requester's own tenant counts as above its guarantee when it is at least there without
  // this allocation (whose charge is taken already). Guarantee 0: always, the order before quotas.
  const TenantAccount* mine = AccountOf(ns);
  const bool mine_above =
      mine == nullptr || mine->guarantee_bytes() == 0 || mine->excess_bytes() >= ns.slot_bytes();
  std::vector<std::pair<uint64_t, std::shared_ptr<Namespace>>> same_class;
  for (std::shared_ptr<Namespace>& other : namespaces_->Snapshot()) {
    if (other.get() == &ns || other->index() == nullptr || other->slot_bytes() != ns.slot_bytes()) {
      continue;
    }
    same_class.emplace_back(other->index()->Stats().l2_bytes, std::move(other));
  }
  std::sort(same_class.begin(), same_class.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  bool freed = false;
  auto retry = [&](uint64_t bytes_freed) {
    if (bytes_freed == 0) return false;
    freed = true;
    slot = pool_->Allocate(object_bytes, owner);
    return slot.ok();
  };
  auto own_tenant = [&](const Namespace& other) {
    return mine != nullptr && AccountOf(other) == mine;
  };
  // (1) Above their guarantee: the requester first (when its tenant is), then the others.
  if (mine_above &&
      retry(EvictFrom(ns, evict_bytes, EvictReason::kPoolFull, TenantEvictCause::kOwn))) {
    return slot;
  }
  for (auto& [bytes, other] : same_class) {
    if (bytes == 0) break;
    if (own_tenant(*other)) {
      if (!mine_above) continue;  // In (3).
      if (retry(EvictFrom(*other, evict_bytes, EvictReason::kPoolFull, TenantEvictCause::kOwn))) {
        return slot;
      }
      continue;
    }
    if (retry(EvictForOther(*other, evict_bytes, EvictReason::kPoolFull,
                            TenantEvictCause::kOtherTenant))) {
      return slot;
    }
  }
  // (3) The requester's own tenant, below its guarantee: its own pages, nobody else's.
  if (!mine_above) {
    if (retry(EvictFrom(ns, evict_bytes, EvictReason::kPoolFull, TenantEvictCause::kOwn))) {
      return slot;
    }
    for (auto& [bytes, other] : same_class) {
      if (bytes == 0 || !own_tenant(*other)) continue;
      if (retry(EvictFrom(*other, evict_bytes, EvictReason::kPoolFull, TenantEvictCause::kOwn))) {
        return slot;
      }
    }
  }
  // Nothing of this class could go (all busy, or it holds no region): a region, if another
  // class has plenty.
  if (!freed) {
    absl::StatusOr<core::SlotRef> released = ReleaseRegionFor(*c, owner, /*anyway=*/true);
    if (released.ok()) return released;
  }
  return slot;
}

uint64_t L2Space::EvictForOther(Namespace& victim, uint64_t bytes, EvictReason reason,
                                TenantEvictCause cause) {
  const TenantAccount* account = AccountOf(victim);
  if (account == nullptr || account->guarantee_bytes() == 0) {
    return EvictFrom(victim, bytes, reason, cause);  // Everything it holds is excess.
  }
  core::RadixIndex* index = victim.index();
  if (index == nullptr) return 0;
  // A page frees at most all its shards' slots; whole pages within the excess never take the
  // tenant below its guarantee. Under reclaim_mu_, so no other eviction spends the same excess
  // between the read and the frees (Free discharges before FinishEviction returns).
  const uint64_t page_bytes = std::max<uint64_t>(1, victim.shards() * victim.slot_bytes());
  absl::MutexLock lock(&reclaim_mu_);
  const uint64_t fits = account->excess_bytes() / page_bytes;
  const uint64_t wanted = (bytes + page_bytes - 1) / page_bytes;
  const uint64_t pages = std::min(fits, wanted);
  if (pages == 0) return 0;
  std::vector<core::ReleasedObject> evicted;
  index->EvictPages(static_cast<size_t>(pages), &evicted);
  return FinishEviction(victim, evicted, reason, cause);
}

void L2Space::JournalWriting(const Namespace& ns, const core::WriteRequest& w) {
  if (core::SlotJournal* journal = pool_->journal(); journal != nullptr) {
    journal->MarkWriting(w.slot, ns.id(), ns.geometry_epoch(), w.shard, w.key, w.parent);
  }
}

void L2Space::JournalCommitted(const Namespace& ns, core::SlotRef slot) {
  if (core::SlotJournal* journal = pool_->journal(); journal != nullptr) {
    const uint64_t length = ns.object_bytes();
    const core::PageKey key = journal->MarkLanded(slot, length);
    sealer_->Enqueue(slot, key, length);
  }
}

void L2Space::Free(core::SlotRef slot) {
  if (!slot.valid()) return;
  core::SlotOwner owner;
  if (absl::Status s = pool_->Free(slot, &owner); !s.ok()) {
    // The index hands each slot back exactly once; a failure here is a bookkeeping bug. Keep
    // serving (the slot stays allocated: a leak, never a double use; still charged).
    KVLOG(Error, "host pool free failed", {{"error", s.ToString()}});
    return;
  }
  // The record names the account its allocation charged (0: none).
  if (tenants_ != nullptr) {
    if (TenantAccount* account = tenants_->ByNumber(owner.tenant)) {
      account->Discharge(pool_->SlotBytes(slot));
    }
  }
}

void L2Space::FreeReleased(absl::Span<const core::ReleasedObject> released) {
  for (const core::ReleasedObject& r : released) Free(r.slot);
}

uint64_t L2Space::EvictFrom(Namespace& ns, uint64_t bytes, EvictReason reason,
                            TenantEvictCause cause) {
  core::RadixIndex* index = ns.index();
  if (index == nullptr) return 0;
  std::vector<core::ReleasedObject> evicted;
  index->EvictBytes(bytes, &evicted);
  return FinishEviction(ns, evicted, reason, cause);
}

uint64_t L2Space::FinishEviction(Namespace& ns, std::vector<core::ReleasedObject>& evicted,
                                 EvictReason reason, TenantEvictCause cause) {
  if (evicted.empty()) return 0;
  const uint64_t freed = evicted.size() * ns.slot_bytes();
  // A write-back observer takes the slots of pages it writes to L3 (and frees them after).
  if (L2EvictionObserver* observer = observer_.load(std::memory_order_acquire)) {
    observer->OnEvicted(ns, absl::MakeSpan(evicted));
  }
  FreeReleased(evicted);
  // Pages, not objects: an MHA page has one object per shard, evicted together.
  uint64_t pages = 0;
  for (size_t i = 0; i < evicted.size(); ++i) {
    if (i == 0 || evicted[i].key != evicted[i - 1].key) ++pages;
  }
  metrics_->CountEviction(reason, pages, freed);
  if (TenantAccount* account = AccountOf(ns)) account->CountEviction(cause, pages);
  NamespaceCounters::Add(ns.counters().evicted_objects, evicted.size());
  NamespaceCounters::Add(ns.counters().evicted_bytes, freed);
  return freed;
}

core::AdminEvictResult L2Space::EvictScope(Namespace& ns,
                                           const std::optional<core::PageKey>& subtree,
                                           uint64_t max_objects, bool dry_run,
                                           uint64_t* written_back_pages) {
  core::RadixIndex* index = ns.index();
  if (index == nullptr) return {};
  std::vector<core::ReleasedObject> evicted;
  core::AdminEvictResult result = index->EvictScope(subtree, max_objects, dry_run, &evicted);
  if (evicted.empty()) return result;
  // The one ending every eviction has: a write-back observer takes the slots of the pages it
  // writes to L3 (and frees them after), so WRITE_BACK pages are not lost to an admin Evict.
  FinishEviction(ns, evicted, EvictReason::kAdmin, TenantEvictCause::kAdmin);
  if (written_back_pages != nullptr) {
    // Pages, not objects: a page's shards are adjacent; it counts once any shard was taken.
    const core::PageKey* counted = nullptr;
    for (const core::ReleasedObject& r : evicted) {
      if (r.slot.valid() || (counted != nullptr && *counted == r.key)) continue;
      ++*written_back_pages;
      counted = &r.key;
    }
  }
  return result;
}

core::RemoveCounts L2Space::ClearScope(Namespace& ns, const std::optional<core::PageKey>& subtree,
                                       bool dry_run, std::vector<core::ReleasedObject>* removed) {
  core::RadixIndex* index = ns.index();
  if (index == nullptr) return {};
  std::vector<core::ReleasedObject> released;
  core::RemoveCounts counts = index->ClearScope(subtree, dry_run, &released);
  if (!dry_run) FreeCleared(ns, released);
  if (removed != nullptr) removed->insert(removed->end(), released.begin(), released.end());
  return counts;
}

void L2Space::FreeCleared(Namespace& ns, absl::Span<const core::ReleasedObject> released) {
  uint64_t l2_objects = 0;
  for (const core::ReleasedObject& r : released) {
    if (!r.slot.valid()) continue;
    Free(r.slot);
    ++l2_objects;
  }
  metrics_->CountCleared(l2_objects);
  NamespaceCounters::Add(ns.counters().cleared_objects, l2_objects);
}

size_t L2Space::ReapDoomed() {
  size_t pages = 0;
  for (const std::shared_ptr<Namespace>& ns : namespaces_->Snapshot()) {
    core::RadixIndex* index = ns->index();
    if (index == nullptr || index->DoomedPages() == 0) continue;
    std::vector<core::ReleasedObject> released;
    pages += index->ReapDoomed(&released);
    if (released.empty()) continue;
    FreeCleared(*ns, released);
  }
  return pages;
}

uint64_t L2Space::UsedBytes() const {
  uint64_t used = 0;
  for (const core::SizeClassStats& c : pool_->Stats()) used += c.bytes_used;
  return used;
}

uint64_t L2Space::EnforceWatermarks() {
  const double capacity = static_cast<double>(pool_->capacity_bytes());
  uint64_t used = UsedBytes();
  if (const L2EvictionObserver* observer = observer_.load(std::memory_order_acquire)) {
    used -= std::min(used, observer->held_bytes());
  }
  if (static_cast<double>(used) <= high_watermark_ * capacity) return 0;
  const uint64_t target = static_cast<uint64_t>(low_watermark_ * capacity);
  uint64_t to_free = used - std::min(used, target);

  // Each namespace gives up its share of the excess, in proportion to what it holds above its
  // tenant's guarantee (its part of its tenant's excess), so one busy model does not drain the
  // others and no tenant goes below its guarantee. Without quotas: in proportion to what it holds.
  std::vector<std::pair<double, std::shared_ptr<Namespace>>> weighted;
  double total = 0;
  for (std::shared_ptr<Namespace>& ns : namespaces_->Snapshot()) {
    if (ns->index() == nullptr) continue;
    double weight = static_cast<double>(ns->index()->Stats().l2_bytes);
    if (const TenantAccount* account = AccountOf(*ns);
        account != nullptr && account->guarantee_bytes() > 0) {
      const uint64_t tenant_used = account->used_bytes();
      weight = tenant_used == 0
                   ? 0
                   : weight * static_cast<double>(account->excess_bytes()) / tenant_used;
    }
    total += weight;
    weighted.emplace_back(weight, std::move(ns));
  }
  if (total <= 0) return 0;
  uint64_t freed = 0;
  for (const auto& [weight, ns] : weighted) {
    if (weight <= 0) continue;
    const uint64_t share =
        static_cast<uint64_t>(static_cast<double>(to_free) * (weight / total)) + 1;
    freed += EvictForOther(*ns, share, EvictReason::kWatermark, TenantEvictCause::kWatermark);
  }
  if (freed > 0) {
    KVLOG(Info, "l2 watermark eviction",
          {{"used_bytes", used}, {"freed_bytes", freed}, {"target_bytes", target}});
  }
  return freed;
}

}  // namespace kvcellar::server
