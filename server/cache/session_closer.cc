#include "server/cache/session_closer.h"

#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace kvcellar::server {

void SessionEnd::Drained(bool /*idle*/) { closer_->Ready(this); }

SessionCloser::SessionCloser(OpTable* ops, Finish finish) : ops_(ops), finish_(std::move(finish)) {
  thread_ = std::thread([this] { Run(); });
}

SessionCloser::~SessionCloser() { Stop(); }

void SessionCloser::Close(std::unique_ptr<SessionEnd> end, absl::Time deadline) {
  SessionEnd* const raw = end.get();
  raw->closer_ = this;
  raw->session_id = raw->session->id();
  raw->deadline = deadline;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      // Stopping: the drain is cut short, as FinishAllWaiters cuts the others'.
      if (stop_) raw->deadline = absl::InfinitePast();
      closing_.emplace(raw, std::move(end));
    }
  }
  if (end != nullptr) {  // The thread has ended: finish here.
    FinishOne(std::move(end));
    return;
  }
  ops_->WatchDrain(raw);  // Drained() may run here, on this thread: it only queues.
}

void SessionCloser::Ready(SessionEnd* end) {
  absl::MutexLock lock(&mu_);
  ready_.push_back(end);
}

void SessionCloser::Stop() {
  std::vector<SessionEnd*> waiting;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    for (const auto& [raw, end] : closing_) waiting.push_back(raw);
  }
  // Drains still registered end now. One the table is already ending arrives through Ready();
  // the thread waits for it, since the table will call it.
  for (SessionEnd* raw : waiting) {
    if (ops_->RemoveDrainWaiter(raw)) Ready(raw);
  }
  thread_.join();
}

void SessionCloser::Run() {
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !ready_.empty() || (stop_ && closing_.empty());
  };
  for (;;) {
    std::unique_ptr<SessionEnd> end;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&woken));
      if (ready_.empty()) {
        stopped_ = true;
        return;
      }
      SessionEnd* const raw = ready_.front();
      ready_.pop_front();
      auto it = closing_.find(raw);
      end = std::move(it->second);
      closing_.erase(it);
    }
    FinishOne(std::move(end));
  }
}

void SessionCloser::FinishOne(std::unique_ptr<SessionEnd> end) {
  const SessionEndCounts counts = finish_(*end);
  if (end->done) end->done(counts);
}

}  // namespace kvcellar::server
