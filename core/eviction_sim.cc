#include "core/eviction_sim.h"

#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/radix_index.h"
#include "core/splitmix.h"

namespace kvcellar::core {
namespace {

constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

void CountRequest(const Trace& trace, const TraceRequest& request, uint64_t hit_pages,
                  SimResult* result) {
  ++result->requests;
  result->tokens += request.tokens;
  result->hit_tokens += hit_pages * trace.page_size;
}

}  // namespace

uint64_t Trace::DistinctPages() const {
  absl::flat_hash_set<uint64_t> seen;
  for (const TraceRequest& r : requests) seen.insert(r.pages.begin(), r.pages.end());
  return seen.size();
}

PageKey SimPageKey(uint64_t id) {
  // Distinct first 8 bytes (what the index hashes) from a bijection of the id.
  PageKey key;
  const uint64_t mixed = SplitMix64(id);
  std::memcpy(key.bytes.data(), &mixed, sizeof(mixed));
  std::memcpy(key.bytes.data() + sizeof(mixed), &id, sizeof(id));
  return key;
}

absl::StatusOr<SimResult> SimulateIndex(const Trace& trace, EvictionPolicyKind policy,
                                        SimCapacity capacity) {
  return SimulateIndex(
      trace, [policy] { return MakeEvictionPolicy(policy); }, capacity);
}

absl::StatusOr<SimResult> SimulateIndex(
    const Trace& trace, const std::function<std::unique_ptr<EvictionPolicy>()>& make_policy,
    SimCapacity capacity) {
  const auto high = static_cast<uint64_t>(capacity.high_watermark * capacity.pages);
  const auto low = static_cast<uint64_t>(capacity.low_watermark * capacity.pages);
  RadixIndexOptions options;
  options.object_bytes = 1;
  absl::StatusOr<std::unique_ptr<RadixIndex>> created = RadixIndex::Create(options, make_policy());
  if (!created.ok()) return created.status();
  RadixIndex& index = **created;
  SimResult result;
  uint64_t resident = 0;
  uint32_t next_slot = 0;
  std::vector<PageKey> keys;
  std::vector<WriteRequest> writes;
  std::vector<ObjectId> objects;
  std::vector<absl::Status> statuses;
  std::vector<ReleasedObject> evicted;
  for (size_t r = 0; r < trace.requests.size(); ++r) {
    const TraceRequest& request = trace.requests[r];
    keys.clear();
    for (uint64_t id : request.pages) keys.push_back(SimPageKey(id));
    uint32_t hit = 0;
    if (!keys.empty()) {
      absl::StatusOr<MatchResult> m = index.Match(keys, MatchOptions{});
      if (!m.ok()) return m.status();
      hit = m->l2_pages;
      // The Load of the hit matches its pages again (DeviceMover::Load pins them under its op):
      // a second access, as in the daemon.
      if (hit > 0) {
        absl::StatusOr<MatchResult> load =
            index.Match(absl::MakeConstSpan(keys).first(hit), MatchOptions{});
        if (!load.ok()) return load.status();
      }
    }
    CountRequest(trace, request, hit, &result);
    // The misses, as a Backup stores them: in flight, then committed.
    writes.clear();
    objects.clear();
    for (size_t i = hit; i < keys.size(); ++i) {
      std::optional<PageKey> parent;
      if (i > 0) parent = keys[i - 1];
      writes.push_back({keys[i], parent, 0, SlotRef{0, 0, next_slot++}, WriteKind::kBackup});
      objects.push_back({keys[i], 0});
    }
    statuses.assign(writes.size(), absl::OkStatus());
    index.BeginWrite(writes, absl::MakeSpan(statuses));
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("requests[", r, "].pages[", hit + i, "]: ", statuses[i].message()));
      }
    }
    index.Commit(objects, absl::MakeSpan(statuses));
    resident += writes.size();
    if (resident > high) {
      evicted.clear();
      const size_t n = index.EvictPages(resident - low, &evicted);
      resident -= n;
      result.evicted_pages += n;
    }
  }
  return result;
}

SimResult SimulateBelady(const Trace& trace, uint64_t capacity_pages) {
  // next_use[r][i]: the next request after r naming request r's page i (kNever: none).
  std::vector<std::vector<uint64_t>> next_use(trace.requests.size());
  absl::flat_hash_map<uint64_t, uint64_t> upcoming;
  for (size_t r = trace.requests.size(); r-- > 0;) {
    const std::vector<uint64_t>& pages = trace.requests[r].pages;
    next_use[r].resize(pages.size());
    for (size_t i = 0; i < pages.size(); ++i) {
      auto it = upcoming.find(pages[i]);
      next_use[r][i] = it == upcoming.end() ? kNever : it->second;
    }
    for (uint64_t id : pages) upcoming[id] = r;
  }
  // The cache, ordered by (next use, depth, id): the last entry leaves first.
  using Entry = std::tuple<uint64_t, uint64_t, uint64_t>;
  std::set<Entry> order;
  absl::flat_hash_map<uint64_t, Entry> cached;
  SimResult result;
  for (size_t r = 0; r < trace.requests.size(); ++r) {
    const TraceRequest& request = trace.requests[r];
    uint64_t hit = 0;
    while (hit < request.pages.size() && cached.contains(request.pages[hit])) ++hit;
    CountRequest(trace, request, hit, &result);
    for (size_t i = 0; i < request.pages.size(); ++i) {
      const uint64_t id = request.pages[i];
      auto [it, inserted] = cached.try_emplace(id);
      if (!inserted) order.erase(it->second);
      it->second = Entry{next_use[r][i], i, id};
      order.insert(it->second);
    }
    while (order.size() > capacity_pages) {
      auto last = std::prev(order.end());
      cached.erase(std::get<2>(*last));
      order.erase(last);
      ++result.evicted_pages;  // A page of this request among them was never kept (a bypass).
    }
  }
  return result;
}

SimResult SimulateUnbounded(const Trace& trace) {
  absl::flat_hash_set<uint64_t> cached;
  SimResult result;
  for (const TraceRequest& request : trace.requests) {
    uint64_t hit = 0;
    while (hit < request.pages.size() && cached.contains(request.pages[hit])) ++hit;
    CountRequest(trace, request, hit, &result);
    cached.insert(request.pages.begin(), request.pages.end());
  }
  return result;
}

}  // namespace kvcellar::core
