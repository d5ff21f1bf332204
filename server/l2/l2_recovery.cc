#include "server/l2/l2_recovery.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "core/crc32c.h"
#include "core/radix_index.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// A record that verified: its slot, whose object it holds, and the page's parent.
struct Kept {
  core::OwnedSlot slot;
  std::optional<core::PageKey> parent;
};

// What one worker found in its regions.
struct Scan {
  std::vector<Kept> kept;
  L2RecoveryStats counts;
};

using NamespaceTable = std::vector<std::shared_ptr<Namespace>>;  // By id; [0] unused.

// Step 1: the logged namespaces, recreated under their ids, with their geometry.
NamespaceTable RecreateNamespaces(const core::SlotJournal& journal, NamespaceRegistry& namespaces,
                                  L2RecoveryStats& stats) {
  NamespaceTable table(1);
  for (const core::JournalNamespace& logged : journal.Namespaces()) {
    // Ids are dense in the log; after a gap (an entry lost) none could get its old id.
    if (logged.id != table.size()) break;
    std::shared_ptr<Namespace> ns = namespaces.Recreate(logged.spec);
    if (ns->id() != logged.id) break;  // The registry was not empty: nothing is safe to map.
    if (logged.buffers.has_value()) {
      if (absl::Status s = ns->RestoreGeometry(*logged.buffers, logged.geometry_epoch); !s.ok()) {
        KVLOG(Warn, "l2 recovery: namespace geometry not restored",
              {{"ns_id", logged.id}, {"model_id", logged.spec.model_id}, {"error", s.ToString()}});
      }
    }
    table.push_back(std::move(ns));
    ++stats.namespaces;
  }
  return table;
}

// Whether a COMMITTED record fits what its namespace and the pool say its object must be.
bool Fits(const core::SlotRecord& rec, uint32_t index, const NamespaceTable& table,
          const core::HostPool& pool) {
  if (rec.ns == 0 || rec.ns >= table.size()) return false;
  const Namespace& ns = *table[rec.ns];
  if (ns.index() == nullptr || rec.shard >= ns.shards()) return false;
  if (rec.geometry_epoch != ns.geometry_epoch()) return false;  // Written under another geometry.
  if (rec.size_class >= pool.slot_sizes().size()) return false;
  const uint64_t slot_bytes = pool.slot_sizes()[rec.size_class];
  return slot_bytes == ns.slot_bytes() && rec.length == ns.object_bytes() &&
         index < pool.region_bytes() / slot_bytes;
}

// Step 2 for regions [begin, end).
void ScanRegions(uint32_t begin, uint32_t end, core::SlotJournal& journal,
                 const NamespaceTable& table, const core::HostPool& pool, Scan& out) {
  L2RecoveryStats& c = out.counts;
  for (uint32_t r = begin; r < end; ++r) {
    int region_class = -1;  // The first kept record's class; a region has one.
    for (uint32_t i = 0; i < journal.max_slots_per_region(); ++i) {
      const core::SlotRecord rec = journal.Read(r, i);
      if (rec.state == core::SlotRecordState::kEmpty) continue;
      bool keep = false;
      switch (rec.state) {
        case core::SlotRecordState::kTorn: ++c.dropped_torn; break;
        case core::SlotRecordState::kWriting: ++c.dropped_in_flight; break;
        case core::SlotRecordState::kLanded: ++c.dropped_unsealed; break;
        default:
          if (!Fits(rec, i, table, pool) ||
              (region_class >= 0 && region_class != rec.size_class)) {
            ++c.dropped_mismatch;
            break;
          }
          const core::SlotRef slot{rec.size_class, static_cast<uint16_t>(r), i};
          if (core::Crc32c(pool.Address(slot), rec.length) != rec.payload_crc) {
            ++c.dropped_checksum;
            c.dropped_bytes += rec.length;
            break;
          }
          keep = true;
          region_class = rec.size_class;
          out.kept.push_back({{slot, {rec.key, rec.ns, rec.shard}}, rec.parent});
      }
      if (!keep) journal.ClearAt(r, i);
    }
  }
}

void Add(L2RecoveryStats& to, const L2RecoveryStats& from) {
  to.dropped_in_flight += from.dropped_in_flight;
  to.dropped_unsealed += from.dropped_unsealed;
  to.dropped_torn += from.dropped_torn;
  to.dropped_checksum += from.dropped_checksum;
  to.dropped_mismatch += from.dropped_mismatch;
  to.dropped_orphan += from.dropped_orphan;
  to.dropped_bytes += from.dropped_bytes;
}

// Step 4 for one namespace: its kept objects into its index, prefix-closed. Slots that do not
// enter are freed (which clears their records).
void IndexNamespace(Namespace& ns, std::vector<const Kept*>& objects, core::HostPool& pool,
                    LabelLog* labels, L2RecoveryStats& stats) {
  core::RadixIndex& index = *ns.index();
  // Most pages have one shard and one child: inline, so that a million pages do not cost two
  // million heap allocations.
  struct Page {
    std::optional<core::PageKey> parent;
    absl::InlinedVector<const Kept*, 1> shards;
    bool queued = false;
  };
  absl::flat_hash_map<core::PageKey, Page> pages;
  absl::flat_hash_map<core::PageKey, absl::InlinedVector<core::PageKey, 1>> children;
  pages.reserve(objects.size());
  children.reserve(objects.size());
  for (const Kept* k : objects) {
    Page& p = pages[k->slot.owner.key];
    if (p.shards.empty()) {
      p.parent = k->parent;
    } else if (p.parent != k->parent ||
               std::any_of(p.shards.begin(), p.shards.end(), [&](const Kept* o) {
                 return o->slot.owner.shard == k->slot.owner.shard;
               })) {
      // A second copy of a shard (an evicted page's slot kept by a write-back, then written
      // again) or a parent that disagrees: one copy is enough, and a disagreement is not trusted.
      ++stats.dropped_mismatch;
      (void)pool.Free(k->slot.slot);
      continue;
    }
    p.shards.push_back(k);
  }
  for (const auto& [key, p] : pages) {
    if (p.parent.has_value()) children[*p.parent].push_back(key);
  }
  // Roots: first pages, and pages under a parent the index already holds (an L3 copy).
  std::deque<core::PageKey> queue;
  for (auto& [key, p] : pages) {
    if (!p.parent.has_value() ||
        (!pages.contains(*p.parent) && index.Inspect(*p.parent).has_value())) {
      p.queued = true;
      queue.push_back(key);
    }
  }
  // Parents before children, in batches under one index lock each.
  constexpr size_t kBatchObjects = 4096;
  std::vector<core::WriteRequest> writes;
  auto flush = [&] {
    if (writes.empty()) return;
    std::vector<absl::Status> begun(writes.size());
    index.BeginWrite(writes, absl::MakeSpan(begun));
    if (labels != nullptr) {
      // Before the commit: the page's stored event carries its tokens.
      std::vector<core::PageKey> keys;
      std::vector<std::shared_ptr<const core::PageLabel>> found;
      for (size_t i = 0; i < writes.size(); ++i) {
        if (!begun[i].ok() || (!keys.empty() && keys.back() == writes[i].key)) continue;
        if (auto label = labels->Take(ns.digest(), writes[i].key); label != nullptr) {
          keys.push_back(writes[i].key);
          found.push_back(std::move(label));
        }
      }
      if (!keys.empty()) stats.labelled_pages += index.Label(keys, found, /*max_label_bytes=*/0);
    }
    std::vector<core::ObjectId> commit;
    for (size_t i = 0; i < writes.size(); ++i) {
      if (begun[i].ok()) {
        commit.push_back({writes[i].key, writes[i].shard});
      } else {
        ++stats.dropped_mismatch;
        (void)pool.Free(writes[i].slot);
      }
    }
    std::vector<absl::Status> committed(commit.size());
    index.Commit(commit, absl::MakeSpan(committed));
    stats.objects += commit.size();
    stats.bytes += commit.size() * ns.object_bytes();
    writes.clear();
  };
  while (!queue.empty()) {
    const core::PageKey key = queue.front();
    queue.pop_front();
    const Page& p = pages.at(key);
    for (const Kept* k : p.shards) {
      writes.push_back({key, p.parent, k->slot.owner.shard, k->slot.slot,
                        core::WriteKind::kBackup});
    }
    ++stats.pages;
    if (writes.size() >= kBatchObjects) flush();
    auto it = children.find(key);
    if (it == children.end()) continue;
    for (const core::PageKey& child : it->second) {
      Page& c = pages.at(child);
      if (!c.queued) {
        c.queued = true;
        queue.push_back(child);
      }
    }
  }
  flush();
  for (const auto& [key, p] : pages) {
    if (p.queued) continue;
    for (const Kept* k : p.shards) {
      ++stats.dropped_orphan;
      stats.dropped_bytes += ns.object_bytes();
      (void)pool.Free(k->slot.slot);
    }
  }
}

}  // namespace

L2RecoveryStats RecoverL2(core::HostPool& pool, core::SlotJournal& journal,
                          NamespaceRegistry& namespaces, int threads,
                          absl::FunctionRef<void(Namespace&)> on_indexed, LabelLog* labels) {
  const auto start = std::chrono::steady_clock::now();
  L2RecoveryStats stats;
  stats.enabled = true;
  stats.warm = true;
  const NamespaceTable table = RecreateNamespaces(journal, namespaces, stats);
  for (size_t id = 1; id < table.size(); ++id) {
    if (table[id]->index() != nullptr) on_indexed(*table[id]);
  }

  // Step 2: the regions split into contiguous ranges, one per worker.
  const uint32_t regions = journal.region_count();
  const uint32_t workers = std::clamp<uint32_t>(static_cast<uint32_t>(threads), 1, regions);
  std::vector<Scan> scans(workers);
  {
    std::vector<std::thread> pool_threads;
    for (uint32_t w = 0; w < workers; ++w) {
      const uint32_t begin = static_cast<uint32_t>(uint64_t{regions} * w / workers);
      const uint32_t end = static_cast<uint32_t>(uint64_t{regions} * (w + 1) / workers);
      pool_threads.emplace_back([&, begin, end, w] {
        ScanRegions(begin, end, journal, table, pool, scans[w]);
      });
    }
    for (std::thread& t : pool_threads) t.join();
  }
  std::vector<core::OwnedSlot> owned;
  for (const Scan& s : scans) {
    Add(stats, s.counts);
    for (const Kept& k : s.kept) owned.push_back(k.slot);
  }
  // Each record names its tenant's account, so a later Free discharges it (l2_space.h).
  for (core::OwnedSlot& o : owned) {
    const TenantAccount* account = o.owner.ns < table.size() && table[o.owner.ns] != nullptr
                                       ? table[o.owner.ns]->tenant_account()
                                       : nullptr;
    o.owner.tenant = account != nullptr ? account->number() : 0;
  }

  // Step 3.
  if (absl::Status s = pool.Restore(owned); !s.ok()) {
    // Cannot happen for records that passed Fits (one class per region, one record per slot);
    // if it does, nothing recovered is trusted.
    KVLOG(Error, "l2 recovery: pool restore failed", {{"error", s.ToString()}});
    for (const core::OwnedSlot& o : owned) journal.Clear(o.slot);
    stats.dropped_mismatch += owned.size();
    owned.clear();
    for (Scan& sc : scans) sc.kept.clear();
  }

  // Step 4, namespace by namespace.
  std::vector<std::vector<const Kept*>> by_ns(table.size());
  for (const Scan& s : scans) {
    for (const Kept& k : s.kept) by_ns[k.slot.owner.ns].push_back(&k);
  }
  for (size_t id = 1; id < table.size(); ++id) {
    if (by_ns[id].empty()) continue;
    IndexNamespace(*table[id], by_ns[id], pool, labels, stats);
    // The slots still allocated are the ones the index holds (the rest were freed above, never
    // charged): charged whatever the ceiling, as the tenant held them before the restart.
    TenantAccount* account = table[id]->tenant_account();
    if (account != nullptr && table[id]->index() != nullptr) {
      account->Charge(table[id]->index()->Stats().l2_bytes);
    }
  }
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

void CollectL2Recovery(const L2RecoveryStats& stats, MetricWriter& out) {
  out.AddGauge("kvcellar_l2_recovery_warm",
               "1 when this start re-attached the L2 pool and its journal (warm restart), 0 when "
               "L2 started empty (always without pool.shm_name).",
               stats.warm ? 1 : 0);
  out.AddGauge("kvcellar_l2_recovery_pages", "L2 pages recovered at this start.", stats.pages);
  out.AddGauge("kvcellar_l2_recovery_bytes", "Object bytes of the L2 pages recovered at this start.",
               stats.bytes);
  const std::pair<const char*, uint64_t> dropped[] = {
      {"in_flight", stats.dropped_in_flight}, {"unsealed", stats.dropped_unsealed},
      {"torn", stats.dropped_torn},
      {"checksum", stats.dropped_checksum},   {"mismatch", stats.dropped_mismatch},
      {"orphan", stats.dropped_orphan}};
  for (const auto& [reason, n] : dropped) {
    const MetricWriter::Label labels[] = {{"reason", reason}};
    out.AddGauge("kvcellar_l2_recovery_dropped_objects",
                 "L2 objects found in the re-attached pool and not recovered, by reason.", n,
                 labels);
  }
  out.AddGauge("kvcellar_l2_recovery_seconds",
               "Seconds this start spent recovering L2 (reading the journal, verifying every "
               "kept page's checksum, indexing).",
               stats.seconds);
}

}  // namespace kvcellar::server
