// TenantLedger: per tenant, the L2 pool bytes it holds, its quota, and what happened to its pages.
//
// Quotas (tenants.quotas, server/config/tenant_quota.h) are per tenant, and a tenant spans
// namespaces (one per model it serves), so the bytes are kept per tenant here rather than summed
// from the namespaces' indexes when an allocation needs them. The unit is bytes of slot capacity:
// what the pool spends, not the object bytes inside the slots.
//
// Accounting invariant (kept by server/l2/l2_space.cc): an account's used_bytes is the slot bytes
// of every pool slot whose owner record names it (core::SlotOwner::tenant), from the allocation
// that charged it to the Free that discharges it, including slots in flight (being written) and
// slots an L3 write-back still holds after an eviction. TryCharge refuses to pass the ceiling, so
// used_bytes <= ceiling_bytes at every moment, except after a warm restart that recovered more
// than a ceiling allows (then the tenant allocates nothing until it is back under).
//
// Accounts: one per tenant that has a quota (made at construction) or a namespace (made when the
// namespace is). At most kMaxAccounts; tenants past that share one overflow account, named
// kOverflowTenant, with no quota. Accounts live as long as the ledger and are never removed, so a
// TenantAccount* may be kept, and account numbers (from 1; 0 = none) are dense and stable: they
// are what slot owner records store, and what per-tenant metric series are ordered by.
//
// Threads: any thread. ForTenant takes the ledger's mutex (namespace creation, rare); everything
// on the data path (TryCharge, Discharge, ByNumber, the counters) is lock-free: relaxed atomics,
// each counter exact on its own.
#ifndef KVCELLAR_SERVER_SESSION_TENANT_LEDGER_H_
#define KVCELLAR_SERVER_SESSION_TENANT_LEDGER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/config/tenant_quota.h"

namespace kvcellar::server {

// Why L2 let go of a tenant's pages (kvcellar_tenant_l2_evictions_total{cause}).
enum class TenantEvictCause : uint8_t {
  kOwn = 0,            // Its own allocation needed room (pool full, or at its ceiling).
  kOtherTenant = 1,    // Another tenant's allocation took it (only above this one's guarantee).
  kWatermark = 2,      // The housekeeper's watermark eviction.
  kRegionRelease = 3,  // A region moved to another size class.
  kAdmin = 4,          // AdminService.Evict.
};
inline constexpr int kTenantEvictCauses = 5;
const char* TenantEvictCauseName(TenantEvictCause cause);

class TenantAccount {
 public:
  static constexpr uint64_t kNoCeiling = std::numeric_limits<uint64_t>::max();

  TenantAccount(std::string tenant, uint16_t number, uint64_t guarantee_bytes,
                uint64_t ceiling_bytes, bool has_quota)
      : tenant_(std::move(tenant)),
        number_(number),
        guarantee_bytes_(guarantee_bytes),
        ceiling_bytes_(ceiling_bytes),
        has_quota_(has_quota) {}
  TenantAccount(const TenantAccount&) = delete;
  TenantAccount& operator=(const TenantAccount&) = delete;

  const std::string& tenant() const { return tenant_; }
  uint16_t number() const { return number_; }
  uint64_t guarantee_bytes() const { return guarantee_bytes_; }
  uint64_t ceiling_bytes() const { return ceiling_bytes_; }
  bool has_quota() const { return has_quota_; }

  uint64_t used_bytes() const { return used_bytes_.load(std::memory_order_relaxed); }
  // Bytes it holds above its guarantee: what another tenant's allocation may take from it.
  uint64_t excess_bytes() const {
    const uint64_t used = used_bytes();
    return used > guarantee_bytes_ ? used - guarantee_bytes_ : 0;
  }
  // Adds `bytes` unless that passes the ceiling (then false, nothing changes).
  bool TryCharge(uint64_t bytes) {
    uint64_t used = used_bytes_.load(std::memory_order_relaxed);
    do {
      if (bytes > ceiling_bytes_ || used > ceiling_bytes_ - bytes) return false;
    } while (!used_bytes_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  // Warm restart: recovered slots are charged whatever the ceiling.
  void Charge(uint64_t bytes) { used_bytes_.fetch_add(bytes, std::memory_order_relaxed); }
  void Discharge(uint64_t bytes) { used_bytes_.fetch_sub(bytes, std::memory_order_relaxed); }

  // Allocations refused because the tenant was at its ceiling and evicting its own freed too
  // little (each a NO_SPACE page: a miss for the engine).
  void CountCeilingRefusal() { ceiling_refusals_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t ceiling_refusals() const { return ceiling_refusals_.load(std::memory_order_relaxed); }
  void CountEviction(TenantEvictCause cause, uint64_t pages) {
    evicted_pages_[static_cast<int>(cause)].fetch_add(pages, std::memory_order_relaxed);
  }
  uint64_t evicted_pages(TenantEvictCause cause) const {
    return evicted_pages_[static_cast<int>(cause)].load(std::memory_order_relaxed);
  }

 private:
  const std::string tenant_;
  const uint16_t number_;
  const uint64_t guarantee_bytes_;
  const uint64_t ceiling_bytes_;
  const bool has_quota_;
  std::atomic<uint64_t> used_bytes_{0};
  std::atomic<uint64_t> ceiling_refusals_{0};
  std::array<std::atomic<uint64_t>, kTenantEvictCauses> evicted_pages_{};
};


class TenantLedger {
 public:
  // Accounts at most; see above. Slot owner records hold the number in 16 bits.
  static constexpr uint16_t kMaxAccounts = 1024;
  static constexpr absl::string_view kOverflowTenant = "(other)";

  // One account per quota, numbered in the order given. Every quota must fit kMaxAccounts.
  explicit TenantLedger(const std::vector<TenantQuotaBytes>& quotas = {});
  TenantLedger(const TenantLedger&) = delete;
  TenantLedger& operator=(const TenantLedger&) = delete;

  // The account of `tenant`, made on first use (no quota). Never nullptr.
  TenantAccount* ForTenant(absl::string_view tenant) ABSL_LOCKS_EXCLUDED(mu_);
  // The account numbered `number`, or nullptr (0, or not made yet). Lock-free.
  TenantAccount* ByNumber(uint16_t number) const {
    return number == 0 || number > kMaxAccounts
               ? nullptr
               : accounts_[number - 1].load(std::memory_order_acquire);
  }
  // Every account, in number order.
  std::vector<TenantAccount*> Snapshot() const;
  // Whether any tenant has a quota: without one, eviction is what it was before quotas.
  bool has_quotas() const { return has_quotas_; }

 private:
  TenantAccount* MakeLocked(std::string tenant, uint64_t guarantee, uint64_t ceiling,
                            bool has_quota) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool has_quotas_ = false;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TenantAccount*> by_tenant_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<TenantAccount>> owned_ ABSL_GUARDED_BY(mu_);
  TenantAccount* overflow_ ABSL_GUARDED_BY(mu_) = nullptr;
  // accounts_[n - 1]: account n; published after it is made, never changed after.
  std::unique_ptr<std::atomic<TenantAccount*>[]> accounts_;
  std::atomic<uint16_t> count_{0};
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_TENANT_LEDGER_H_
