#include "server/session/op_table.h"

#include <algorithm>
#include <array>
#include <utility>

#include "absl/time/clock.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// The completion thread waits on one DeviceOp at a time; this bounds how late it notices a
// different op finishing first (a DeviceOp has no completion callback to wait on collectively).
// 1 ms: below a scheduler step (tens of ms), and ~1000 wakeups/s at most while ops are pending.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(1);
// How long the thread backs off when another thread is finalizing the op it would wait on.
constexpr absl::Duration kClaimedBackoff = absl::Microseconds(100);

bool Terminal(v1::OpState s) { return s != v1::OP_STATE_PENDING; }

}  // namespace

OpTable::OpTable(CacheMetrics* metrics, absl::Duration retention)
    : metrics_(metrics),
      retention_(retention),
      next_id_(static_cast<uint64_t>(std::max<int64_t>(1, absl::ToUnixMicros(absl::Now())))) {
  thread_ = std::thread([this] { Run(); });
}

OpTable::~OpTable() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  FinishAllWaiters();
}

std::shared_ptr<OpRecord> OpTable::Add(std::unique_ptr<OpRecord> op) {
  std::shared_ptr<OpRecord> shared(std::move(op));
  {
    absl::MutexLock lock(&mu_);
    ops_.emplace(shared->id, shared);
    pending_.push_back(shared);
    wake_ = true;
  }
  TryFinalize(*shared);
  return shared;
}

bool OpTable::TryFinalize(OpRecord& op) {
  // op.device is read-only after Add: polling it needs no lock.
  if (op.device != nullptr && !op.device->Poll()) {
    absl::MutexLock lock(&mu_);
    return Terminal(op.state);
  }
  OpCancelCause cause;
  std::vector<uint8_t> statuses;
  {
    absl::MutexLock lock(&mu_);
    if (Terminal(op.state)) return true;
    if (op.claimed) return false;
    op.claimed = true;
    cause = op.cancel;
    statuses = op.statuses;
  }
  const absl::Status device = op.device != nullptr ? op.device->status() : absl::OkStatus();
  OpOutcome outcome = op.completion->Complete(device, cause, absl::MakeSpan(statuses));

  std::array<uint64_t, v1::PageStatus_ARRAYSIZE> counts{};
  for (uint8_t s : statuses) {
    if (s < counts.size()) ++counts[s];
  }
  metrics_->CountOp(op.kind, outcome.state);
  for (size_t s = 0; s < counts.size(); ++s) {
    metrics_->CountPages(op.kind, static_cast<v1::PageStatus>(s), counts[s]);
  }

  std::unique_ptr<OpCompletion> completion;
  std::vector<OpWaiter*> done;
  std::vector<Drained> drained;
  {
    absl::MutexLock lock(&mu_);
    op.statuses.swap(statuses);
    op.state = outcome.state;
    op.error = std::move(outcome.error);
    op.finished = absl::Now();
    completion = std::move(op.completion);
    auto it = std::find_if(pending_.begin(), pending_.end(),
                           [&op](const std::shared_ptr<OpRecord>& p) { return p.get() == &op; });
    if (it != pending_.end()) pending_.erase(it);
    finished_.emplace_back(op.finished, op.id);
    CollectWaitersLocked(absl::InfinitePast(), &done, &drained);
  }
  Notify(&done, &drained);
  return true;
}

void OpTable::Fill(const OpRecord& op, bool omit_page_status, bool submission,
                   v1::OpResult* out) const {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  FillLocked(op, omit_page_status, submission, now, out);
}

void OpTable::FillLocked(const OpRecord& op, bool omit_page_status, bool submission, absl::Time now,
                         v1::OpResult* out) const {
  out->set_op_id(op.id);
  out->set_kind(op.kind);
  out->set_state(op.state);
  const absl::Time end = Terminal(op.state) ? op.finished : now;
  out->set_elapsed_us(
      static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Microseconds(end - op.submitted))));
  if (!op.error.empty()) out->set_error_message(op.error);
  const bool pending_counts = submission && op.kind == v1::OP_KIND_LOAD;
  for (size_t s = 0; s + 1 < op.seq_begin.size(); ++s) {
    v1::SequenceResult* r = out->add_sequences();
    const uint32_t begin = op.seq_begin[s];
    const uint32_t end_page = op.seq_begin[s + 1];
    uint32_t leading = 0;
    for (uint32_t i = begin; i < end_page; ++i) {
      const uint8_t st = op.statuses[i];
      if (st == v1::PAGE_STATUS_OK || st == v1::PAGE_STATUS_ALREADY_PRESENT ||
          (pending_counts && st == v1::PAGE_STATUS_PENDING)) {
        ++leading;
      } else {
        break;
      }
    }
    r->set_leading_ok_pages(leading);
    if (!omit_page_status) {
      auto* statuses = r->mutable_page_status();
      statuses->Reserve(static_cast<int>(end_page - begin));
      for (uint32_t i = begin; i < end_page; ++i) statuses->Add(op.statuses[i]);
    }
  }
}

bool OpTable::SatisfiedLocked(const OpWaiter& waiter) const {
  size_t done = 0;
  for (uint64_t id : waiter.ids) {
    auto it = ops_.find(id);
    // Unknown ids (never issued, expired, another instance's) count as terminal: they will
    // never change.
    if (it == ops_.end() || it->second->instance_id != waiter.instance_id ||
        Terminal(it->second->state)) {
      ++done;
      if (waiter.any) return true;
    }
  }
  return done == waiter.ids.size();
}

void OpTable::FillResponseLocked(OpWaiter& waiter, bool timed_out) const {
  const absl::Time now = absl::Now();
  v1::WaitOpsResponse* response = waiter.response;
  response->clear_ops();
  for (uint64_t id : waiter.ids) {
    v1::OpResult* out = response->add_ops();
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second->instance_id != waiter.instance_id) {
      out->set_op_id(id);
      out->set_state(v1::OP_STATE_UNKNOWN);
      continue;
    }
    FillLocked(*it->second, waiter.omit_page_status, /*submission=*/false, now, out);
  }
  response->set_timed_out(timed_out);
}

bool OpTable::SessionIdleLocked(uint64_t session_id) const {
  for (const std::shared_ptr<OpRecord>& op : pending_) {
    if (op->session_id == session_id) return false;
  }
  return true;
}

void OpTable::Notify(std::vector<OpWaiter*>* done, std::vector<Drained>* drained) {
  for (OpWaiter* w : *done) w->Done();
  for (const Drained& d : *drained) d.waiter->Drained(d.idle);
  done->clear();
  drained->clear();
}

void OpTable::CollectWaitersLocked(absl::Time now, std::vector<OpWaiter*>* done,
                                   std::vector<Drained>* drained) {
  auto keep = waiters_.begin();
  for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
    OpWaiter* w = *it;
    if (SatisfiedLocked(*w)) {
      FillResponseLocked(*w, /*timed_out=*/false);
    } else if (w->deadline <= now) {
      FillResponseLocked(*w, /*timed_out=*/true);
    } else {
      *keep++ = w;
      continue;
    }
    w->registered = false;
    done->push_back(w);
  }
  waiters_.erase(keep, waiters_.end());

  auto keep_drain = drain_waiters_.begin();
  for (SessionDrainWaiter* w : drain_waiters_) {
    const bool idle = SessionIdleLocked(w->session_id);
    if (!idle && w->deadline > now) {
      *keep_drain++ = w;
      continue;
    }
    w->registered = false;
    drained->push_back({w, idle});
  }
  drain_waiters_.erase(keep_drain, drain_waiters_.end());
}

bool OpTable::Wait(OpWaiter* waiter) {
  absl::MutexLock lock(&mu_);
  if (SatisfiedLocked(*waiter)) {
    FillResponseLocked(*waiter, /*timed_out=*/false);
    return true;
  }
  if (waiter->deadline <= absl::Now() || stop_) {
    FillResponseLocked(*waiter, /*timed_out=*/true);
    return true;
  }
  waiter->registered = true;
  waiters_.push_back(waiter);
  wake_ = true;  // The completion thread recomputes its next deadline.
  return false;
}

bool OpTable::RemoveWaiter(OpWaiter* waiter) {
  absl::MutexLock lock(&mu_);
  if (!waiter->registered) return false;
  waiter->registered = false;
  waiters_.erase(std::find(waiters_.begin(), waiters_.end(), waiter));
  return true;
}

void OpTable::FinishAllWaiters() {
  std::vector<OpWaiter*> done;
  std::vector<Drained> drained;
  {
    absl::MutexLock lock(&mu_);
    for (OpWaiter* w : waiters_) {
      FillResponseLocked(*w, /*timed_out=*/true);
      w->registered = false;
      done.push_back(w);
    }
    waiters_.clear();
    for (SessionDrainWaiter* w : drain_waiters_) {
      w->registered = false;
      drained.push_back({w, SessionIdleLocked(w->session_id)});
    }
    drain_waiters_.clear();
  }
  Notify(&done, &drained);
}

v1::ReleaseOutcome OpTable::Cancel(uint64_t id, const std::string& instance_id) {
  std::shared_ptr<OpRecord> op;
  {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second->instance_id != instance_id) {
      return v1::RELEASE_OUTCOME_UNKNOWN;
    }
    if (Terminal(it->second->state)) return v1::RELEASE_OUTCOME_ALREADY_DONE;
    // Load and Backup copies touch engine blocks the moment they are issued: they run to the end
    // (docs/api.md: wait for them instead). A prefetch touches only daemon memory.
    if (it->second->kind != v1::OP_KIND_PREFETCH) return v1::RELEASE_OUTCOME_NOT_CANCELLABLE;
    op = it->second;
    if (op->cancel == OpCancelCause::kNone) op->cancel = OpCancelCause::kReleased;
    wake_ = true;
  }
  if (op->device != nullptr) op->device->Cancel();
  TryFinalize(*op);
  absl::MutexLock lock(&mu_);
  return op->state == v1::OP_STATE_CANCELLED ? v1::RELEASE_OUTCOME_CANCELLED
                                             : v1::RELEASE_OUTCOME_ALREADY_DONE;
}

void OpTable::WatchDrain(SessionDrainWaiter* waiter) {
  bool idle;
  {
    absl::MutexLock lock(&mu_);
    idle = SessionIdleLocked(waiter->session_id);
    if (!idle && waiter->deadline > absl::Now() && !stop_) {
      waiter->registered = true;
      drain_waiters_.push_back(waiter);
      wake_ = true;  // The completion thread recomputes its next deadline.
      return;
    }
  }
  waiter->Drained(idle);
}

bool OpTable::RemoveDrainWaiter(SessionDrainWaiter* waiter) {
  absl::MutexLock lock(&mu_);
  if (!waiter->registered) return false;
  waiter->registered = false;
  drain_waiters_.erase(std::find(drain_waiters_.begin(), drain_waiters_.end(), waiter));
  return true;
}

bool OpTable::SessionIdle(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  return SessionIdleLocked(session_id);
}

std::vector<std::shared_ptr<OpRecord>> OpTable::CancelSessionOps(uint64_t session_id) {
  std::vector<std::shared_ptr<OpRecord>> ops;
  {
    absl::MutexLock lock(&mu_);
    for (const std::shared_ptr<OpRecord>& op : pending_) {
      if (op->session_id != session_id) continue;
      if (op->cancel == OpCancelCause::kNone) op->cancel = OpCancelCause::kSessionEnded;
      ops.push_back(op);
    }
  }
  for (const std::shared_ptr<OpRecord>& op : ops) {
    if (op->device != nullptr) op->device->Cancel();
  }
  return ops;
}

size_t OpTable::Prune(absl::Time now) {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  while (!finished_.empty() && finished_.front().first + retention_ <= now) {
    ops_.erase(finished_.front().second);
    finished_.pop_front();
    ++n;
  }
  return n;
}

size_t OpTable::unfinished() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}

void OpTable::Run() {
  std::vector<std::shared_ptr<OpRecord>> pending;
  std::vector<OpWaiter*> done;
  std::vector<Drained> drained;
  for (;;) {
    absl::Time next = absl::InfiniteFuture();
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      wake_ = false;
      pending = pending_;
      for (const OpWaiter* w : waiters_) next = std::min(next, w->deadline);
      for (const SessionDrainWaiter* w : drain_waiters_) next = std::min(next, w->deadline);
    }
    absl::Time now = absl::Now();
    if (next <= now) {
      {
        absl::MutexLock lock(&mu_);
        CollectWaitersLocked(now, &done, &drained);
      }
      Notify(&done, &drained);
      continue;
    }

    bool progressed = false;
    std::shared_ptr<OpRecord> wait_on;
    for (const std::shared_ptr<OpRecord>& op : pending) {
      if (TryFinalize(*op)) {
        progressed = true;
        continue;
      }
      if (op->ready_deadline <= now) {
        bool cancel = false;
        {
          absl::MutexLock lock(&mu_);
          if (op->cancel == OpCancelCause::kNone) {
            op->cancel = OpCancelCause::kReadyTimeout;
            cancel = true;
          }
        }
        if (cancel && op->device != nullptr) {
          op->device->Cancel();
          progressed = true;
        }
      } else {
        next = std::min(next, op->ready_deadline);
      }
      // Prefer an op that is copying (no ready fence to wait for): it is the likeliest to finish.
      const bool fenced = op->ready_deadline != absl::InfiniteFuture();
      if (wait_on == nullptr || (!fenced && wait_on->ready_deadline != absl::InfiniteFuture())) {
        wait_on = op;
      }
    }
    pending.clear();
    if (progressed) continue;

    if (wait_on != nullptr && wait_on->device != nullptr && !wait_on->device->Poll()) {
      wait_on->device->Wait(std::min(kWaitSlice, std::max(absl::ZeroDuration(), next - now)));
      continue;
    }
    absl::MutexLock lock(&mu_);
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || stop_; };
    if (wait_on != nullptr) {
      // Claimed by another thread (a session closing): let it publish.
      mu_.AwaitWithTimeout(absl::Condition(&woken), kClaimedBackoff);
    } else {
      mu_.AwaitWithDeadline(absl::Condition(&woken), next);
    }
  }
}

}  // namespace kvcellar::server
