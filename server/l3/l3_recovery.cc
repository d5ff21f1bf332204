#include "server/l3/l3_recovery.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/radix_index.h"
#include "platform/log.h"
#include "storage/file_layout.h"

namespace kvcellar::server {
namespace {

// Updates per UpdateL3 call: bounds how long one call holds a namespace's index lock (a Match
// waits behind it), like the file backend's kScanInsertChunk.
constexpr size_t kInsertChunk = 4096;

using storage::ParentLink;

// One page of a tier's scan: its shards' objects share the key and the parent link.
struct ScannedPage {
  core::PageKey key;
  ParentLink parent;
  std::vector<uint16_t> shards;
  bool placed = false;
};

}  // namespace

L3Recovery::L3Recovery(L3Tiers* tiers, NamespaceRegistry* namespaces, LabelLog* labels)
    : tiers_(tiers), namespaces_(namespaces), labels_(labels) {
  {
    absl::MutexLock lock(&mu_);
    stats_.resize(tiers_->size());
    for (size_t t = 0; t < tiers_->size(); ++t) {
      stats_[t].file_tier = tiers_->tier(t).file() != nullptr;
      stats_[t].redis_tier = tiers_->tier(t).redis_index() != nullptr;
    }
  }
  // Outside mu_: a result that is already there arrives on this thread.
  for (size_t t = 0; t < tiers_->size(); ++t) {
    if (storage::FileBackend* file = tiers_->tier(t).file(); file != nullptr) {
      file->SetScanSink([this, t](storage::FileScanResult r) { OnScanned(t, std::move(r)); });
      file->SetRemovalSink(
          [this, t](absl::Span<const storage::FileObjectId> removed) { OnRemoved(t, removed); });
    }
    if (storage::RedisBackend* redis = tiers_->tier(t).redis_index(); redis != nullptr) {
      redis->SetIndexSink(
          [this, t](storage::RedisIndexResult r) { OnScanned(t, std::move(r.scan), !r.complete); });
    }
    if (storage::RedisBackend* redis = tiers_->tier(t).redis(); redis != nullptr) {
      redis->SetRemovalSink(
          [this, t](absl::Span<const storage::FileObjectId> removed) { OnRemoved(t, removed); });
    }
  }
}

L3Recovery::~L3Recovery() {
  for (size_t t = 0; t < tiers_->size(); ++t) {
    if (storage::FileBackend* file = tiers_->tier(t).file(); file != nullptr) {
      file->SetScanSink(nullptr);
      file->SetRemovalSink(nullptr);
    }
    if (storage::RedisBackend* redis = tiers_->tier(t).redis_index(); redis != nullptr) {
      redis->SetIndexSink(nullptr);
    }
    if (storage::RedisBackend* redis = tiers_->tier(t).redis(); redis != nullptr) {
      redis->SetRemovalSink(nullptr);
    }
  }
}

void L3Recovery::OnScanned(size_t tier, storage::FileScanResult r, bool partial) {
  absl::MutexLock lock(&mu_);
  L3ScanStats& s = stats_[tier];
  s.complete = true;
  s.partial = partial;
  s.found = r.found;
  s.legacy = r.legacy;
  s.newer = r.newer;
  s.dropped = r.dropped;
  s.temps_removed = r.temps_removed;
  s.evicted = r.evicted;
  s.payload_bytes = r.payload_bytes;
  s.seconds = absl::ToDoubleSeconds(r.elapsed);
  for (const storage::FileStartupScan::Found& f : r.objects) {
    pending_[r.namespaces[f.ns]].push_back({static_cast<uint8_t>(tier), f});
  }
  s.objects_pending += r.objects.size();
  // Namespaces registered before the scan ended get their pages now; the others on OnIndexed.
  for (const std::shared_ptr<Namespace>& ns : namespaces_->Snapshot()) ApplyLocked(*ns);
  KVLOG(Info, "l3 tier scanned",
        {{"tier", tiers_->tier(tier).spec.name},
         {"source", s.redis_tier ? "redis_index" : "file_scan"},
         {"partial", partial ? "true" : "false"},
         {"objects_found", s.found},
         {"pages_inserted", s.pages_inserted},
         {"pages_orphaned", s.pages_orphaned},
         {"pages_legacy", s.pages_legacy},
         {"objects_dropped", s.dropped},
         {"objects_pending", s.objects_pending},
         {"bytes", s.payload_bytes},
         {"seconds", absl::StrFormat("%.3f", s.seconds)}});
}

void L3Recovery::OnRemoved(size_t tier, absl::Span<const storage::FileObjectId> removed) {
  {
    // First: an object still pending never enters, even when its namespace's index appears
    // before the lines below look for it.
    absl::MutexLock lock(&mu_);
    if (!pending_.empty()) {
      for (const storage::FileObjectId& id : removed) {
        removed_pending_.insert({static_cast<uint8_t>(tier), id});
      }
    }
  }
  // Namespaces by the tag a file tier names them with.
  absl::flat_hash_map<uint64_t, std::shared_ptr<Namespace>> by_prefix;
  for (std::shared_ptr<Namespace>& ns : namespaces_->Snapshot()) {
    by_prefix.emplace(storage::NamespacePrefix(ns->digest()), std::move(ns));
  }
  absl::flat_hash_map<Namespace*, std::vector<core::L3Update>> gone;
  for (const storage::FileObjectId& id : removed) {
    auto it = by_prefix.find(id.ns_prefix);
    if (it == by_prefix.end() || it->second->index() == nullptr) continue;
    gone[it->second.get()].push_back({id.key, std::nullopt, static_cast<uint16_t>(id.shard),
                                      static_cast<uint8_t>(tier),
                                      /*present=*/false});
  }
  // Outside mu_: UpdateL3 takes the namespace's index lock.
  std::vector<absl::Status> statuses;
  for (auto& [ns, updates] : gone) {
    statuses.assign(updates.size(), absl::OkStatus());
    ns->index()->UpdateL3(updates, absl::MakeSpan(statuses));  // A page not indexed: nothing.
  }
}

void L3Recovery::OnIndexed(Namespace& ns) {
  absl::MutexLock lock(&mu_);
  ApplyLocked(ns);
}

void L3Recovery::ApplyLocked(Namespace& ns) {
  if (ns.index() == nullptr) return;
  auto it = pending_.find(ns.digest());
  if (it == pending_.end()) return;
  std::vector<Pending> objects = std::move(it->second);
  pending_.erase(it);
  if (!removed_pending_.empty()) {
    std::erase_if(objects, [this](const Pending& p) {
      return removed_pending_.contains({p.tier, p.object.id});
    });
    if (pending_.empty()) removed_pending_.clear();
  }
  // Tier by tier, earlier tiers first: a page may hang under another tier's copy of its parent.
  std::stable_sort(objects.begin(), objects.end(),
                   [](const Pending& a, const Pending& b) { return a.tier < b.tier; });
  for (size_t i = 0; i < objects.size();) {
    size_t j = i;
    while (j < objects.size() && objects[j].tier == objects[i].tier) ++j;
    const uint8_t tier = objects[i].tier;
    stats_[tier].objects_pending -= j - i;
    InsertTier(ns, tier, std::vector<Pending>(objects.begin() + i, objects.begin() + j));
    i = j;
  }
}

void L3Recovery::InsertTier(Namespace& ns, uint8_t tier, const std::vector<Pending>& objects) {
  L3ScanStats& s = stats_[tier];
  core::RadixIndex& index = *ns.index();
  // Pages, and the children of each parent key.
  std::vector<ScannedPage> pages;
  absl::flat_hash_map<core::PageKey, size_t> page_of;
  for (const Pending& p : objects) {
    const storage::FileStartupScan::Found& f = p.object;
    auto [it, inserted] = page_of.try_emplace(f.id.key, pages.size());
    if (inserted) pages.push_back({f.id.key, f.parent, {}, false});
    ScannedPage& page = pages[it->second];
    if (f.id.shard >= static_cast<uint32_t>(ns.shards()) ||
        f.payload_bytes != ns.shard_object_bytes(static_cast<uint16_t>(f.id.shard))) {
      continue;  // Another geometry's object (its group's size): a Get would refuse it.
    }
    page.shards.push_back(static_cast<uint16_t>(f.id.shard));
  }
  absl::flat_hash_map<core::PageKey, std::vector<size_t>> children;
  std::vector<size_t> order;  // Breadth-first from the roots: parents before children.
  order.reserve(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    const ScannedPage& p = pages[i];
    if (p.shards.empty()) {
      ++s.pages_mismatched;
    } else if (p.parent.kind == ParentLink::Kind::kUnknown) {
      ++s.pages_legacy;
    } else if (p.parent.kind == ParentLink::Kind::kFirst) {
      order.push_back(i);
    } else if (page_of.contains(p.parent.key)) {
      children[p.parent.key].push_back(i);
    } else if (index.Inspect(p.parent.key).has_value()) {
      order.push_back(i);  // Its parent is indexed already (L2, or another tier's copy).
    } else {
      ++s.pages_orphaned;
    }
  }
  for (size_t next = 0; next < order.size(); ++next) {
    auto it = children.find(pages[order[next]].key);
    if (it == children.end()) continue;
    for (size_t c : it->second) order.push_back(c);
    children.erase(it);  // Each parent's children once, even on a cycle of bad links.
  }
  // What stayed in `children` hangs under a page that was never reached: orphans, and so their
  // descendants.
  for (const auto& [parent, kids] : children) s.pages_orphaned += kids.size();

  std::vector<core::L3Update> updates;
  std::vector<size_t> update_page;
  std::vector<absl::Status> statuses;
  const auto flush = [&] {
    statuses.assign(updates.size(), absl::OkStatus());
    index.UpdateL3(updates, absl::MakeSpan(statuses));
    for (size_t u = 0; u < updates.size(); ++u) {
      ScannedPage& page = pages[update_page[u]];
      // Refused (its parent went since, or it is indexed under another parent): an orphan.
      if (!statuses[u].ok()) page.placed = false;
    }
    updates.clear();
    update_page.clear();
  };
  for (size_t i : order) {
    ScannedPage& page = pages[i];
    page.placed = true;
    std::optional<core::PageKey> parent;
    if (page.parent.kind == ParentLink::Kind::kKey) parent = page.parent.key;
    std::shared_ptr<const core::PageLabel> label =
        labels_ != nullptr ? labels_->Take(ns.digest(), page.key) : nullptr;
    for (uint16_t shard : page.shards) {
      updates.push_back({page.key, parent, shard, tier, true, label});
      update_page.push_back(i);
    }
    if (updates.size() >= kInsertChunk) flush();
  }
  flush();
  for (size_t i : order) {
    if (pages[i].placed) {
      ++s.pages_inserted;
    } else {
      ++s.pages_orphaned;
    }
  }
}

bool L3Recovery::Settled() const {
  absl::MutexLock lock(&mu_);
  for (const L3ScanStats& s : stats_) {
    if ((s.file_tier || s.redis_tier) && !s.complete) return false;
  }
  return pending_.empty();
}

std::vector<L3ScanStats> L3Recovery::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void L3Recovery::Collect(MetricWriter& out) const {
  const std::vector<L3ScanStats> stats = Stats();
  for (size_t t = 0; t < stats.size(); ++t) {
    const L3ScanStats& s = stats[t];
    if (!s.file_tier && !s.redis_tier) continue;
    const std::string& name = tiers_->tier(t).spec.name;
    const std::pair<const char*, uint64_t> objects[] = {{"found", s.found},
                                                        {"legacy", s.legacy},
                                                        {"newer", s.newer},
                                                        {"dropped", s.dropped},
                                                        {"temps_removed", s.temps_removed},
                                                        {"evicted", s.evicted}};
    for (const auto& [result, n] : objects) {
      const MetricWriter::Label labels[] = {{"tier", name}, {"result", result}};
      out.AddCounter(
          "kvcellar_l3_scan_objects_total",
          "Objects a file tier's startup scan (or a Redis tier's index readback) "
          "handled: found (good header or entry), legacy (of those, format version 1: "
          "no parent link), newer (a later format version's: kept, not indexed), dropped (torn "
          "or foreign, removed; Redis: malformed "
          "entries), temps_removed (dead writers' temp files), evicted (over "
          "capacity).",
          static_cast<double>(n), labels);
    }
    const std::pair<const char*, uint64_t> pages[] = {{"inserted", s.pages_inserted},
                                                      {"orphaned", s.pages_orphaned},
                                                      {"legacy", s.pages_legacy},
                                                      {"mismatched", s.pages_mismatched}};
    for (const auto& [result, n] : pages) {
      const MetricWriter::Label labels[] = {{"tier", name}, {"result", result}};
      out.AddCounter("kvcellar_l3_scan_pages_total",
                     "Scanned pages put back in the index (inserted), or not: orphaned (parent "
                     "never indexed), legacy (no parent link), mismatched (another geometry).",
                     static_cast<double>(n), labels);
    }
    const MetricWriter::Label tier[] = {{"tier", name}};
    out.AddGauge("kvcellar_l3_scan_complete",
                 "1 once the tier's startup scan (file) or index readback (Redis) has ended and "
                 "its result arrived; 0 before.",
                 s.complete ? 1.0 : 0.0, tier);
    out.AddGauge("kvcellar_l3_scan_partial",
                 "1 when a Redis tier's index readback was cut short (a node unreachable, "
                 "the time bound): what it read is used, the rest is found by lookups.",
                 s.partial ? 1.0 : 0.0, tier);
    out.AddGauge("kvcellar_l3_scan_pending_objects",
                 "Scanned objects waiting for their namespace's first worker to register.",
                 static_cast<double>(s.objects_pending), tier);
    out.AddGauge("kvcellar_l3_scan_bytes", "Payload bytes of the objects the startup scan found.",
                 static_cast<double>(s.payload_bytes), tier);
    out.AddGauge("kvcellar_l3_scan_seconds",
                 "Seconds from opening the tier to the end of its startup scan or index "
                 "readback; 0 until it ends.",
                 s.seconds, tier);
  }
}

}  // namespace kvcellar::server
