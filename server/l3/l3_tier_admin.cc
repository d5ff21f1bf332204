#include "server/l3/l3_tier_admin.h"

#include <algorithm>
#include <memory>

#include "platform/log.h"

namespace kvcellar::server {
namespace {

std::shared_ptr<Namespace> Find(NamespaceRegistry& registry, const core::PageKey& digest) {
  for (std::shared_ptr<Namespace>& ns : registry.Snapshot()) {
    if (ns->digest() == digest) return ns;
  }
  return nullptr;
}

}  // namespace

std::vector<size_t> L3TierAdmin::TiersIn(const L3Scope& scope) const {
  std::vector<size_t> out;
  for (size_t t = 0; t < tiers_->size(); ++t) {
    const std::string& name = tiers_->tier(t).spec.name;
    if (scope.backends.empty() ||
        std::find(scope.backends.begin(), scope.backends.end(), name) != scope.backends.end()) {
      out.push_back(t);
    }
  }
  return out;
}

std::vector<L3BackendUsage> L3TierAdmin::ZeroUsage(const std::vector<size_t>& tiers) const {
  std::vector<L3BackendUsage> out;
  for (size_t t : tiers) out.push_back({tiers_->tier(t).spec.name, 0, 0, 0});
  return out;
}

absl::StatusOr<std::vector<L3BackendUsage>> L3TierAdmin::Usage(const L3Scope& scope) {
  const std::vector<size_t> tiers = TiersIn(scope);
  std::vector<L3BackendUsage> out = ZeroUsage(tiers);
  std::shared_ptr<Namespace> ns = Find(*namespaces_, scope.ns_digest);
  core::RadixIndex* index = ns != nullptr ? ns->index() : nullptr;
  if (index == nullptr) return out;
  for (const core::PageKey& key : index->ScopeKeys(scope.subtree_root)) {
    std::optional<core::PageInfo> info = index->Inspect(key);
    if (!info.has_value()) continue;
    for (size_t i = 0; i < tiers.size(); ++i) {
      uint64_t objects = 0;
      for (size_t s = 0; s < info->shards.size(); ++s) {
        if (((info->shards[s].l3_tiers >> tiers[i]) & 1) == 0) continue;
        ++objects;
        out[i].bytes += ns->shard_object_bytes(static_cast<uint16_t>(s));
      }
      out[i].objects += objects;
      out[i].pages += objects > 0 ? 1 : 0;
    }
  }
  return out;
}

absl::StatusOr<std::vector<L3BackendUsage>> L3TierAdmin::Evict(const L3Scope& scope,
                                                              uint64_t target_bytes,
                                                              bool dry_run) {
  return Remove(scope, target_bytes, dry_run);
}

absl::StatusOr<std::vector<L3BackendUsage>> L3TierAdmin::Clear(const L3Scope& scope,
                                                              bool dry_run) {
  return Remove(scope, 0, dry_run);
}

absl::StatusOr<std::vector<L3BackendUsage>> L3TierAdmin::Remove(const L3Scope& scope,
                                                               uint64_t target_bytes,
                                                               bool dry_run) {
  const std::vector<size_t> tiers = TiersIn(scope);
  std::vector<L3BackendUsage> out = ZeroUsage(tiers);
  std::shared_ptr<Namespace> ns = Find(*namespaces_, scope.ns_digest);
  core::RadixIndex* index = ns != nullptr ? ns->index() : nullptr;
  if (index == nullptr) return out;
  std::vector<core::PageKey> keys = index->ScopeKeys(scope.subtree_root);
  // Deepest first: a page's descendants come after it in the scope walk.
  std::reverse(keys.begin(), keys.end());

  std::vector<std::vector<storage::ObjectRef>> refs(tiers.size());
  std::vector<core::L3Update> cleared;
  uint64_t bytes = 0;
  for (const core::PageKey& key : keys) {
    if (target_bytes != 0 && bytes >= target_bytes) break;
    std::optional<core::PageInfo> info = index->Inspect(key);
    if (!info.has_value()) continue;
    for (size_t i = 0; i < tiers.size(); ++i) {
      bool page = false;
      for (size_t s = 0; s < info->shards.size(); ++s) {
        if (((info->shards[s].l3_tiers >> tiers[i]) & 1) == 0) continue;
        refs[i].push_back({key, static_cast<uint32_t>(s)});
        cleared.push_back({key, std::nullopt, static_cast<uint16_t>(s),
                           static_cast<uint8_t>(tiers[i]), false});
        const uint64_t object_bytes = ns->shard_object_bytes(static_cast<uint16_t>(s));
        ++out[i].objects;
        out[i].bytes += object_bytes;
        bytes += object_bytes;
        page = true;
      }
      out[i].pages += page ? 1 : 0;
    }
  }
  if (dry_run) return out;
  // Marks go first: from here on no Match counts these copies, whatever the deletes do.
  std::vector<absl::Status> statuses(cleared.size());
  index->UpdateL3(cleared, absl::MakeSpan(statuses));
  for (size_t i = 0; i < tiers.size(); ++i) {
    if (refs[i].empty()) continue;
    storage::Backend& backend = *tiers_->tier(tiers[i]).backend;
    const size_t max_items = std::max<size_t>(1, backend.capabilities().max_batch_items);
    for (size_t off = 0; off < refs[i].size(); off += max_items) {
      const size_t n = std::min(max_items, refs[i].size() - off);
      absl::StatusOr<storage::BatchFuture> f = backend.DeleteAsync(
          {ns->digest(), absl::MakeConstSpan(refs[i]).subspan(off, n), absl::ZeroDuration()});
      if (!f.ok()) {
        KVLOG(Warn, "l3 admin delete not submitted",
              {{"tier", tiers_->tier(tiers[i]).spec.name}, {"error", f.status().ToString()}});
        continue;
      }
      f->Wait();
    }
  }
  return out;
}

}  // namespace kvcellar::server
