#include "server/config/tenant_quota.h"

#include <cmath>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/config/config.h"

namespace kvcellar::server {
namespace {

// Tenants are at most this long (NamespaceSpec.tenant, docs/api.md; as tenant_grant.cc).
constexpr size_t kMaxTenantBytes = 1024;
// Errors quote at most this much of a bad entry, so they stay readable.
constexpr size_t kMaxQuotedBytes = 80;

std::string Clip(absl::string_view s) {
  return s.size() > kMaxQuotedBytes ? absl::StrCat(s.substr(0, kMaxQuotedBytes), "...")
                                    : std::string(s);
}

// One amount; returns "" or why it is wrong.
std::string ParseAmount(absl::string_view name, absl::string_view text, QuotaAmount* out) {
  const std::string bad =
      absl::StrCat(name, " '", Clip(text), "' is not a fraction (0.5, 50%) or a size (4GiB)");
  if (text.empty()) return absl::StrCat(name, " is empty");
  const bool percent = absl::ConsumeSuffix(&text, "%");
  if (percent || absl::StrContains(text, '.')) {
    double v = 0;
    if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) return bad;
    if (percent) v /= 100;
    if (v < 0 || v > 1) {
      return absl::StrCat(name, " '", Clip(text), percent ? "%" : "",
                          "' is outside [0, 1] of the pool");
    }
    *out = QuotaAmount{true, v, 0};
    return "";
  }
  std::optional<uint64_t> bytes = ParseSizeValue(text);
  if (!bytes.has_value()) return bad;
  *out = QuotaAmount{false, 0, *bytes};
  return "";
}

// One entry; returns "" or why it is wrong.
std::string ParseQuota(absl::string_view text, TenantQuotaSpec* quota) {
  const size_t eq = text.find('=');
  if (eq == absl::string_view::npos) {
    return "expected TENANT=guarantee:AMOUNT,ceiling:AMOUNT (either part may be left out)";
  }
  absl::string_view tenant = text.substr(0, eq);
  if (tenant.size() > kMaxTenantBytes) {
    return absl::StrCat("the tenant is longer than ", kMaxTenantBytes, " bytes");
  }
  for (char c : tenant) {
    if (absl::ascii_iscntrl(c)) return "the tenant holds a control character";
  }
  quota->tenant = std::string(tenant);
  bool seen_guarantee = false;
  bool seen_ceiling = false;
  for (absl::string_view part : absl::StrSplit(text.substr(eq + 1), ',')) {
    part = absl::StripAsciiWhitespace(part);
    const size_t colon = part.find(':');
    if (colon == absl::string_view::npos) {
      return absl::StrCat("'", Clip(part), "' is not guarantee:AMOUNT or ceiling:AMOUNT");
    }
    absl::string_view key = absl::StripAsciiWhitespace(part.substr(0, colon));
    absl::string_view value = absl::StripAsciiWhitespace(part.substr(colon + 1));
    bool* seen = key == "guarantee" ? &seen_guarantee : key == "ceiling" ? &seen_ceiling : nullptr;
    if (seen == nullptr) {
      return absl::StrCat("'", Clip(key), "' is not guarantee or ceiling");
    }
    if (*seen) return absl::StrCat(key, " is given twice");
    *seen = true;
    std::string why =
        ParseAmount(key, value, key == "guarantee" ? &quota->guarantee : &quota->ceiling);
    if (!why.empty()) return why;
  }
  if (!seen_guarantee && !seen_ceiling) return "gives neither a guarantee nor a ceiling";
  return "";
}

std::string Describe(const QuotaAmount& a, uint64_t bytes) {
  if (a.is_fraction) return absl::StrCat(a.fraction, " of the pool = ", bytes, " bytes");
  return absl::StrCat(bytes, " bytes");
}

}  // namespace

uint64_t QuotaAmount::Resolve(uint64_t pool_bytes) const {
  if (!is_fraction) return bytes;
  if (fraction >= 1) return pool_bytes;
  return static_cast<uint64_t>(std::floor(fraction * static_cast<double>(pool_bytes)));
}

absl::StatusOr<std::vector<TenantQuotaSpec>> ParseTenantQuotas(absl::string_view text) {
  std::vector<TenantQuotaSpec> quotas;
  absl::flat_hash_set<std::string> tenants;
  int position = 0;
  for (absl::string_view entry : absl::StrSplit(text, ';')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) continue;
    ++position;
    TenantQuotaSpec quota;
    std::string why = ParseQuota(entry, &quota);
    if (why.empty() && !tenants.insert(quota.tenant).second) {
      why = absl::StrCat("tenant '", Clip(quota.tenant), "' has a quota already");
    }
    if (!why.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("quota ", position, " '", Clip(entry), "': ", why));
    }
    quotas.push_back(std::move(quota));
  }
  return quotas;
}

absl::StatusOr<std::vector<TenantQuotaBytes>> ResolveTenantQuotas(
    const std::vector<TenantQuotaSpec>& specs, uint64_t pool_bytes) {
  std::vector<TenantQuotaBytes> out;
  uint64_t guaranteed = 0;
  for (const TenantQuotaSpec& s : specs) {
    TenantQuotaBytes q{s.tenant, s.guarantee.Resolve(pool_bytes), s.ceiling.Resolve(pool_bytes)};
    const std::string who = absl::StrCat("'tenants.quotas' tenant '", Clip(s.tenant), "': ");
    if (q.guarantee_bytes > pool_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, "guarantee (", Describe(s.guarantee, q.guarantee_bytes),
                       ") exceeds 'pool.capacity' (", pool_bytes, " bytes)"));
    }
    if (q.ceiling_bytes > pool_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, "ceiling (", Describe(s.ceiling, q.ceiling_bytes),
                       ") exceeds 'pool.capacity' (", pool_bytes, " bytes)"));
    }
    if (q.ceiling_bytes < q.guarantee_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "ceiling (", Describe(s.ceiling, q.ceiling_bytes), ") is below its guarantee (",
          Describe(s.guarantee, q.guarantee_bytes), ")"));
    }
    guaranteed += q.guarantee_bytes;
    out.push_back(std::move(q));
  }
  if (guaranteed > pool_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'tenants.quotas': the guarantees sum to ", guaranteed, " bytes, above 'pool.capacity' (",
        pool_bytes, " bytes); they may sum to at most 1.0 of the pool"));
  }
  return out;
}

}  // namespace kvcellar::server
