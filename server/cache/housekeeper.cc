#include "server/cache/housekeeper.h"

#include <utility>

#include "absl/time/clock.h"

namespace kvcellar::server {

Housekeeper::Housekeeper(HousekeeperParts parts, absl::Duration interval)
    : parts_(std::move(parts)), interval_(interval) {
  thread_ = std::thread([this] { Loop(); });
}

Housekeeper::~Housekeeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Housekeeper::RunOnce() {
  const absl::Time now = absl::Now();
  for (SessionRegistry::Removed& r : parts_.sessions->TakeExpired(now)) {
    parts_.metrics->CountSessionLeaseExpiry();
    parts_.end_session(r, "lease expired");
  }
  const size_t expired_pins = parts_.pins->ExpireDue(now);
  if (expired_pins > 0) parts_.metrics->CountPinLeaseExpiries(expired_pins);
  // The index drops lapsed page pins itself (the records above are gone by now, and so are
  // their page pins); this also covers copy pins of an op that was never finalized.
  for (const std::shared_ptr<Namespace>& ns : parts_.namespaces->Snapshot()) {
    if (ns->index() != nullptr) ns->index()->ExpireLeases(now);
  }
  parts_.ops->Prune(now);
  parts_.matcher->Prune(now);
  parts_.l2->ReapDoomed();  // Pages an admin Clear doomed whose copies have ended.
  parts_.l2->EnforceWatermarks();
}

void Housekeeper::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_);
    if (stop_) break;
    mu_.Unlock();
    RunOnce();
    mu_.Lock();
  }
}

}  // namespace kvcellar::server
