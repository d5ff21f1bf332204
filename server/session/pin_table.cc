#include "server/session/pin_table.h"

#include <utility>

namespace kvcellar::server {

void PinTable::Unpin(uint64_t id, const Pin& pin) {
  if (core::RadixIndex* index = pin.ns->index(); index != nullptr) index->ReleaseOwner(id);
}

template <typename Pred>
size_t PinTable::EndWhere(Pred pred) {
  std::vector<std::pair<uint64_t, Pin>> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = pins_.begin(); it != pins_.end();) {
      if (pred(it->second)) {
        ended.emplace_back(it->first, std::move(it->second));
        pins_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (const auto& [id, pin] : ended) Unpin(id, pin);
  return ended.size();
}

void PinTable::Add(uint64_t id, const std::string& instance_id, std::shared_ptr<Namespace> ns,
                   std::vector<core::PageKey> keys, uint32_t holds, absl::Duration lease,
                   absl::Time deadline, uint64_t session_id) {
  Pin pin;
  pin.instance_id = instance_id;
  pin.session_id = session_id;
  pin.ns = std::move(ns);
  pin.keys = std::move(keys);
  pin.held.assign(holds, true);
  pin.holds_left = holds;
  pin.lease = lease;
  pin.deadline = deadline;
  absl::MutexLock lock(&mu_);
  pins_.emplace(id, std::move(pin));
}

size_t PinTable::Revoke(
    absl::FunctionRef<bool(const Namespace& ns, absl::Span<const core::PageKey> keys)> revoke) {
  return EndWhere([&](const Pin& pin) { return revoke(*pin.ns, pin.keys); });
}

absl::flat_hash_map<uint64_t, PinTable::Usage> PinTable::UsageBySession() const {
  absl::flat_hash_map<uint64_t, Usage> usage;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, pin] : pins_) {
    Usage& u = usage[pin.session_id];
    ++u.pins;
    u.pages += pin.keys.size();
  }
  return usage;
}

bool PinTable::DropHold(uint64_t id, const std::string& instance_id, uint32_t rank) {
  Pin ended;
  {
    absl::MutexLock lock(&mu_);
    auto it = pins_.find(id);
    if (it == pins_.end() || it->second.instance_id != instance_id) return false;
    Pin& pin = it->second;
    if (rank < pin.held.size() && pin.held[rank]) {
      pin.held[rank] = false;
      --pin.holds_left;
    }
    if (pin.holds_left > 0) return false;
    ended = std::move(pin);
    pins_.erase(it);
  }
  Unpin(id, ended);
  return true;
}

bool PinTable::Extend(uint64_t id, absl::Span<const core::PageKey> keys) {
  std::shared_ptr<Namespace> ns;
  absl::Time deadline;
  {
    absl::MutexLock lock(&mu_);
    auto it = pins_.find(id);
    if (it == pins_.end()) return false;
    ns = it->second.ns;
    deadline = it->second.deadline;
    it->second.keys.insert(it->second.keys.end(), keys.begin(), keys.end());
  }
  core::RadixIndex* index = ns->index();
  if (index == nullptr) return false;
  index->Pin(id, keys, deadline);
  // The pin may have ended between the two locks (its ReleaseOwner ran before our Pin): then
  // nothing else would drop these pins before their deadline. One that ends after this check
  // drops them itself.
  bool alive;
  {
    absl::MutexLock lock(&mu_);
    alive = pins_.contains(id);
  }
  if (!alive) index->ReleaseOwner(id);
  return alive;
}

bool PinTable::Release(uint64_t id, const std::string& instance_id) {
  Pin ended;
  {
    absl::MutexLock lock(&mu_);
    auto it = pins_.find(id);
    if (it == pins_.end() || it->second.instance_id != instance_id) return false;
    ended = std::move(it->second);
    pins_.erase(it);
  }
  Unpin(id, ended);
  return true;
}

std::vector<uint64_t> PinTable::Renew(absl::Span<const uint64_t> ids,
                                      const std::string& instance_id, absl::Time now) {
  std::vector<uint64_t> unknown;
  struct Renewal {
    uint64_t id;
    std::shared_ptr<Namespace> ns;
    std::vector<core::PageKey> keys;
    absl::Time deadline;
  };
  std::vector<Renewal> renewals;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids) {
      auto it = pins_.find(id);
      if (it == pins_.end() || it->second.instance_id != instance_id ||
          it->second.deadline <= now) {
        unknown.push_back(id);
        continue;
      }
      it->second.deadline = now + it->second.lease;
      renewals.push_back({id, it->second.ns, it->second.keys, it->second.deadline});
    }
  }
  // Pinning again under the same owner keeps the later deadline in the index; the extra count
  // goes with the owner's other pins at ReleaseOwner.
  for (const Renewal& r : renewals) {
    if (core::RadixIndex* index = r.ns->index(); index != nullptr) {
      index->Pin(r.id, r.keys, r.deadline);
    }
  }
  return unknown;
}

size_t PinTable::ExpireDue(absl::Time now) {
  return EndWhere([&](const Pin& pin) { return pin.deadline <= now; });
}

size_t PinTable::ReleaseInstance(const std::string& instance_id) {
  return EndWhere([&](const Pin& pin) { return pin.instance_id == instance_id; });
}

size_t PinTable::DropRankHolds(const std::string& instance_id, uint32_t rank) {
  // Drops the rank's hold on each pin of the instance; a pin ends with its last hold.
  return EndWhere([&](Pin& pin) {
    if (pin.instance_id != instance_id || rank >= pin.held.size() || !pin.held[rank]) return false;
    pin.held[rank] = false;
    return --pin.holds_left == 0;
  });
}

size_t PinTable::size() const {
  absl::MutexLock lock(&mu_);
  return pins_.size();
}

}  // namespace kvcellar::server
