#include "server/datapath/device_mover.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

using v1::PageStatus;

// Pins an op takes for itself (a Load's pages while they are copied, a Backup's parents while it
// makes room) end when the op is finalized or its submission ends. The lease only matters if that
// never happens (a bug): then the pages unpin after 10 minutes, far longer than any copy.
constexpr absl::Duration kOwnPinLease = absl::Minutes(10);

// Bytes a copy of `items` moves: each its group's object (a hybrid model's groups differ).
uint64_t MovedBytes(const Namespace& ns, absl::Span<const gpu::CopyItem> items) {
  uint64_t bytes = 0;
  for (const gpu::CopyItem& item : items) bytes += ns.group_object_bytes(item.group);
  return bytes;
}

// The backend that opened the session's mapping: the one of its kind. Never nullptr for a WORKER
// session (RegisterEngine admits only a served kind, and the set does not change).
gpu::DeviceBackend* DeviceOf(const DeviceSet& devices, const SessionInfo& info) {
  return devices.For(info.device_kind);
}

template <typename Sequences>
std::vector<uint32_t> SequenceStarts(const Sequences& sequences) {
  std::vector<uint32_t> begin;
  begin.reserve(sequences.size() + 1);
  uint32_t n = 0;
  for (const auto& seq : sequences) {
    begin.push_back(n);
    n += static_cast<uint32_t>(seq.page_keys().size() / core::kPageKeyBytes);
  }
  begin.push_back(n);
  return begin;
}

// The page objects a Load or Backup moves, in request order: one per page (device_blocks) or, in
// a hybrid namespace, one per (page, group) that names a block (group_blocks, page-major).
struct ObjectPlan {
  std::vector<uint32_t> page;        // Flat page index of each object.
  std::vector<uint32_t> group;       // Its KV group.
  std::vector<uint32_t> block;       // Its device block (in its group's pool).
  std::vector<uint32_t> busy;        // That block as the session tracks it (BusyBlock).
  std::vector<uint32_t> field;       // Its index in the sequence's device_blocks / group_blocks.
  std::vector<uint32_t> page_begin;  // Objects of page p: [page_begin[p], page_begin[p + 1]).
  bool hybrid = false;

  size_t size() const { return page.size(); }
  // "sequences[2].group_blocks[7]": the request field of object k.
  std::string Field(const std::vector<uint32_t>& seq_begin, size_t k) const {
    auto it = std::upper_bound(seq_begin.begin(), seq_begin.end(), page[k]);
    const size_t s = static_cast<size_t>(it - seq_begin.begin()) - 1;
    return absl::StrCat("sequences[", s, "].", hybrid ? "group_blocks" : "device_blocks", "[",
                        field[k], "]");
  }
};

template <typename Sequences>
ObjectPlan PlanObjects(const Sequences& sequences, uint32_t pages, const SessionInfo& info) {
  const size_t groups = info.group_kinds.size();
  ObjectPlan plan;
  plan.hybrid = groups > 0;
  plan.page.reserve(pages);
  plan.page_begin.reserve(pages + 1);
  auto add = [&plan, &info](uint32_t page, uint32_t group, uint32_t block, uint32_t field) {
    plan.page.push_back(page);
    plan.group.push_back(group);
    plan.block.push_back(block);
    plan.busy.push_back(info.BusyBlock(group, block));
    plan.field.push_back(field);
  };
  uint32_t p = 0;
  for (const auto& seq : sequences) {
    const uint32_t len = static_cast<uint32_t>(seq.page_keys().size() / core::kPageKeyBytes);
    for (uint32_t i = 0; i < len; ++i, ++p) {
      plan.page_begin.push_back(static_cast<uint32_t>(plan.size()));
      if (!plan.hybrid) {
        add(p, 0, seq.device_blocks(i), i);
        continue;
      }
      for (uint32_t g = 0; g < groups; ++g) {
        const uint32_t j = static_cast<uint32_t>(i * groups + g);
        if (seq.group_blocks(j) != core::kNoBlock) add(p, g, seq.group_blocks(j), j);
      }
    }
  }
  plan.page_begin.push_back(static_cast<uint32_t>(plan.size()));
  return plan;
}

// Why a page that is not committed for the whole group cannot be loaded: a write of one of its
// shards is unfinished (IN_FLIGHT) or it is simply not there (MISS).
// What a Load or Backup answers when the device refuses its batch (`refused`). The device says
// FAILED_PRECONDITION when the engine's registered memory can no longer be used (a SIM engine
// truncated or shrank its shared-memory object under the daemon's mapping, or the session's
// mapping closed): the engine's doing, which it fixes by registering again, so both RPCs answer
// FAILED_PRECONDITION (HANDLE_OPEN_FAILED) for it, as an op already under way fails with the same
// message. Any other refusal is the daemon's or the device's fault: INTERNAL, logged.
absl::Status SubmitRefused(absl::string_view rpc, const SessionInfo& info,
                           const absl::Status& refused) {
  if (refused.code() == absl::StatusCode::kFailedPrecondition) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_HANDLE_OPEN_FAILED,
                      "session_id",
                      absl::StrCat("session_id ", info.id, ": ", rpc,
                                   ": the engine's registered memory can no longer be used (",
                                   refused.message(), ")"));
  }
  KVLOG(Error, "device submit failed",
        {{"rpc", rpc}, {"session_id", info.id}, {"error", refused.ToString()}});
  return absl::InternalError(
      absl::StrCat(rpc, ": the device refused the batch: ", refused.message()));
}

PageStatus NotLoadable(const core::RadixIndex& index, const core::PageKey& key,
                       core::ShardMask shards) {
  std::optional<core::PageInfo> info = index.Inspect(key);
  if (!info.has_value()) return v1::PAGE_STATUS_MISS;
  for (size_t s = 0; s < info->shards.size(); ++s) {
    if ((shards >> s & 1) != 0 && info->shards[s].l2 == core::L2State::kWriting) {
      return v1::PAGE_STATUS_IN_FLIGHT;
    }
  }
  return v1::PAGE_STATUS_MISS;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool Cancelled(const absl::Status& s) { return s.code() == absl::StatusCode::kCancelled; }

void SetPending(absl::Span<uint8_t> statuses, PageStatus final_status) {
  for (uint8_t& s : statuses) {
    if (s == v1::PAGE_STATUS_PENDING) s = static_cast<uint8_t>(final_status);
  }
}

// The outcome of a copy that did not finish: CANCELLED when its session ended or the device
// cancelled it, else FAILED with the device's error (logged as `event`). Pending pages say which.
OpOutcome Unfinished(const absl::Status& device, OpCancelCause cause, uint64_t op_id,
                     absl::string_view event, absl::Span<uint8_t> statuses) {
  if (cause == OpCancelCause::kSessionEnded || Cancelled(device)) {
    SetPending(statuses, v1::PAGE_STATUS_CANCELLED);
    return {v1::OP_STATE_CANCELLED,
            cause == OpCancelCause::kSessionEnded ? "session ended" : device.ToString()};
  }
  SetPending(statuses, v1::PAGE_STATUS_DEVICE_ERROR);
  KVLOG(Warn, event, {{"op_id", op_id}, {"error", device.ToString()}});
  return {v1::OP_STATE_FAILED, absl::StrCat("device error: ", device.ToString())};
}

class LoadCompletion final : public OpCompletion {
 public:
  std::shared_ptr<Session> session;
  uint64_t op_id = 0;
  bool pinned = false;
  std::vector<uint32_t> blocks;  // Blocks the copy writes (as SessionInfo::BusyBlock numbers).
  std::optional<uint32_t> slot;
  std::vector<uint64_t> release_pins;
  PinTable* pins = nullptr;
  SimSignalPump* pump = nullptr;  // Set when the engine's layer words are signalled.
  CacheMetrics* metrics = nullptr;
  uint64_t bytes = 0;
  std::chrono::steady_clock::time_point submitted;  // For the transfer's duration.

  OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                     absl::Span<uint8_t> statuses) override {
    const SessionInfo& info = session->info();
    if (pinned) info.ns->index()->ReleaseOwner(op_id);
    OpOutcome out;
    if (device.ok()) {
      SetPending(statuses, v1::PAGE_STATUS_OK);
      metrics->CountMovedBytes(v1::OP_KIND_LOAD, bytes, SecondsSince(submitted));
    } else {
      out = Unfinished(device, cause, op_id, "load failed", statuses);
    }
    // Every layer, then the op word: the engine's waits all end, whatever the outcome.
    if (pump != nullptr) pump->FinishLoad(op_id, out.state != v1::OP_STATE_DONE);
    session->ReleaseBlocks(blocks);
    if (slot.has_value()) session->ReleaseSlot(*slot);
    session->OpFinished();
    for (uint64_t pin : release_pins) pins->DropHold(pin, info.instance_id, info.rank);
    return out;
  }
};

class BackupCompletion final : public OpCompletion {
 public:
  std::shared_ptr<Session> session;
  uint64_t op_id = 0;
  std::vector<core::ObjectId> objects;  // In flight in the index, one per PENDING page.
  std::vector<core::SlotRef> slots;     // Each object's slot.
  std::vector<uint32_t> object_page;    // Each object's page (flat index).
  std::vector<uint32_t> blocks;         // Blocks the copy reads (as BusyBlock numbers).
  uint32_t ready_timeout_ms = 0;
  L2Space* l2 = nullptr;
  CacheMetrics* metrics = nullptr;
  L3Writer* writer = nullptr;
  v1::WritePolicy write_policy = v1::WRITE_POLICY_UNSPECIFIED;
  uint64_t bytes = 0;
  std::chrono::steady_clock::time_point submitted;  // For the transfer's duration.

  OpOutcome Complete(const absl::Status& device, OpCancelCause cause,
                     absl::Span<uint8_t> statuses) override {
    core::RadixIndex* index = session->info().ns->index();
    OpOutcome out;
    if (device.ok()) {
      // Every byte has landed: recorded for a warm restart, then visible (once their group is
      // complete).
      const Namespace& ns = *session->info().ns;
      for (core::SlotRef slot : slots) l2->JournalCommitted(ns, slot);
      std::vector<absl::Status> committed(objects.size());
      index->Commit(objects, absl::MakeSpan(committed));
      std::vector<core::ObjectId> stored;
      stored.reserve(objects.size());
      for (size_t k = 0; k < objects.size(); ++k) {
        if (committed[k].ok()) {
          // A page of several objects (a hybrid's groups) is OK once all of them are.
          uint8_t& status = statuses[object_page[k]];
          if (status == v1::PAGE_STATUS_PENDING) status = v1::PAGE_STATUS_OK;
          stored.push_back(objects[k]);
        } else {
          statuses[object_page[k]] = v1::PAGE_STATUS_INTERNAL_ERROR;
          KVLOG(Error, "backup commit failed",
                {{"op_id", op_id}, {"error", committed[k].ToString()}});
        }
      }
      metrics->CountMovedBytes(v1::OP_KIND_BACKUP, bytes, SecondsSince(submitted));
      // L3 follows the write policy; the op does not wait for it.
      if (writer != nullptr) writer->OnCommitted(*session->info().ns, stored, write_policy);
    } else {
      // Nothing partial is ever visible: the in-flight objects go, their slots with them.
      std::vector<core::ReleasedObject> released;
      index->Abort(objects, &released);
      l2->FreeReleased(released);
      if (cause == OpCancelCause::kReadyTimeout) {
        SetPending(statuses, v1::PAGE_STATUS_TIMEOUT);
        out = {v1::OP_STATE_DONE, ""};
        KVLOG(Warn, "backup ready signal timed out",
              {{"op_id", op_id}, {"ready_timeout_ms", ready_timeout_ms}});
      } else {
        out = Unfinished(device, cause, op_id, "backup failed", statuses);
      }
    }
    session->ReleaseBlocks(blocks);
    session->OpFinished();
    return out;
  }
};

// An op whose device blocks are reserved: its record and the request's objects in request order.
struct StartedOp {
  std::unique_ptr<OpRecord> record;
  ObjectPlan plan;
};

// Starts an op of `kind` over `sequences`: reserves the session's device blocks (and `slot`, if
// any) and an in-flight count atomically, then names the record (id, owner, submission time,
// every page SKIPPED until planned). On error nothing is reserved. On success the caller must
// end the submission (Session::EndSubmission).
template <typename Sequences>
absl::StatusOr<StartedOp> StartOp(Session& session, const Sequences& sequences,
                                                  v1::OpKind kind, std::optional<uint32_t> slot,
                                                  absl::string_view slot_field, OpTable& ops,
                                                  uint32_t max_inflight) {
  const SessionInfo& info = session.info();
  auto record = std::make_unique<OpRecord>();
  record->seq_begin = SequenceStarts(sequences);
  const uint32_t n = record->seq_begin.back();
  ObjectPlan plan = PlanObjects(sequences, n, info);
  if (absl::Status s = session.Reserve(
          plan.busy, [&](size_t i) { return plan.Field(record->seq_begin, i); }, slot, slot_field,
          max_inflight);
      !s.ok()) {
    return s;
  }
  record->id = ops.NextId();
  record->kind = kind;
  record->instance_id = info.instance_id;
  record->session_id = info.id;
  record->submitted = absl::Now();
  record->statuses.assign(n, v1::PAGE_STATUS_SKIPPED);
  return StartedOp{std::move(record), std::move(plan)};
}

}  // namespace

DeviceMover::DeviceMover(const DeviceSet* devices, L2Space* l2, PinTable* pins, OpTable* ops,
                         SimSignalPump* pump, CacheMetrics* metrics, const CacheLimits* limits,
                         L3Writer* writer)
    : devices_(devices),
      l2_(l2),
      pins_(pins),
      ops_(ops),
      pump_(pump),
      metrics_(metrics),
      limits_(limits),
      writer_(writer) {}

absl::StatusOr<std::shared_ptr<OpRecord>> DeviceMover::Load(const std::shared_ptr<Session>& session,
                                                            const v1::LoadRequest& request) {
  const SessionInfo& info = session->info();
  Namespace& ns = *info.ns;
  core::RadixIndex* index = ns.index();  // Set: the worker's registration fixed the geometry.
  ns.counters().Touch();
  std::optional<uint32_t> slot;
  if (request.signal_layers()) slot = request.completion_slot();
  absl::StatusOr<StartedOp> started =
      StartOp(*session, request.sequences(), v1::OP_KIND_LOAD, slot, "completion_slot", *ops_,
              limits_->max_inflight_ops);
  if (!started.ok()) return started.status();
  std::unique_ptr<OpRecord> record = std::move(started->record);
  const ObjectPlan plan = std::move(started->plan);
  const uint32_t n = record->seq_begin.back();
  const absl::Time now = record->submitted;

  std::vector<core::PageKey> keys;
  keys.reserve(n);
  for (const v1::LoadSequence& seq : request.sequences()) {
    ns.AppendIndexKeys(seq.page_keys(), &keys);
  }
  std::vector<core::SlotRef> slots(plan.size());  // Each object's committed slot.
  std::vector<gpu::CopyItem> items;
  items.reserve(plan.size());
  std::vector<uint32_t> used_blocks;
  std::vector<uint32_t> unused_blocks;
  used_blocks.reserve(plan.size());
  core::MatchOptions match;
  match.shards = ns.group_shards();
  match.pin = core::PinLease{record->id, now + kOwnPinLease};
  bool pinned = false;
  core::HostPool* pool = l2_->pool();

  for (size_t s = 0; s + 1 < record->seq_begin.size(); ++s) {
    const uint32_t begin = record->seq_begin[s];
    const uint32_t len = record->seq_begin[s + 1] - begin;
    if (len == 0) continue;
    absl::Span<const core::PageKey> seq_keys(keys.data() + begin, len);
    // Pages [0, hit) of the sequence are copied; page `missing` (when < len) is why no more are.
    uint32_t hit = 0;
    uint32_t missing = len;
    core::ShardMask missing_shards = match.shards;
    if (!plan.hybrid) {
      // The group-consistent L2 prefix, pinned under the op's own owner in the same lock: from
      // here until the op is finalized no eviction can take these slots.
      absl::StatusOr<core::MatchResult> m = index->Match(seq_keys, match);
      if (m.ok()) {
        hit = m->l2_pages;
        pinned = pinned || m->pinned_pages > 0;
      }
      if (hit > 0) {
        index->GetL2Slots(seq_keys.first(hit), info.shard,
                          absl::MakeSpan(slots).subspan(begin, hit));
        for (uint32_t i = 0; i < hit; ++i) {
          if (!slots[begin + i].valid()) hit = i;  // Unreachable: the group includes this shard.
        }
      }
      missing = hit;
    } else {
      // Every object the engine names, or nothing: a hybrid's blocks are allocated for one
      // boundary, and a part of them is no state the engine can resume from. Pinned first, so
      // that nothing found below can be evicted before the copy.
      pinned = index->Pin(record->id, seq_keys, now + kOwnPinLease) > 0 || pinned;
      std::vector<core::SlotRef> group_slots(len);
      for (uint32_t g = 0; g < info.group_kinds.size(); ++g) {
        index->GetL2Slots(seq_keys, ns.GroupShard(g, info.shard), absl::MakeSpan(group_slots));
        for (uint32_t k = plan.page_begin[begin]; k < plan.page_begin[begin + len]; ++k) {
          if (plan.group[k] != g) continue;
          slots[k] = group_slots[plan.page[k] - begin];
          const uint32_t i = plan.page[k] - begin;
          if (!slots[k].valid() && i < missing) {
            missing = i;
            missing_shards = core::ShardMask{1} << ns.GroupShard(g, info.shard);
          }
        }
      }
      hit = missing == len ? len : 0;
    }
    for (uint32_t i = 0; i < len; ++i) {
      const uint32_t p = begin + i;
      for (uint32_t k = plan.page_begin[p]; k < plan.page_begin[p + 1]; ++k) {
        if (i < hit) {
          items.push_back({plan.block[k], pool->Address(slots[k]), plan.group[k]});
          used_blocks.push_back(plan.busy[k]);
        } else {
          unused_blocks.push_back(plan.busy[k]);
        }
      }
      if (i < hit) {
        record->statuses[p] = v1::PAGE_STATUS_PENDING;
      } else if (i == missing) {
        record->statuses[p] = NotLoadable(*index, keys[p], missing_shards);
      }
    }
  }
  session->ReleaseBlocks(unused_blocks);

  std::vector<uint64_t> release_pins;
  for (const v1::LoadSequence& seq : request.sequences()) {
    if (seq.pin_id() != 0 && seq.release_pin() &&
        std::find(release_pins.begin(), release_pins.end(), seq.pin_id()) == release_pins.end()) {
      release_pins.push_back(seq.pin_id());
    }
  }

  const auto copy_start = std::chrono::steady_clock::now();
  if (!items.empty()) {
    // CUDA signals layers on the device: the engine's load events, recorded on the copy stream
    // after each layer (the SIM pump below does it from the host for SIM engines).
    gpu::OpSignal device_signal;
    if (slot.has_value() && info.device_kind == v1::DEVICE_KIND_CUDA) {
      device_signal = gpu::OpSignal{*slot, record->id};
    }
    absl::StatusOr<gpu::OpHandle> op =
        DeviceOf(*devices_, info)->SubmitScatter(*session->mapping(), items, device_signal);
    if (!op.ok()) {
      if (pinned) index->ReleaseOwner(record->id);
      session->ReleaseBlocks(used_blocks);
      if (slot.has_value()) session->ReleaseSlot(*slot);
      session->EndSubmission(/*op_started=*/false);
      return SubmitRefused("Load", info, op.status());
    }
    record->device = *std::move(op);
  }
  // Every accepted Load with signal_layers signals every layer exactly once: as they land, and
  // the rest (all of them when nothing was copied) when the op is terminal.
  const bool signal = slot.has_value() && info.sim_signals != nullptr;
  if (signal) pump_->WatchLoad(record->id, record->device, info.sim_signals, *slot);

  auto completion = std::make_unique<LoadCompletion>();
  completion->session = session;
  completion->op_id = record->id;
  completion->pinned = pinned;
  completion->blocks = std::move(used_blocks);
  completion->slot = slot;
  completion->release_pins = std::move(release_pins);
  completion->pins = pins_;
  completion->pump = signal ? pump_ : nullptr;
  completion->metrics = metrics_;
  completion->bytes = MovedBytes(ns, items);
  completion->submitted = copy_start;
  record->completion = std::move(completion);
  std::shared_ptr<OpRecord> added = ops_->Add(std::move(record));
  session->EndSubmission(/*op_started=*/true);
  return added;
}

// A Backup's pages from planning to submission: the keys and parents of the request, the slots
// allocated for the objects to store, and what is copied.
struct DeviceMover::BackupBatch {
  BackupBatch(const std::shared_ptr<Session>& s, std::unique_ptr<OpRecord> r, ObjectPlan p)
      : session(s),
        info(s->info()),
        ns(*info.ns),
        index(ns.index()),
        record(std::move(r)),
        plan(std::move(p)),
        n(record->seq_begin.back()),
        now(record->submitted) {}

  // The index shard of object k: its group's object of this rank.
  uint16_t Shard(size_t k) const { return ns.GroupShard(plan.group[k], info.shard); }

  const std::shared_ptr<Session>& session;
  const SessionInfo& info;
  Namespace& ns;
  core::RadixIndex* const index;
  std::unique_ptr<OpRecord> record;
  const ObjectPlan plan;  // The objects named, in request order.
  const uint32_t n;       // Pages in the request.
  const absl::Time now;

  std::vector<core::PageKey> keys;                       // Index key of each page.
  std::vector<std::optional<core::PageKey>> parents;     // Each sequence's parent.
  std::vector<core::SlotRef> present;                    // Committed slot of each object, if any.
  std::vector<core::WriteRequest> requests;              // One per object that gets a slot.
  std::vector<int32_t> object_request;                   // Object -> index in requests, or -1.
  bool protected_pages = false;  // Whether eviction protection is pinned under the op id.

  std::vector<core::ObjectId> objects;  // Being copied, in flight in the index.
  std::vector<core::SlotRef> object_slots;  // The slot of each.
  std::vector<uint32_t> object_page;        // The page of each.
  std::vector<gpu::CopyItem> items;     // The copies: device block -> L2 slot.
  uint64_t moved_bytes = 0;             // Of `items`, counted before they go to the device.
  std::vector<uint32_t> used_blocks;
  std::vector<uint32_t> unused_blocks;
  uint32_t ready_timeout_ms = 0;
};

absl::StatusOr<std::shared_ptr<OpRecord>> DeviceMover::Backup(
    const std::shared_ptr<Session>& session, const v1::BackupRequest& request) {
  session->info().ns->counters().Touch();
  absl::StatusOr<StartedOp> started =
      StartOp(*session, request.sequences(), v1::OP_KIND_BACKUP, std::nullopt, "", *ops_,
              limits_->max_inflight_ops);
  if (!started.ok()) return started.status();
  BackupBatch batch(session, std::move(started->record), std::move(started->plan));
  BackupKeys(batch, request);
  FindPresent(batch);
  AllocateSlots(batch);
  // In flight, invisible to Match until Commit. Requests run in order, so a chain of new pages
  // (and a sequence whose parent is earlier in this request) is accepted in one call.
  std::vector<absl::Status> begun(batch.requests.size());
  if (!batch.requests.empty()) batch.index->BeginWrite(batch.requests, absl::MakeSpan(begun));
  SettlePages(batch, begun);
  if (limits_->label_pages) LabelPages(batch, request);

  const auto copy_start = std::chrono::steady_clock::now();
  if (absl::Status submitted = SubmitBackupCopy(batch, request); !submitted.ok()) {
    return submitted;
  }
  auto completion = std::make_unique<BackupCompletion>();
  completion->session = session;
  completion->op_id = batch.record->id;
  completion->objects = std::move(batch.objects);
  completion->slots = std::move(batch.object_slots);
  completion->object_page = std::move(batch.object_page);
  completion->blocks = std::move(batch.used_blocks);
  completion->ready_timeout_ms = batch.ready_timeout_ms;
  completion->l2 = l2_;
  completion->writer = writer_;
  completion->write_policy = request.write_policy();
  completion->metrics = metrics_;
  completion->bytes = batch.moved_bytes;
  completion->submitted = copy_start;
  batch.record->completion = std::move(completion);
  std::shared_ptr<OpRecord> added = ops_->Add(std::move(batch.record));
  session->EndSubmission(/*op_started=*/true);
  return added;
}

void DeviceMover::BackupKeys(BackupBatch& batch, const v1::BackupRequest& request) {
  batch.keys.reserve(batch.n);
  batch.parents.reserve(request.sequences_size());
  for (const v1::BackupSequence& seq : request.sequences()) {
    batch.ns.AppendIndexKeys(seq.page_keys(), &batch.keys);
    batch.parents.push_back(
        seq.parent_key().empty()
            ? std::nullopt
            : std::optional<core::PageKey>(batch.ns.IndexKey(seq.parent_key().data())));
  }
}

void DeviceMover::LabelPages(BackupBatch& batch, const v1::BackupRequest& request) {
  // Before the copies are submitted: a page's first L2 event (at its commit) already has them.
  const bool opaque = batch.ns.spec().opaque_keys;
  const uint32_t page_size = batch.ns.spec().page_size;
  std::vector<std::shared_ptr<const core::PageLabel>> labels(batch.n);
  bool any = false;
  uint32_t p = 0;
  for (const v1::BackupSequence& seq : request.sequences()) {
    const uint32_t pages = static_cast<uint32_t>(seq.page_keys().size() / core::kPageKeyBytes);
    const bool tokens = seq.token_ids_size() > 0;
    for (uint32_t i = 0; i < pages && (tokens || opaque); ++i, ++p) {
      auto label = std::make_shared<core::PageLabel>();
      if (tokens) {
        const auto* first = seq.token_ids().data() + size_t{i} * page_size;
        label->tokens.assign(first, first + page_size);
      }
      if (opaque) {
        core::PageKey engine_key;
        std::memcpy(engine_key.bytes.data(),
                    seq.page_keys().data() + size_t{i} * core::kPageKeyBytes, core::kPageKeyBytes);
        label->engine_hash = core::IntBlockHash(engine_key);
        label->has_engine_hash = true;
      }
      labels[p] = std::move(label);
      any = true;
    }
    if (!tokens && !opaque) p += pages;
  }
  if (!any) return;
  std::vector<bool> attached;
  if (batch.index->Label(batch.keys, labels, limits_->max_token_bytes, &attached) > 0 &&
      label_log_ != nullptr) {
    label_log_->Append(batch.ns.digest(), batch.keys, labels, attached);
  }
}

void DeviceMover::FindPresent(BackupBatch& batch) {
  // Dedup: objects already committed are not copied again.
  const ObjectPlan& plan = batch.plan;
  batch.present.resize(plan.size());
  const std::vector<uint32_t>& seq_begin = batch.record->seq_begin;
  const uint32_t groups = std::max<uint32_t>(1, batch.info.group_kinds.size());
  std::vector<core::SlotRef> slots;
  for (size_t s = 0; s + 1 < seq_begin.size(); ++s) {
    const uint32_t begin = seq_begin[s];
    const uint32_t len = seq_begin[s + 1] - begin;
    if (len == 0) continue;
    slots.assign(len, core::SlotRef());
    for (uint32_t g = 0; g < groups; ++g) {
      batch.index->GetL2Slots(absl::MakeConstSpan(batch.keys).subspan(begin, len),
                              batch.ns.GroupShard(g, batch.info.shard), absl::MakeSpan(slots));
      for (uint32_t k = plan.page_begin[begin]; k < plan.page_begin[begin + len]; ++k) {
        if (plan.group[k] == g) batch.present[k] = slots[plan.page[k] - begin];
      }
    }
  }
}

void DeviceMover::AllocateSlots(BackupBatch& batch) {
  // Slots, object by object in sequence order; a sequence stops at its first object without one.
  Namespace& ns = batch.ns;
  const ObjectPlan& plan = batch.plan;
  const std::vector<core::PageKey>& keys = batch.keys;
  const std::vector<uint32_t>& seq_begin = batch.record->seq_begin;
  uint64_t wanted = 0;
  for (const core::SlotRef& p : batch.present) wanted += p.valid() ? 0 : 1;
  batch.requests.reserve(wanted);
  batch.object_request.assign(plan.size(), -1);
  for (size_t s = 0; s + 1 < seq_begin.size(); ++s) {
    const uint32_t begin = seq_begin[s];
    const uint32_t end = seq_begin[s + 1];
    bool failed = false;
    for (uint32_t p = begin; p < end && !failed; ++p) {
      bool all_present = true;
      for (uint32_t k = plan.page_begin[p]; k < plan.page_begin[p + 1]; ++k) {
        if (batch.present[k].valid()) continue;
        all_present = false;
        const uint16_t shard = batch.Shard(k);
        absl::StatusOr<core::SlotRef> slot = l2_->TryAllocate(ns, keys[p], shard);
        if (!slot.ok() && slot.status().code() == absl::StatusCode::kResourceExhausted) {
          if (!batch.protected_pages) {
            // Eviction must not take what this batch builds on: the pages found present and the
            // parents. Pinned under the op id until the submission ends.
            batch.protected_pages = true;
            std::vector<core::PageKey> keep(keys);
            for (const auto& parent : batch.parents) {
              if (parent.has_value()) keep.push_back(*parent);
            }
            batch.index->Pin(batch.record->id, keep, batch.now + kOwnPinLease);
          }
          slot = l2_->Allocate(ns, keys[p], shard, wanted * ns.slot_bytes());
        }
        if (!slot.ok()) {
          // SettlePages gives back what the page's other objects took.
          batch.record->statuses[p] = v1::PAGE_STATUS_NO_SPACE;
          failed = true;
          break;
        }
        wanted = wanted > 0 ? wanted - 1 : 0;
        batch.object_request[k] = static_cast<int32_t>(batch.requests.size());
        core::WriteRequest w;
        w.key = keys[p];
        w.parent = p == begin ? batch.parents[s] : std::optional<core::PageKey>(keys[p - 1]);
        w.shard = shard;
        w.slot = *slot;
        w.kind = core::WriteKind::kBackup;
        batch.requests.push_back(w);
      }
      if (all_present) batch.record->statuses[p] = v1::PAGE_STATUS_ALREADY_PRESENT;
    }
  }
}

void DeviceMover::SettlePages(BackupBatch& batch, absl::Span<const absl::Status> begun) {
  const ObjectPlan& plan = batch.plan;
  const std::vector<core::PageKey>& keys = batch.keys;
  const std::vector<uint32_t>& seq_begin = batch.record->seq_begin;
  core::HostPool* pool = l2_->pool();
  std::vector<core::ObjectId> to_abort;
  batch.objects.reserve(batch.requests.size());
  batch.object_slots.reserve(batch.requests.size());
  batch.object_page.reserve(batch.requests.size());
  batch.items.reserve(batch.requests.size());
  batch.used_blocks.reserve(batch.requests.size());
  // Gives back what object k holds: its write (begun) or its slot (not begun), and its block.
  auto undo = [&](uint32_t k) {
    const int32_t r = batch.object_request[k];
    if (r >= 0) {
      if (begun[r].ok()) {
        to_abort.push_back({keys[plan.page[k]], batch.Shard(k)});
      } else {
        l2_->Free(batch.requests[r].slot);
      }
    }
    batch.unused_blocks.push_back(plan.busy[k]);
  };
  for (size_t s = 0; s + 1 < seq_begin.size(); ++s) {
    bool failed = false;
    for (uint32_t p = seq_begin[s]; p < seq_begin[s + 1]; ++p) {
      uint8_t& status = batch.record->statuses[p];
      const uint32_t first = plan.page_begin[p];
      const uint32_t last = plan.page_begin[p + 1];
      if (failed) {
        // After a page that could not be stored: nothing may be, or the chain would have a hole.
        for (uint32_t k = first; k < last; ++k) undo(k);
        status = v1::PAGE_STATUS_SKIPPED;
        continue;
      }
      // The page's outcome over its objects: the first failure fails all of it.
      uint8_t failure = status == v1::PAGE_STATUS_NO_SPACE ? status : 0;
      bool pending = false;
      bool in_flight = false;
      for (uint32_t k = first; k < last && failure == 0; ++k) {
        const int32_t r = batch.object_request[k];
        if (r < 0) continue;
        if (begun[r].ok()) {
          pending = true;
          continue;
        }
        bool refused = false;
        const uint8_t why = RefusedWriteStatus(batch, k, begun[r], &refused);
        if (refused) failure = why;
        in_flight = in_flight || why == v1::PAGE_STATUS_IN_FLIGHT;
      }
      if (failure != 0) {
        for (uint32_t k = first; k < last; ++k) undo(k);
        status = failure;
        failed = true;
        continue;
      }
      for (uint32_t k = first; k < last; ++k) {
        const int32_t r = batch.object_request[k];
        if (r >= 0 && begun[r].ok()) {
          batch.objects.push_back({keys[p], batch.Shard(k)});
          batch.object_slots.push_back(batch.requests[r].slot);
          batch.object_page.push_back(p);
          l2_->JournalWriting(batch.ns, batch.requests[r]);
          batch.items.push_back(
              {plan.block[k], pool->Address(batch.requests[r].slot), plan.group[k]});
          batch.used_blocks.push_back(plan.busy[k]);
        } else {
          undo(k);  // Present already, or written by another op: not copied.
        }
      }
      status = pending     ? v1::PAGE_STATUS_PENDING
               : in_flight ? v1::PAGE_STATUS_IN_FLIGHT
                           : v1::PAGE_STATUS_ALREADY_PRESENT;
    }
  }
  if (!to_abort.empty()) {
    std::vector<core::ReleasedObject> released;
    batch.index->Abort(to_abort, &released);
    l2_->FreeReleased(released);
  }
  if (batch.protected_pages) batch.index->ReleaseOwner(batch.record->id);
  batch.session->ReleaseBlocks(batch.unused_blocks);
}

uint8_t DeviceMover::RefusedWriteStatus(BackupBatch& batch, uint32_t k, const absl::Status& begun,
                                        bool* failed) {
  switch (begun.code()) {
    case absl::StatusCode::kAlreadyExists: {
      // Committed since the dedup check, or being written by another op (or by this one, for
      // a page two sequences of the batch share).
      core::SlotRef committed;
      batch.index->GetL2Slots(absl::MakeConstSpan(&batch.keys[batch.plan.page[k]], 1),
                              batch.Shard(k), absl::MakeSpan(&committed, 1));
      return committed.valid() ? v1::PAGE_STATUS_ALREADY_PRESENT : v1::PAGE_STATUS_IN_FLIGHT;
    }
    case absl::StatusCode::kFailedPrecondition:
      *failed = true;
      return v1::PAGE_STATUS_PARENT_MISSING;
    default:
      KVLOG(Error, "backup begin write failed",
            {{"op_id", batch.record->id}, {"error", begun.ToString()}});
      *failed = true;
      return v1::PAGE_STATUS_INTERNAL_ERROR;
  }
}

absl::Status DeviceMover::SubmitBackupCopy(BackupBatch& batch, const v1::BackupRequest& request) {
  if (batch.items.empty()) return absl::OkStatus();
  batch.moved_bytes = MovedBytes(batch.ns, batch.items);
  const SessionInfo& info = batch.info;
  OpRecord& record = *batch.record;
  absl::StatusOr<gpu::OpHandle> op;
  gpu::EngineMapping* mapping = batch.session->mapping();
  if (request.has_ready() && info.device_kind == v1::DEVICE_KIND_SIM) {
    // Submitted by the pump once the engine's ready word reaches the token; the mapping
    // outlives the gated op (a closing session cancels it before closing the mapping).
    batch.ready_timeout_ms =
        request.ready_timeout_ms() == 0
            ? limits_->max_prefetch_timeout_ms
            : std::min(request.ready_timeout_ms(), limits_->max_prefetch_timeout_ms);
    record.ready_deadline = batch.now + absl::Milliseconds(batch.ready_timeout_ms);
    gpu::DeviceBackend* device = DeviceOf(*devices_, info);
    op = pump_->GatedGather(
        [device, mapping, items = std::move(batch.items)]() {
          return device->SubmitGather(*mapping, items, gpu::ReadyFence::Ready(), gpu::OpSignal{});
        },
        info.sim_signals, request.ready().slot(), request.ready().sim_token(), info.num_layers);
  } else {
    const gpu::ReadyFence fence =
        request.has_ready()
            ? gpu::ReadyFence::CudaIpcEvent(info.cuda_ready_events[request.ready().slot()])
            : gpu::ReadyFence::Ready();
    op = DeviceOf(*devices_, info)->SubmitGather(*mapping, batch.items, fence, gpu::OpSignal{});
  }
  if (!op.ok()) {
    std::vector<core::ReleasedObject> released;
    batch.index->Abort(batch.objects, &released);
    l2_->FreeReleased(released);
    batch.session->ReleaseBlocks(batch.used_blocks);
    batch.session->EndSubmission(/*op_started=*/false);
    return SubmitRefused("Backup", info, op.status());
  }
  record.device = *std::move(op);
  return absl::OkStatus();
}

}  // namespace kvcellar::server
