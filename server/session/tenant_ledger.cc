#include "server/session/tenant_ledger.h"

#include <utility>

#include "server/config/tenant_quota.h"

namespace kvcellar::server {

const char* TenantEvictCauseName(TenantEvictCause cause) {
  switch (cause) {
    case TenantEvictCause::kOwn:
      return "own";
    case TenantEvictCause::kOtherTenant:
      return "other_tenant";
    case TenantEvictCause::kWatermark:
      return "watermark";
    case TenantEvictCause::kRegionRelease:
      return "region_release";
    case TenantEvictCause::kAdmin:
      return "admin";
  }
  return "unknown";
}

TenantLedger::TenantLedger(const std::vector<TenantQuotaBytes>& quotas)
    : accounts_(std::make_unique<std::atomic<TenantAccount*>[]>(kMaxAccounts)) {
  absl::MutexLock lock(&mu_);
  for (const TenantQuotaBytes& q : quotas) {
    if (count_.load(std::memory_order_relaxed) + 1 >= kMaxAccounts) break;
    MakeLocked(q.tenant, q.guarantee_bytes, q.ceiling_bytes, /*has_quota=*/true);
    has_quotas_ = true;
  }
}

TenantAccount* TenantLedger::MakeLocked(std::string tenant, uint64_t guarantee, uint64_t ceiling,
                                        bool has_quota) {
  const uint16_t number = count_.load(std::memory_order_relaxed) + 1;
  owned_.push_back(std::make_unique<TenantAccount>(tenant, number, guarantee, ceiling, has_quota));
  TenantAccount* account = owned_.back().get();
  by_tenant_.emplace(std::move(tenant), account);
  accounts_[number - 1].store(account, std::memory_order_release);
  count_.store(number, std::memory_order_release);
  return account;
}

TenantAccount* TenantLedger::ForTenant(absl::string_view tenant) {
  absl::MutexLock lock(&mu_);
  if (auto it = by_tenant_.find(tenant); it != by_tenant_.end()) return it->second;
  // The last number is kept for the overflow account.
  if (count_.load(std::memory_order_relaxed) + 1 < kMaxAccounts) {
    return MakeLocked(std::string(tenant), 0, TenantAccount::kNoCeiling, /*has_quota=*/false);
  }
  if (overflow_ == nullptr) {
    overflow_ = MakeLocked(std::string(kOverflowTenant), 0, TenantAccount::kNoCeiling, false);
  }
  return overflow_;
}

std::vector<TenantAccount*> TenantLedger::Snapshot() const {
  std::vector<TenantAccount*> out;
  const uint16_t n = count_.load(std::memory_order_acquire);
  out.reserve(n);
  for (uint16_t i = 1; i <= n; ++i) out.push_back(ByNumber(i));
  return out;
}

}  // namespace kvcellar::server
