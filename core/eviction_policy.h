// EvictionPolicy: the order in which the radix index gives up the L2 copies of pages.
//
// The unit is a page, not an object: all L2 shards of a page leave together, because a page with
// one shard missing is useless to a tensor-parallel group (DESIGN.md "Page keys").
//
// Per-page policy state is intrusive: each index node embeds an EvictionHook, so tracking a page
// allocates nothing and every operation is O(1).
//
// Eligibility and parking. Not every tracked page may go: a pinned page, a page with a shard in
// flight, and a page with a child holding L2 must stay (eviction is leaf-first, so L2 stays
// prefix-closed). Requeueing such a page each time it reaches the tail makes eviction quadratic on
// chains: a chain of n pages inserted in order presents its n-1 ancestors before its leaf, for
// every one of its n evictions. A policy therefore *parks* an ineligible candidate: the page leaves
// its queue until the index calls OnEligible(). The index calls OnEligible exactly when a page's
// last obstacle goes away (last pin dropped, last in-flight shard committed or aborted, last L2
// child gone), so each park is paid for by one such event, and PickVictim is O(1) amortized per
// victim. A parked page returns to the tail of its queue (it was the eviction candidate when it
// was parked), or, for LRU, to the head when it was accessed while parked.
//
// Threads: a policy belongs to one RadixIndex and is called only under that index's mutex. It is
// not thread-safe and takes no lock of its own.
#ifndef KVCELLAR_CORE_EVICTION_POLICY_H_
#define KVCELLAR_CORE_EVICTION_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcellar::core {

// Intrusive per-page state, embedded in each index node. Fields other than the links are
// policy-defined; `queue == 0` always means "not tracked" (the page holds no committed L2 shard).
struct EvictionHook {
  EvictionHook* prev = nullptr;  // Towards the head (most recently inserted).
  EvictionHook* next = nullptr;  // Towards the tail (next eviction candidate).
  uint8_t queue = 0;
  uint8_t freq = 0;
  uint8_t flags = 0;
};

// A doubly-linked list of hooks: head is the newest entry, tail the next candidate.
class HookList {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  EvictionHook* head() const { return head_; }
  EvictionHook* tail() const { return tail_; }

  void PushHead(EvictionHook* h) {
    h->prev = nullptr;
    h->next = head_;
    if (head_ != nullptr) head_->prev = h;
    head_ = h;
    if (tail_ == nullptr) tail_ = h;
    ++size_;
  }
  void PushTail(EvictionHook* h) {
    h->next = nullptr;
    h->prev = tail_;
    if (tail_ != nullptr) tail_->next = h;
    tail_ = h;
    if (head_ == nullptr) head_ = h;
    ++size_;
  }
  void Remove(EvictionHook* h) {
    (h->prev != nullptr ? h->prev->next : head_) = h->next;
    (h->next != nullptr ? h->next->prev : tail_) = h->prev;
    h->prev = h->next = nullptr;
    --size_;
  }
  // Walks the list and checks links and size; every hook must carry `queue`. O(n), for tests.
  absl::Status Check(uint8_t queue, absl::string_view name) const {
    size_t n = 0;
    const EvictionHook* prev = nullptr;
    for (const EvictionHook* h = head_; h != nullptr; prev = h, h = h->next) {
      if (h->prev != prev) return absl::InternalError(absl::StrCat(name, ": broken prev link"));
      if (h->queue != queue)
        return absl::InternalError(absl::StrCat(name, ": hook in wrong queue"));
      if (++n > size_) return absl::InternalError(absl::StrCat(name, ": longer than its size"));
    }
    if (prev != tail_) return absl::InternalError(absl::StrCat(name, ": tail mismatch"));
    if (n != size_) return absl::InternalError(absl::StrCat(name, ": shorter than its size"));
    return absl::OkStatus();
  }

 private:
  EvictionHook* head_ = nullptr;
  EvictionHook* tail_ = nullptr;
  size_t size_ = 0;
};

// The index's answers about its pages, given to PickVictim.
class EvictionCandidates {
 public:
  // True when the page may leave L2 now: unpinned, nothing in flight, no child holding L2.
  virtual bool Evictable(const EvictionHook& hook) const = 0;
  // A stable 64-bit identity of the page (for ghost entries that outlive the node).
  virtual uint64_t Fingerprint(const EvictionHook& hook) const = 0;

 protected:
  ~EvictionCandidates() = default;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  virtual absl::string_view Name() const = 0;

  // The page now holds committed L2 data and starts being tracked; `hook->queue` is 0.
  virtual void OnInsert(EvictionHook* hook, uint64_t fingerprint) = 0;
  // The page was hit (a Match counted it in the L2 prefix). Called on queued and parked pages.
  virtual void OnAccess(EvictionHook* hook) = 0;
  // The page just became evictable. Unparks it if it was parked; otherwise a no-op.
  virtual void OnEligible(EvictionHook* hook) = 0;
  // The page leaves L2 other than through PickVictim (admin removal). Stops tracking it.
  virtual void OnRemove(EvictionHook* hook) = 0;
  // Chooses the next victim among evictable pages, stops tracking it and returns it; parks the
  // ineligible candidates it meets. Returns nullptr when no tracked page is evictable.
  virtual EvictionHook* PickVictim(const EvictionCandidates& candidates) = 0;

  // Pages tracked, queued or parked.
  virtual size_t Tracked() const = 0;
  virtual bool Parked(const EvictionHook& hook) const = 0;
  // Heap memory held outside the hooks (for example ghost entries).
  virtual size_t MemoryBytes() const = 0;
  // Checks the queues' links and counts. O(n), for tests and debugging.
  virtual absl::Status CheckConsistency() const = 0;
};

enum class EvictionPolicyKind { kLru, kS3Fifo, kAdaptive };

inline absl::string_view EvictionPolicyKindName(EvictionPolicyKind kind) {
  switch (kind) {
    case EvictionPolicyKind::kLru:
      return "lru";
    case EvictionPolicyKind::kS3Fifo:
      return "s3fifo";
    case EvictionPolicyKind::kAdaptive:
      return "adaptive";
  }
  return "s3fifo";
}

inline absl::StatusOr<EvictionPolicyKind> ParseEvictionPolicyKind(absl::string_view name) {
  for (EvictionPolicyKind kind :
       {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo, EvictionPolicyKind::kAdaptive}) {
    if (name == EvictionPolicyKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("eviction policy: unknown name '", name, "' (want lru, s3fifo or adaptive)"));
}

// A new policy of `kind` (lru_policy.h, s3fifo_policy.h, adaptive_policy.h).
std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_EVICTION_POLICY_H_
