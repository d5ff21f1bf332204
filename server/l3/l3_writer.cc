#include "server/l3/l3_writer.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <limits>
#include <utility>

#include "platform/log.h"

namespace kvcellar::server {
namespace {

// Pages remembered for a later write (selective, admission, write_back). 48 bytes of entry plus
// the table's overhead: ~100 MiB at the limit, next to the L2 pages they stand for.
constexpr size_t kMaxTracked = size_t{1} << 20;
constexpr uint32_t kNever = std::numeric_limits<uint32_t>::max();

v1::WritePolicy ToProto(L3WritePolicy p) {
  switch (p) {
    case L3WritePolicy::kWriteThrough: return v1::WRITE_POLICY_WRITE_THROUGH;
    case L3WritePolicy::kWriteThroughSelective: return v1::WRITE_POLICY_WRITE_THROUGH_SELECTIVE;
    case L3WritePolicy::kWriteBack: return v1::WRITE_POLICY_WRITE_BACK;
    case L3WritePolicy::kL2Only: return v1::WRITE_POLICY_L2_ONLY;
  }
  return v1::WRITE_POLICY_WRITE_THROUGH;
}

// Marks copies in the index. Write-back pages left the tree when they were evicted and come back
// under their parents; eviction hands them over children first, so a page may come before its
// parent: repeat while a pass makes progress (an update whose parent is still missing is
// dropped: a Match lookup finds the copy in the backend).
void RecordL3Copies(core::RadixIndex& index, std::vector<core::L3Update> updates) {
  while (!updates.empty()) {
    std::vector<absl::Status> statuses(updates.size());
    const size_t applied = index.UpdateL3(updates, absl::MakeSpan(statuses));
    if (applied == 0 || applied == updates.size()) return;
    std::vector<core::L3Update> again;
    for (size_t i = 0; i < updates.size(); ++i) {
      if (statuses[i].code() == absl::StatusCode::kFailedPrecondition) again.push_back(updates[i]);
    }
    updates.swap(again);
  }
}

}  // namespace

// One write: objects of one namespace to some tiers, from slots that stay valid until Finish.
struct L3Writer::Job {
  Namespace* ns = nullptr;
  uint64_t owner = 0;                 // Index pin owner; 0 for a write-back (slots owned).
  std::vector<core::PageKey> pinned;  // Pages pinned under `owner`.
  std::vector<core::ObjectId> objects;
  std::vector<core::SlotRef> slots;  // Per object.
  std::vector<storage::ParentLink> parents;  // Per object: recorded in the header.
  bool write_back = false;  // The pages left the index: their copies are indexed anew.
  uint8_t tiers = 0;
  uint64_t bytes = 0;  // Reserved in pending_bytes_.
  std::atomic<int> tiers_left{0};
};

L3Writer::L3Writer(L3Tiers* tiers, L2Space* l2, std::function<uint64_t()> next_id,
                   CacheMetrics* metrics, const StorageConfig& config)
    : tiers_(tiers),
      l2_(l2),
      next_id_(std::move(next_id)),
      metrics_(metrics),
      default_policy_(ToProto(config.write_policy)),
      selective_hits_(static_cast<uint32_t>(config.selective_hits)),
      max_pending_bytes_(config.max_pending_write_bytes) {}

L3Writer::~L3Writer() { Drain(); }

void L3Writer::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](size_t* n) { return *n == 0; }, &inflight_jobs_));
}

uint32_t L3Writer::Threshold(v1::WritePolicy policy, size_t t) const {
  const uint32_t admit = tiers_->tier(t).spec.admit_after;
  switch (policy) {
    case v1::WRITE_POLICY_WRITE_THROUGH: return admit;
    case v1::WRITE_POLICY_WRITE_THROUGH_SELECTIVE: return std::max(selective_hits_, admit);
    default: return kNever;
  }
}

bool L3Writer::Reserve(uint64_t bytes, uint8_t tiers, uint64_t objects) {
  uint64_t cur = pending_bytes_.load(std::memory_order_relaxed);
  while (true) {
    if (cur + bytes > max_pending_bytes_) {
      for (size_t t = 0; t < tiers_->size(); ++t) {
        if ((tiers >> t & 1) != 0) {
          metrics_->CountL3Writes(t, CacheMetrics::L3WriteResult::kDropped, objects);
        }
      }
      return false;
    }
    if (pending_bytes_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed)) {
      return true;
    }
  }
}

void L3Writer::OnCommitted(Namespace& ns, absl::Span<const core::ObjectId> objects,
                           v1::WritePolicy policy) {
  policy = Resolve(policy);
  if (tiers_->empty() || objects.empty() || policy == v1::WRITE_POLICY_L2_ONLY) return;
  uint8_t now = 0;    // Tiers written at once.
  uint8_t later = 0;  // Tiers that wait for hits or eviction.
  for (size_t t = 0; t < tiers_->size(); ++t) {
    (Threshold(policy, t) == 0 ? now : later) |= static_cast<uint8_t>(1u << t);
  }
  if (later != 0) {
    std::vector<storage::ParentLink> parents(objects.size());
    if (policy == v1::WRITE_POLICY_WRITE_BACK) {
      for (size_t i = 0; i < objects.size(); ++i) {
        if (i > 0 && objects[i].key == objects[i - 1].key) {
          parents[i] = parents[i - 1];
          continue;
        }
        std::optional<core::PageInfo> info = ns.index()->Inspect(objects[i].key);
        if (!info.has_value()) continue;  // Gone already: kUnknown.
        parents[i] = info->parent.has_value() ? storage::ParentLink::Of(*info->parent)
                                              : storage::ParentLink::First();
      }
    }
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < objects.size(); ++i) {
      auto it = tracked_.find(objects[i].key);
      if (it == tracked_.end()) {
        if (tracked_.size() >= kMaxTracked) continue;
        it = tracked_.emplace(objects[i].key, Tracked{}).first;
      }
      Tracked& t = it->second;
      t.ns = &ns;
      t.policy = policy;
      t.written |= now;
      t.parent = parents[i];
    }
    tracked_count_.store(tracked_.size(), std::memory_order_relaxed);
  }
  if (now != 0) WriteResident(ns, {objects.begin(), objects.end()}, now);
}

void L3Writer::OnL2Hits(Namespace& ns, absl::Span<const core::PageKey> keys) {
  if (tracked_count_.load(std::memory_order_relaxed) == 0 || keys.empty()) return;
  std::vector<std::pair<core::PageKey, uint8_t>> due;
  {
    absl::MutexLock lock(&mu_);
    for (const core::PageKey& key : keys) {
      auto it = tracked_.find(key);
      if (it == tracked_.end() || it->second.ns != &ns) continue;
      Tracked& t = it->second;
      ++t.hits;
      uint8_t tiers = 0;
      for (size_t i = 0; i < tiers_->size(); ++i) {
        if ((t.written >> i & 1) == 0 && t.hits >= Threshold(t.policy, i)) {
          tiers |= static_cast<uint8_t>(1u << i);
        }
      }
      if (tiers == 0) continue;
      t.written |= tiers;
      due.emplace_back(key, tiers);
      if (t.written == AllTiers() && t.policy != v1::WRITE_POLICY_WRITE_BACK) tracked_.erase(it);
    }
    tracked_count_.store(tracked_.size(), std::memory_order_relaxed);
  }
  // Pages that became due on the same tiers go in one write.
  std::sort(due.begin(), due.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (size_t i = 0; i < due.size();) {
    size_t j = i;
    std::vector<core::ObjectId> objects;
    for (; j < due.size() && due[j].second == due[i].second; ++j) {
      for (int s = 0; s < ns.shards(); ++s) {
        objects.push_back({due[j].first, static_cast<uint16_t>(s)});
      }
    }
    WriteResident(ns, std::move(objects), due[i].second);
    i = j;
  }
}

void L3Writer::OnEvicted(Namespace& ns, absl::Span<core::ReleasedObject> released) {
  if (tracked_count_.load(std::memory_order_relaxed) == 0 || released.empty()) return;
  auto job = std::make_shared<Job>();
  job->ns = &ns;
  job->write_back = true;
  uint8_t tiers = 0;
  {
    absl::MutexLock lock(&mu_);
    for (core::ReleasedObject& r : released) {
      auto it = tracked_.find(r.key);
      if (it == tracked_.end() || it->second.ns != &ns) continue;
      const Tracked& t = it->second;
      if (t.policy == v1::WRITE_POLICY_WRITE_BACK && r.slot.valid()) {
        uint8_t want = 0;
        for (size_t i = 0; i < tiers_->size(); ++i) {
          const bool admitted = t.hits >= tiers_->tier(i).spec.admit_after;
          if (admitted && (t.written >> i & 1) == 0 && (r.l3_tiers >> i & 1) == 0) {
            want |= static_cast<uint8_t>(1u << i);
          }
        }
        // One job writes to one set of tiers: pages whose wish differs from the first are
        // not written (rare: only admission thresholds make them differ).
        if (want != 0 && (tiers == 0 || want == tiers)) {
          tiers = want;
          job->objects.push_back({r.key, r.shard});
          job->slots.push_back(r.slot);
          job->parents.push_back(t.parent);
          r.slot = core::SlotRef{};  // Ours now; freed when written.
        }
      }
    }
    // The pages left L2: whatever was pending for them is over. Only now, after every shard of a
    // page (consecutive in `released`) has found the page's entry above.
    for (const core::ReleasedObject& r : released) {
      auto it = tracked_.find(r.key);
      if (it != tracked_.end() && it->second.ns == &ns) tracked_.erase(it);
    }
    tracked_count_.store(tracked_.size(), std::memory_order_relaxed);
  }
  if (job->objects.empty()) return;
  job->tiers = tiers;
  job->bytes = job->objects.size() * ns.object_bytes() * std::popcount(tiers);
  if (!Reserve(job->bytes, tiers, job->objects.size())) {
    for (core::SlotRef slot : job->slots) l2_->Free(slot);
    return;
  }
  held_bytes_.fetch_add(job->objects.size() * ns.slot_bytes(), std::memory_order_relaxed);
  Submit(std::move(job));
}

void L3Writer::WriteResident(Namespace& ns, std::vector<core::ObjectId> objects, uint8_t tiers) {
  core::RadixIndex* index = ns.index();
  if (index == nullptr || objects.empty()) return;
  const uint64_t bytes = objects.size() * ns.object_bytes() * std::popcount(tiers);
  if (!Reserve(bytes, tiers, objects.size())) return;
  auto job = std::make_shared<Job>();
  job->ns = &ns;
  job->tiers = tiers;
  job->bytes = bytes;
  job->owner = next_id_();
  for (const core::ObjectId& o : objects) {
    if (job->pinned.empty() || job->pinned.back() != o.key) job->pinned.push_back(o.key);
  }
  // Pinned without a deadline: a lease lapsing under a running write would let eviction reuse the
  // slot the backend is reading. Finish unpins.
  index->Pin(job->owner, job->pinned, absl::InfiniteFuture());
  // Pinned, so indexed: nullopt is a first page (a page that left before the pin has no slot
  // below and is not written).
  std::vector<std::optional<core::PageKey>> page_parents(job->pinned.size());
  index->GetParents(job->pinned, absl::MakeSpan(page_parents));
  uint64_t missing = 0;
  size_t page = 0;
  for (const core::ObjectId& o : objects) {
    while (job->pinned[page] != o.key) ++page;  // Objects come in page order, as pinned.
    core::SlotRef slot;
    index->GetL2Slots(absl::MakeConstSpan(&o.key, 1), o.shard, absl::MakeSpan(&slot, 1));
    if (!slot.valid()) {
      // A hybrid page holds only the objects a hit can use (a window's last pages, a state at
      // a boundary): its other objects were never there.
      missing += ns.spec().Hybrid() ? 0 : 1;
      continue;
    }
    job->objects.push_back(o);
    job->slots.push_back(slot);
    job->parents.push_back(page_parents[page].has_value()
                               ? storage::ParentLink::Of(*page_parents[page])
                               : storage::ParentLink::First());
  }
  for (size_t t = 0; t < tiers_->size(); ++t) {
    if ((tiers >> t & 1) != 0) {
      metrics_->CountL3Writes(t, CacheMetrics::L3WriteResult::kNotResident, missing);
    }
  }
  if (job->objects.empty()) {
    index->Unpin(job->owner, job->pinned);
    pending_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    return;
  }
  Submit(std::move(job));
}

void L3Writer::Submit(std::shared_ptr<Job> job) {
  {
    absl::MutexLock lock(&mu_);
    ++inflight_jobs_;
  }
  Namespace& ns = *job->ns;
  std::vector<storage::PutItem> items;
  items.reserve(job->objects.size());
  for (size_t i = 0; i < job->objects.size(); ++i) {
    // A hybrid model's object is its group's size (the slot holds the largest group's).
    const core::ObjectId& o = job->objects[i];
    items.push_back({o.key, o.shard, l2_->pool()->Address(job->slots[i]),
                     ns.shard_object_bytes(o.shard), job->parents[i]});
  }
  job->tiers_left.store(std::popcount(job->tiers), std::memory_order_relaxed);
  for (size_t t = 0; t < tiers_->size(); ++t) {
    if ((job->tiers >> t & 1) == 0) continue;
    storage::PutRequest request{ns.digest(), items, absl::ZeroDuration()};
    const auto put_start = std::chrono::steady_clock::now();
    absl::Status s = tiers_->tier(t).backend->Put(
        request, [this, job, t, put_start](storage::BatchResult result) mutable {
          std::vector<core::L3Update> updates;
          uint64_t ok = 0;
          uint64_t bytes = 0;
          for (size_t i = 0; i < result.items.size(); ++i) {
            if (result.items[i].status != storage::ObjectStatus::kOk) continue;
            ++ok;
            bytes += result.items[i].bytes;
            // A write-back page left the tree: its copy comes back under its parent, unless
            // that is unknown (a Match lookup finds it). Other pages are indexed already.
            const storage::ParentLink& link = job->parents[i];
            if (job->write_back && link.kind == storage::ParentLink::Kind::kUnknown) continue;
            std::optional<core::PageKey> parent;
            if (link.kind == storage::ParentLink::Kind::kKey) parent = link.key;
            updates.push_back({job->objects[i].key, parent, job->objects[i].shard,
                               static_cast<uint8_t>(t), true});
          }
          RecordL3Copies(*job->ns->index(), std::move(updates));
          metrics_->CountL3Writes(t, CacheMetrics::L3WriteResult::kOk, ok);
          metrics_->CountL3Writes(t, CacheMetrics::L3WriteResult::kFailed,
                                  result.items.size() - ok);
          metrics_->CountL3Bytes(
              /*write=*/true, bytes,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - put_start).count());
          if (job->tiers_left.fetch_sub(1, std::memory_order_acq_rel) == 1) Finish(*job);
        });
    if (!s.ok()) {
      KVLOG(Warn, "l3 write not submitted",
            {{"tier", tiers_->tier(t).spec.name}, {"error", s.ToString()}});
      metrics_->CountL3Writes(t, CacheMetrics::L3WriteResult::kFailed, items.size());
      if (job->tiers_left.fetch_sub(1, std::memory_order_acq_rel) == 1) Finish(*job);
    }
  }
}

void L3Writer::Finish(Job& job) {
  if (job.owner != 0) {
    job.ns->index()->Unpin(job.owner, job.pinned);
  } else {
    for (core::SlotRef slot : job.slots) l2_->Free(slot);
    held_bytes_.fetch_sub(job.slots.size() * job.ns->slot_bytes(), std::memory_order_relaxed);
  }
  pending_bytes_.fetch_sub(job.bytes, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  --inflight_jobs_;
}

}  // namespace kvcellar::server
