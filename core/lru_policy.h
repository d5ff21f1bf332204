// LruPolicy: least-recently-used eviction over an intrusive list.
//
// A hit moves the page to the head; the victim is the evictable page nearest the tail. The
// radix index touches a matched prefix deepest page first, so a parent always ends up more recent
// than the children it was reached through and chains leave leaf-first without parking.
//
// Threads: called only under the owning RadixIndex's mutex (see eviction_policy.h).
#ifndef KVCELLAR_CORE_LRU_POLICY_H_
#define KVCELLAR_CORE_LRU_POLICY_H_

#include <cstddef>
#include <cstdint>

#include "core/eviction_policy.h"

namespace kvcellar::core {

class LruPolicy final : public EvictionPolicy {
 public:
  LruPolicy() = default;
  LruPolicy(const LruPolicy&) = delete;
  LruPolicy& operator=(const LruPolicy&) = delete;

  absl::string_view Name() const override { return "lru"; }
  void OnInsert(EvictionHook* hook, uint64_t fingerprint) override;
  void OnAccess(EvictionHook* hook) override;
  void OnEligible(EvictionHook* hook) override;
  void OnRemove(EvictionHook* hook) override;
  EvictionHook* PickVictim(const EvictionCandidates& candidates) override;

  size_t Tracked() const override { return list_.size() + parked_; }
  bool Parked(const EvictionHook& hook) const override { return hook.queue == kParked; }
  size_t MemoryBytes() const override { return 0; }
  absl::Status CheckConsistency() const override;

 private:
  // EvictionHook::queue values.
  static constexpr uint8_t kList = 1;
  static constexpr uint8_t kParked = 2;
  // EvictionHook::flags bit: hit while parked, so it returns at the head rather than the tail.
  static constexpr uint8_t kTouched = 1;

  HookList list_;
  size_t parked_ = 0;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_LRU_POLICY_H_
