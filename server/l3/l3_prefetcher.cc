#include "server/l3/l3_prefetcher.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/device_backend.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

v1::PrefetchPolicy ToProto(L3PrefetchPolicy p) {
  switch (p) {
    case L3PrefetchPolicy::kNone: return v1::PREFETCH_POLICY_NONE;
    case L3PrefetchPolicy::kBestEffort: return v1::PREFETCH_POLICY_BEST_EFFORT;
    case L3PrefetchPolicy::kWaitComplete: return v1::PREFETCH_POLICY_WAIT_COMPLETE;
    case L3PrefetchPolicy::kTimeout: return v1::PREFETCH_POLICY_TIMEOUT;
  }
  return v1::PREFETCH_POLICY_BEST_EFFORT;
}

// The worse of two read outcomes for one page: a checksum error says most (the copy was bad and
// is gone), then a miss, then any other failure.
v1::PageStatus ReadStatus(storage::ObjectStatus s) {
  switch (s) {
    case storage::ObjectStatus::kOk: return v1::PAGE_STATUS_OK;
    case storage::ObjectStatus::kNotFound: return v1::PAGE_STATUS_MISS;
    case storage::ObjectStatus::kChecksumError: return v1::PAGE_STATUS_CHECKSUM_ERROR;
    default: return v1::PAGE_STATUS_L3_ERROR;
  }
}
int Severity(uint8_t s) {
  switch (s) {
    case v1::PAGE_STATUS_OK: return 0;
    case v1::PAGE_STATUS_L3_ERROR: return 1;
    case v1::PAGE_STATUS_MISS: return 2;
    default: return 3;  // CHECKSUM_ERROR
  }
}

}  // namespace

// The op's stand-in for device work: finished when the reads have landed, or cancelled at the
// deadline or session end (the reads themselves go on; see the file comment).
class L3Prefetcher::FetchOp final : public gpu::DeviceOp {
 public:
  FetchOp() : DeviceOp(Kind::kScatter, 0) {}

 protected:
  void OnCancel() override { Finish(absl::CancelledError("prefetch deadline or session end")); }
};

struct L3Prefetcher::Fetch {
  struct Page {
    core::PageKey key;
    uint32_t flat = 0;      // Index in the op's statuses.
    int tier = -1;          // -1: another op is writing it; we only watch.
    uint64_t pin_id = 0;
    core::ShardMask need = 0;          // The objects the chain's boundary needs of it.
    std::vector<core::SlotRef> slots;  // Per shard: valid for those this op reads.
    uint8_t result = v1::PAGE_STATUS_OK;
  };
  std::shared_ptr<Namespace> ns;
  v1::PrefetchPolicy policy = v1::PREFETCH_POLICY_UNSPECIFIED;
  uint64_t op_id = 0;
  std::vector<uint64_t> best_effort_pins;  // Pins registered in best_effort_by_pin_.
  std::vector<Page> pages;
  uint64_t bytes = 0;  // Reserved in pending_bytes_.
  // When the reads were issued: the L3 -> L2 transfer's duration ends when they have landed.
  std::chrono::steady_clock::time_point started;
  std::atomic<int> reads_left{0};
  std::shared_ptr<FetchOp> op = std::make_shared<FetchOp>();

  absl::Mutex mu;
  std::vector<uint8_t> statuses ABSL_GUARDED_BY(mu);  // Final, once landed.
  bool landed ABSL_GUARDED_BY(mu) = false;
  std::shared_ptr<OpRecord> record ABSL_GUARDED_BY(mu);
};

class L3Prefetcher::Completion final : public OpCompletion {
 public:
  Completion(std::shared_ptr<Fetch> fetch, CacheMetrics* metrics)
      : fetch_(std::move(fetch)), metrics_(metrics) {}

  OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                     absl::Span<uint8_t> statuses) override {
    OpOutcome out;
    {
      absl::MutexLock lock(&fetch_->mu);
      if (fetch_->landed) {
        std::copy(fetch_->statuses.begin(), fetch_->statuses.end(), statuses.begin());
      }
    }
    const bool ended = cause == OpCancelCause::kSessionEnded;
    const bool released = cause == OpCancelCause::kReleased;
    bool cut_short = false;  // Some page had not landed.
    for (uint8_t& s : statuses) {
      if (s == v1::PAGE_STATUS_PENDING) {
        s = ended || released ? v1::PAGE_STATUS_CANCELLED : v1::PAGE_STATUS_TIMEOUT;
        cut_short = true;
      }
    }
    if (ended) out = {v1::OP_STATE_CANCELLED, "session ended"};
    if (released && cut_short) out = {v1::OP_STATE_CANCELLED, "cancelled by Release"};
    (void)device;
    std::array<uint64_t, v1::PageStatus_ARRAYSIZE> counts{};
    for (uint8_t s : statuses) {
      if (s < counts.size()) ++counts[s];
    }
    for (size_t s = 0; s < counts.size(); ++s) {
      metrics_->CountPrefetchPages(fetch_->policy, static_cast<v1::PageStatus>(s), counts[s]);
    }
    return out;
  }

 private:
  std::shared_ptr<Fetch> fetch_;
  CacheMetrics* const metrics_;
};

L3Prefetcher::L3Prefetcher(L3Tiers* tiers, L2Space* l2, OpTable* ops, PinTable* pins,
                           CacheMetrics* metrics, const CacheLimits* limits,
                           const StorageConfig& config)
    : tiers_(tiers),
      l2_(l2),
      ops_(ops),
      pins_(pins),
      metrics_(metrics),
      limits_(limits),
      default_policy_(ToProto(config.prefetch_policy)),
      base_timeout_(absl::Milliseconds(config.prefetch_timeout_base_ms)),
      per_1k_tokens_(absl::Milliseconds(config.prefetch_timeout_per_1k_tokens_ms)),
      max_pending_bytes_(config.max_pending_prefetch_bytes) {}

L3Prefetcher::~L3Prefetcher() { Drain(); }

void L3Prefetcher::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](size_t* n) { return *n == 0; }, &inflight_));
}

v1::PrefetchPolicy L3Prefetcher::Resolve(v1::PrefetchPolicy policy) const {
  return policy == v1::PREFETCH_POLICY_UNSPECIFIED ? default_policy_ : policy;
}

absl::Duration L3Prefetcher::Deadline(v1::PrefetchPolicy policy, uint32_t timeout_ms,
                                      uint64_t tokens) const {
  const absl::Duration max = absl::Milliseconds(limits_->max_prefetch_timeout_ms);
  if (policy != v1::PREFETCH_POLICY_TIMEOUT) return max;
  if (timeout_ms > 0) return std::min(max, absl::Milliseconds(timeout_ms));
  return std::min(max, base_timeout_ + per_1k_tokens_ * (static_cast<double>(tokens) / 1024.0));
}

// One Start's plan: per page its status, and per tier the reads to make.
struct L3Prefetcher::Plan {
  Plan(Namespace& n, size_t num_tiers)
      : ns(n),
        index(n.index()),
        shards(n.shards()),
        group(n.group_shards()),
        items(num_tiers),
        item_page(num_tiers) {}

  // The objects of page `i` of a chain of `pages` a hit at the chain's end needs: every shard,
  // or of a hybrid model's groups what the boundary rule names (the rule depends only on the
  // page's distance to the boundary, so chain positions serve as page numbers).
  core::ShardMask Need(size_t pages, size_t i) const {
    return index->NeededObjects(group, static_cast<uint32_t>(pages), static_cast<uint32_t>(i));
  }
  // Bytes of the objects in `shards`: what reading them reserves of max_pending_bytes.
  uint64_t Bytes(core::ShardMask shards) const {
    uint64_t bytes = 0;
    for (core::ShardMask m = shards; m != 0; m &= m - 1) {
      bytes += ns.shard_object_bytes(static_cast<uint16_t>(std::countr_zero(m)));
    }
    return bytes;
  }

  Namespace& ns;
  core::RadixIndex* const index;
  const int shards;
  const core::ShardMask group;

  std::vector<uint8_t> statuses;  // Per page, flat over the chains.
  std::vector<uint32_t> seq_begin;
  std::vector<std::vector<storage::GetItem>> items;  // Per tier, the objects to read.
  // Per tier and item: (index in Fetch::pages, shard).
  std::vector<std::vector<std::pair<uint32_t, uint16_t>>> item_page;
  std::vector<std::pair<uint64_t, core::PageKey>> present_pins;  // (pin, key) to extend.
};

// What the index says of a page: shards committed, shards being written.
struct L3Prefetcher::PageState {
  std::optional<core::PageInfo> info;
  core::ShardMask committed = 0;
  core::ShardMask writing = 0;
  // The tiers holding every shard of `shards` (all tiers for none).
  uint8_t Tiers(core::ShardMask shards) const {
    uint8_t tiers = 0xff;
    for (core::ShardMask m = shards; m != 0; m &= m - 1) {
      const size_t s = static_cast<size_t>(std::countr_zero(m));
      tiers &= info.has_value() && s < info->shards.size() ? info->shards[s].l3_tiers : 0;
    }
    return tiers;
  }
};

L3Prefetcher::Started L3Prefetcher::Start(const SessionInfo& session,
                                          std::vector<PrefetchChain> chains,
                                          v1::PrefetchPolicy policy, absl::Duration deadline,
                                          bool always_op) {
  Started started;
  started.fetching.assign(chains.size(), 0);
  auto fetch = std::make_shared<Fetch>();
  fetch->ns = session.ns;
  fetch->policy = policy;
  Plan plan(*session.ns, tiers_->size());
  for (size_t c = 0; c < chains.size(); ++c) {
    started.fetching[c] = PlanChain(chains[c], plan, *fetch);
  }
  plan.seq_begin.push_back(static_cast<uint32_t>(plan.statuses.size()));
  for (const auto& [pin, key] : plan.present_pins) {
    pins_->Extend(pin, absl::MakeConstSpan(&key, 1));
  }
  if (fetch->pages.empty() && !always_op) return started;

  std::unique_ptr<OpRecord> record = NewRecord(session, chains, plan, deadline, fetch);
  // Reads first, then the op: a read that completes at once lands before Add and Add finalizes.
  SubmitReads(plan, fetch);
  started.op = ops_->Add(std::move(record));
  {
    absl::MutexLock lock(&fetch->mu);
    fetch->record = started.op;
  }
  // The reads may have landed between Add's own attempt and the line above.
  if (fetch->op->Poll()) ops_->TryFinalize(*started.op);
  return started;
}

uint32_t L3Prefetcher::PlanChain(const PrefetchChain& chain, Plan& plan, Fetch& fetch) {
  uint32_t fetching = 0;
  plan.seq_begin.push_back(static_cast<uint32_t>(plan.statuses.size()));
  std::optional<core::PageKey> parent = chain.parent;
  bool stopped = plan.index == nullptr;
  for (size_t i = 0; i < chain.keys.size(); ++i) {
    const uint32_t flat = static_cast<uint32_t>(plan.statuses.size());
    plan.statuses.push_back(v1::PAGE_STATUS_SKIPPED);
    if (stopped) continue;
    const core::PageKey& key = chain.keys[i];
    const PageState state = Inspect(*plan.index, plan.shards, key);
    if (i == 0 && !chain.parent_known) {
      if (!state.info.has_value()) {
        plan.statuses[flat] = v1::PAGE_STATUS_MISS;
        stopped = true;
        continue;
      }
      parent = state.info->parent;
    }
    const core::ShardMask need = plan.Need(chain.keys.size(), i);
    if ((state.committed & need) == need) {
      plan.statuses[flat] = v1::PAGE_STATUS_ALREADY_PRESENT;
      if (chain.pin_id != 0) plan.present_pins.emplace_back(chain.pin_id, key);
      parent = key;
      continue;
    }
    if ((state.writing & need) != 0) {
      // Another op brings it (or some of its shards): watch, do not read it twice.
      plan.statuses[flat] = v1::PAGE_STATUS_PENDING;
      fetch.pages.push_back({key, flat, -1, chain.pin_id, need, {}, v1::PAGE_STATUS_OK});
      parent = key;
      continue;
    }
    const core::ShardMask read = need & ~state.committed;
    const int tier = ReadTier(i < chain.tiers.size() ? chain.tiers[i] : -1, state.Tiers(read));
    if (tier < 0) {
      plan.statuses[flat] = v1::PAGE_STATUS_MISS;
      stopped = true;
      continue;
    }
    const uint64_t page_bytes = plan.Bytes(read);
    if (!ReservePending(page_bytes)) {
      plan.statuses[flat] = v1::PAGE_STATUS_THROTTLED;
      stopped = true;
      continue;
    }
    Fetch::Page page{key, flat, tier, chain.pin_id, need, {}, v1::PAGE_STATUS_OK};
    const v1::PageStatus failed = BeginPage(plan, key, parent, read, &page.slots);
    if (failed != v1::PAGE_STATUS_UNSPECIFIED) {
      pending_bytes_.fetch_sub(page_bytes, std::memory_order_relaxed);
      plan.statuses[flat] = static_cast<uint8_t>(failed);
      stopped = true;
      continue;
    }
    const uint32_t page_index = static_cast<uint32_t>(fetch.pages.size());
    for (int s = 0; s < plan.shards; ++s) {
      if (!page.slots[s].valid()) continue;
      const auto shard = static_cast<uint16_t>(s);
      plan.items[tier].push_back(
          {key, shard, l2_->pool()->Address(page.slots[s]), plan.ns.shard_object_bytes(shard)});
      plan.item_page[tier].emplace_back(page_index, shard);
    }
    fetch.bytes += page_bytes;
    fetch.pages.push_back(std::move(page));
    plan.statuses[flat] = v1::PAGE_STATUS_PENDING;
    ++fetching;
    parent = key;
  }
  return fetching;
}

L3Prefetcher::PageState L3Prefetcher::Inspect(const core::RadixIndex& index, int shards,
                                              const core::PageKey& key) {
  PageState state;
  state.info = index.Inspect(key);
  if (!state.info.has_value()) return state;
  for (int s = 0; s < shards && s < static_cast<int>(state.info->shards.size()); ++s) {
    const core::ShardInfo& si = state.info->shards[s];
    if (si.l2 == core::L2State::kResident) state.committed |= core::ShardMask{1} << s;
    if (si.l2 == core::L2State::kWriting) state.writing |= core::ShardMask{1} << s;
  }
  return state;
}

int L3Prefetcher::ReadTier(int matched_tier, uint8_t tiers_holding) const {
  if (matched_tier >= 0) return matched_tier;
  for (size_t t = 0; t < tiers_->size(); ++t) {
    if ((tiers_holding >> t & 1) != 0) return static_cast<int>(t);
  }
  return -1;
}

bool L3Prefetcher::ReservePending(uint64_t bytes) {
  uint64_t cur = pending_bytes_.load(std::memory_order_relaxed);
  while (cur + bytes <= max_pending_bytes_) {
    if (pending_bytes_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

v1::PageStatus L3Prefetcher::BeginPage(Plan& plan, const core::PageKey& key,
                                       std::optional<core::PageKey> parent, core::ShardMask read,
                                       std::vector<core::SlotRef>* slots) {
  // Every shard read: a slot, then an in-flight entry in the index.
  v1::PageStatus failed = v1::PAGE_STATUS_UNSPECIFIED;
  std::vector<core::ObjectId> begun;
  for (int s = 0; s < plan.shards; ++s) {
    if ((read >> s & 1) == 0) {
      slots->push_back(core::SlotRef{});  // In L2 already, or not needed.
      continue;
    }
    absl::StatusOr<core::SlotRef> slot =
        l2_->Allocate(plan.ns, key, static_cast<uint16_t>(s), plan.ns.slot_bytes());
    if (!slot.ok()) {
      failed = v1::PAGE_STATUS_NO_SPACE;
      break;
    }
    const core::WriteRequest write{key, parent, static_cast<uint16_t>(s), *slot,
                                   core::WriteKind::kPrefetch};
    absl::Status b = plan.index->BeginWrite(write);
    if (b.ok()) l2_->JournalWriting(plan.ns, write);
    if (!b.ok()) {
      l2_->Free(*slot);
      failed = b.code() == absl::StatusCode::kFailedPrecondition
                   ? v1::PAGE_STATUS_PARENT_MISSING
                   : v1::PAGE_STATUS_MISS;  // Raced with a writer: not ours to fetch.
      break;
    }
    begun.push_back({key, static_cast<uint16_t>(s)});
    slots->push_back(*slot);
  }
  if (failed != v1::PAGE_STATUS_UNSPECIFIED) {
    std::vector<core::ReleasedObject> released;
    plan.index->Abort(begun, &released);
    l2_->FreeReleased(released);
  }
  return failed;
}

std::unique_ptr<OpRecord> L3Prefetcher::NewRecord(const SessionInfo& session,
                                                  const std::vector<PrefetchChain>& chains,
                                                  Plan& plan, absl::Duration deadline,
                                                  const std::shared_ptr<Fetch>& shared) {
  Fetch& fetch = *shared;
  auto record = std::make_unique<OpRecord>();
  record->seq_begin = std::move(plan.seq_begin);  // Not needed by the reads.
  record->id = ops_->NextId();
  fetch.op_id = record->id;
  if (fetch.policy == v1::PREFETCH_POLICY_BEST_EFFORT) {
    for (const PrefetchChain& chain : chains) {
      if (chain.pin_id != 0) fetch.best_effort_pins.push_back(chain.pin_id);
    }
  }
  record->kind = v1::OP_KIND_PREFETCH;
  record->instance_id = session.instance_id;
  record->session_id = session.id;
  record->submitted = absl::Now();
  record->ready_deadline = record->submitted + deadline;
  record->statuses = plan.statuses;
  record->device = fetch.op;
  record->completion = std::make_unique<Completion>(shared, metrics_);
  {
    absl::MutexLock lock(&fetch.mu);
    fetch.statuses = plan.statuses;
  }
  absl::MutexLock lock(&mu_);
  ++inflight_;
  for (uint64_t pin : fetch.best_effort_pins) best_effort_by_pin_[pin] = fetch.op_id;
  return record;
}

void L3Prefetcher::SubmitReads(const Plan& plan, const std::shared_ptr<Fetch>& fetch) {
  // Reads go out per tier in batches of at most the backend's max_batch_items.
  std::vector<size_t> max_items(tiers_->size());
  size_t batches = 0;
  for (size_t t = 0; t < tiers_->size(); ++t) {
    max_items[t] = std::max<size_t>(1, tiers_->tier(t).backend->capabilities().max_batch_items);
    batches += (plan.items[t].size() + max_items[t] - 1) / max_items[t];
  }
  fetch->reads_left.store(static_cast<int>(batches), std::memory_order_relaxed);
  fetch->started = std::chrono::steady_clock::now();
  if (batches == 0) {
    Land(*fetch);
    return;
  }
  for (size_t t = 0; t < tiers_->size(); ++t) {
    const std::vector<storage::GetItem>& items = plan.items[t];
    for (size_t off = 0; off < items.size(); off += max_items[t]) {
      const size_t n = std::min(max_items[t], items.size() - off);
      auto map = std::make_shared<std::vector<std::pair<uint32_t, uint16_t>>>(
          plan.item_page[t].begin() + off, plan.item_page[t].begin() + off + n);
      storage::GetRequest request{plan.ns.digest(), absl::MakeConstSpan(items).subspan(off, n),
                                  absl::ZeroDuration()};
      absl::Status s = tiers_->tier(t).backend->Get(
          request, [this, fetch, map](storage::BatchResult result) {
            {
              // A page's shards may span two batches, whose callbacks can run at once.
              absl::MutexLock lock(&fetch->mu);
              for (size_t i = 0; i < result.items.size() && i < map->size(); ++i) {
                Fetch::Page& page = fetch->pages[(*map)[i].first];
                const uint8_t st = ReadStatus(result.items[i].status);
                if (Severity(st) > Severity(page.result)) page.result = st;
              }
            }
            if (fetch->reads_left.fetch_sub(1, std::memory_order_acq_rel) == 1) Land(*fetch);
          });
      if (!s.ok()) {
        KVLOG(Warn, "l3 read not submitted",
              {{"tier", tiers_->tier(t).spec.name}, {"error", s.ToString()}});
        {
          absl::MutexLock lock(&fetch->mu);
          for (size_t i = 0; i < n; ++i) {
            fetch->pages[(*map)[i].first].result = v1::PAGE_STATUS_L3_ERROR;
          }
        }
        if (fetch->reads_left.fetch_sub(1, std::memory_order_acq_rel) == 1) Land(*fetch);
      }
    }
  }
}

void L3Prefetcher::Land(Fetch& fetch) {
  Namespace& ns = *fetch.ns;
  core::RadixIndex* index = ns.index();
  const int shards = ns.shards();
  std::vector<core::ObjectId> commit;
  std::vector<core::ObjectId> abort;
  std::vector<core::L3Update> gone;
  std::vector<uint8_t> finals(fetch.pages.size(), v1::PAGE_STATUS_OK);
  uint64_t landed_bytes = 0;
  for (size_t p = 0; p < fetch.pages.size(); ++p) {
    Fetch::Page& page = fetch.pages[p];
    if (page.tier < 0) continue;
    for (int s = 0; s < shards; ++s) {
      if (!page.slots[s].valid()) continue;
      (page.result == v1::PAGE_STATUS_OK ? commit : abort).push_back({page.key,
                                                                     static_cast<uint16_t>(s)});
      if (page.result == v1::PAGE_STATUS_OK) {
        landed_bytes += ns.shard_object_bytes(static_cast<uint16_t>(s));
        l2_->JournalCommitted(ns, page.slots[s]);  // Checked already; recorded before visible.
      }
      if (page.result == v1::PAGE_STATUS_MISS || page.result == v1::PAGE_STATUS_CHECKSUM_ERROR) {
        gone.push_back({page.key, std::nullopt, static_cast<uint16_t>(s),
                        static_cast<uint8_t>(page.tier), false});
      }
    }
    finals[p] = page.result;
  }
  if (!commit.empty()) {
    std::vector<absl::Status> st(commit.size());
    index->Commit(commit, absl::MakeSpan(st));
    for (size_t i = 0; i < st.size(); ++i) {
      if (!st[i].ok()) {
        KVLOG(Error, "prefetch commit failed", {{"error", st[i].ToString()}});
      }
    }
  }
  if (!abort.empty()) {
    std::vector<core::ReleasedObject> released;
    index->Abort(abort, &released);
    l2_->FreeReleased(released);
  }
  if (!gone.empty()) {
    std::vector<absl::Status> st(gone.size());
    index->UpdateL3(gone, absl::MakeSpan(st));
  }
  metrics_->CountL3Bytes(
      /*write=*/false, landed_bytes,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - fetch.started).count());

  // Final statuses: our reads as above; pages another op was writing, as they stand now.
  absl::flat_hash_map<uint64_t, std::vector<core::PageKey>> pin_keys;
  for (size_t p = 0; p < fetch.pages.size(); ++p) {
    Fetch::Page& page = fetch.pages[p];
    if (page.tier < 0) {
      const core::ShardMask committed = Inspect(*index, shards, page.key).committed;
      finals[p] = (committed & page.need) == page.need ? v1::PAGE_STATUS_OK : v1::PAGE_STATUS_MISS;
    }
    if (finals[p] == v1::PAGE_STATUS_OK && page.pin_id != 0) {
      pin_keys[page.pin_id].push_back(page.key);
    }
  }
  for (auto& [pin, keys] : pin_keys) pins_->Extend(pin, keys);
  pending_bytes_.fetch_sub(fetch.bytes, std::memory_order_relaxed);

  std::shared_ptr<OpRecord> record;
  {
    absl::MutexLock lock(&fetch.mu);
    for (size_t p = 0; p < fetch.pages.size(); ++p) {
      fetch.statuses[fetch.pages[p].flat] = finals[p];
    }
    fetch.landed = true;
    record = fetch.record;
  }
  fetch.op->Finish(absl::OkStatus());
  if (record != nullptr) ops_->TryFinalize(*record);
  absl::MutexLock lock(&mu_);
  for (uint64_t pin : fetch.best_effort_pins) {
    auto it = best_effort_by_pin_.find(pin);
    if (it != best_effort_by_pin_.end() && it->second == fetch.op_id) best_effort_by_pin_.erase(it);
  }
  --inflight_;
}

void L3Prefetcher::Abandon(uint64_t pin_id, const std::string& instance_id) {
  uint64_t op_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = best_effort_by_pin_.find(pin_id);
    if (it == best_effort_by_pin_.end()) return;
    op_id = it->second;
    best_effort_by_pin_.erase(it);
  }
  ops_->Cancel(op_id, instance_id);  // UNKNOWN for another instance's pin: nothing happens.
}

}  // namespace kvcellar::server
