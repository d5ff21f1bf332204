#include "server/session/session_registry.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/quote.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {

// ---- Session ----------------------------------------------------------------------------------

Session::Session(SessionInfo info, std::unique_ptr<gpu::EngineMapping> mapping,
                 absl::Time lease_deadline)
    : info_(std::move(info)), mapping_(std::move(mapping)), lease_deadline_(lease_deadline) {}

Session::~Session() = default;

absl::Time Session::lease_deadline() const {
  absl::MutexLock lock(&mu_);
  return lease_deadline_;
}

void Session::Renew(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  lease_deadline_ = std::max(lease_deadline_, deadline);
}

absl::Status Session::Reserve(absl::Span<const uint32_t> blocks,
                              absl::FunctionRef<std::string(size_t)> block_field,
                              std::optional<uint32_t> slot, absl::string_view slot_field,
                              uint32_t max_inflight) {
  absl::MutexLock lock(&mu_);
  if (closed_) return SessionUnknown(info_.id);
  if (inflight_ops_ >= max_inflight) {
    return CacheError(absl::StatusCode::kResourceExhausted, v1::ERROR_REASON_TOO_MANY_OPS, "",
                      absl::StrCat("session ", info_.id, " has ", inflight_ops_,
                                   " unfinished ops, the limit (max_inflight_ops); wait for some "
                                   "with WaitOps"));
  }
  if (slot.has_value() && busy_slots_.contains(*slot)) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_SLOT_BUSY, slot_field,
                      absl::StrCat(slot_field, " (", *slot,
                                   ") is still used by an unfinished Load of this session"));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (busy_blocks_.contains(blocks[i])) {
      std::string field = block_field(i);
      return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_BLOCK_BUSY, field,
                        absl::StrCat(field, " (", blocks[i],
                                     ") is still used by an unfinished op of this session; wait "
                                     "for it (WaitOps) before reusing the block"));
    }
  }
  busy_blocks_.reserve(busy_blocks_.size() + blocks.size());
  for (uint32_t b : blocks) busy_blocks_.insert(b);
  if (slot.has_value()) busy_slots_.insert(*slot);
  ++inflight_ops_;
  ++submitting_;
  return absl::OkStatus();
}

void Session::ReleaseBlocks(absl::Span<const uint32_t> blocks) {
  absl::MutexLock lock(&mu_);
  for (uint32_t b : blocks) busy_blocks_.erase(b);
}

void Session::ReleaseSlot(uint32_t slot) {
  absl::MutexLock lock(&mu_);
  busy_slots_.erase(slot);
}

void Session::EndSubmission(bool op_started) {
  absl::MutexLock lock(&mu_);
  --submitting_;
  if (!op_started) --inflight_ops_;
}

void Session::OpFinished() {
  absl::MutexLock lock(&mu_);
  if (inflight_ops_ > 0) --inflight_ops_;
}

std::unique_ptr<gpu::EngineMapping> Session::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return submitting_ == 0; };
  mu_.Await(absl::Condition(&idle));
  return std::move(mapping_);
}

bool Session::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

uint32_t Session::inflight_ops() const {
  absl::MutexLock lock(&mu_);
  return inflight_ops_;
}

size_t Session::busy_blocks() const {
  absl::MutexLock lock(&mu_);
  return busy_blocks_.size();
}

// ---- SessionRegistry ----------------------------------------------------------------------------

uint64_t SessionRegistry::NewSessionId() {
  absl::BitGen gen;
  absl::MutexLock lock(&mu_);
  for (;;) {
    const uint64_t id = absl::Uniform<uint64_t>(gen);
    if (id != 0 && !by_id_.contains(id)) return id;
  }
}

std::shared_ptr<Session> SessionRegistry::Holder(const Instance& instance,
                                                 const SessionInfo& info) {
  for (const std::shared_ptr<Session>& s : instance.sessions) {
    const SessionInfo& o = s->info();
    if (o.is_worker() != info.is_worker()) continue;
    if (!info.is_worker() || o.rank == info.rank) return s;
  }
  return nullptr;
}

absl::Status SessionRegistry::CheckAddLocked(const SessionInfo& info, bool replace_existing) const {
  auto it = instances_.find(info.instance_id);
  if (it == instances_.end()) return absl::OkStatus();
  const Instance& instance = it->second;
  // An instance is one engine, run by one principal: another user cannot join it as a rank,
  // replace one of its seats (replace_existing), or learn its namespace from a GROUP_MISMATCH,
  // whatever instance ids it read from ListEngines.
  for (const std::shared_ptr<Session>& s : instance.sessions) {
    if (s->lease_deadline() <= absl::Now() || s->info().owner.SamePrincipal(info.owner)) continue;
    return CacheError(
        absl::StatusCode::kPermissionDenied, v1::ERROR_REASON_NOT_SESSION_OWNER, "instance_id",
        absl::StrCat("instance_id: instance ", core::Quote(info.instance_id),
                     " has live sessions of another peer identity; every session of an instance "
                     "must come from the same user (uid and gid) or certificate, and this "
                     "registration comes from ",
                     info.owner.Describe()));
  }
  if (instance.ns_digest != info.ns->digest()) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_GROUP_MISMATCH,
                      "namespace_spec",
                      absl::StrCat("namespace_spec: instance ", core::Quote(info.instance_id),
                                   " is registered with another namespace (digest ",
                                   instance.ns_digest.Hex().substr(0, 16),
                                   "...); every session "
                                   "of an instance must send the same namespace_spec"));
  }
  if (instance.tp_size != info.tp_size) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_GROUP_MISMATCH,
                      "namespace_spec.tp_size",
                      absl::StrCat("namespace_spec.tp_size (", info.tp_size, "): instance ",
                                   core::Quote(info.instance_id), " is registered with tp_size ",
                                   instance.tp_size));
  }
  // A holder whose lease has lapsed (not reaped yet) is as good as gone: it is replaced.
  std::shared_ptr<Session> holder = Holder(instance, info);
  if (!replace_existing && holder != nullptr && holder->lease_deadline() > absl::Now()) {
    // The field that collides: a worker's seat is (instance_id, rank), and its rank is what is
    // taken; an instance has one scheduler, so for a SCHEDULER it is the instance_id (its role
    // is the one a scheduler must send: naming it told the caller to change the wrong field).
    return CacheError(
        absl::StatusCode::kAlreadyExists, v1::ERROR_REASON_SESSION_EXISTS,
        info.is_worker() ? "rank" : "instance_id",
        info.is_worker()
            ? absl::StrCat("rank: instance ", core::Quote(info.instance_id), " rank ", info.rank,
                           " already has a live session; set replace_existing to replace it")
            : absl::StrCat("instance_id: instance ", core::Quote(info.instance_id),
                           " already has a live SCHEDULER session; set replace_existing to "
                           "replace it"));
  }
  return absl::OkStatus();
}

absl::Status SessionRegistry::CheckAdd(const SessionInfo& info, bool replace_existing) const {
  absl::MutexLock lock(&mu_);
  return CheckAddLocked(info, replace_existing);
}

absl::Status SessionRegistry::Add(std::shared_ptr<Session> session, bool replace_existing,
                                  std::shared_ptr<Session>* replaced) {
  const SessionInfo& info = session->info();
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckAddLocked(info, replace_existing); !s.ok()) return s;
  auto [it, inserted] = instances_.try_emplace(info.instance_id);
  Instance& instance = it->second;
  if (inserted) {
    instance.ns_digest = info.ns->digest();
    instance.tp_size = info.tp_size;
  }
  if (std::shared_ptr<Session> old = Holder(instance, info); old != nullptr) {
    *replaced = old;
    by_id_.erase(old->id());
    instance.sessions.erase(std::find(instance.sessions.begin(), instance.sessions.end(), old));
  }
  instance.sessions.push_back(session);
  by_id_[info.id] = std::move(session);
  return absl::OkStatus();
}

std::shared_ptr<Session> SessionRegistry::Find(uint64_t id, absl::Time now) const {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return nullptr;
    s = it->second;
  }
  if (s->lease_deadline() <= now) return nullptr;
  return s;
}

SessionRegistry::Removed SessionRegistry::RemoveLocked(uint64_t id) {
  Removed out;
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return out;
  out.session = std::move(it->second);
  by_id_.erase(it);
  auto inst = instances_.find(out.session->info().instance_id);
  if (inst != instances_.end()) {
    std::vector<std::shared_ptr<Session>>& v = inst->second.sessions;
    v.erase(std::remove(v.begin(), v.end(), out.session), v.end());
    if (v.empty()) {
      instances_.erase(inst);
      out.last_of_instance = true;
    }
  }
  return out;
}

SessionRegistry::Removed SessionRegistry::Remove(uint64_t id) {
  absl::MutexLock lock(&mu_);
  return RemoveLocked(id);
}

std::vector<SessionRegistry::Removed> SessionRegistry::TakeExpired(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> expired;
  for (const auto& [id, s] : by_id_) {
    if (s->lease_deadline() <= now) expired.push_back(id);
  }
  std::vector<Removed> out;
  out.reserve(expired.size());
  for (uint64_t id : expired) out.push_back(RemoveLocked(id));
  return out;
}

std::vector<SessionRegistry::Removed> SessionRegistry::TakeAll() {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : by_id_) ids.push_back(id);
  std::vector<Removed> out;
  for (uint64_t id : ids) out.push_back(RemoveLocked(id));
  return out;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(by_id_.size());
  for (const auto& [id, s] : by_id_) out.push_back(s);
  return out;
}

size_t SessionRegistry::sessions() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

size_t SessionRegistry::instances() const {
  absl::MutexLock lock(&mu_);
  return instances_.size();
}

bool SessionRegistry::HasInstance(const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  return instances_.contains(instance_id);
}

}  // namespace kvcellar::server
