// kvcellarctl tenants: per tenant, its L2 quota, what it holds, its hit rates per tier and its
// evictions by cause (GetStatusResponse.tenants; an admin caller's view). A table, or the tenants
// as JSON with --json.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/tools/ctl_common.h"

namespace kvcellar::ctl {
namespace {

std::string Rate(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  return absl::StrFormat("%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

}  // namespace

int Tenants(const Options& options, v1::AdminService::Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::GetStatusResponse reply;
  grpc::Status status = stub.GetStatus(&context, v1::GetStatusRequest(), &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  v1::GetStatusResponse only;
  for (const v1::TenantStatus& t : reply.tenants()) {
    if (!options.tenant.has_value() || *options.tenant == t.tenant()) *only.add_tenants() = t;
  }
  if (options.json) return PrintJson(only);
  if (reply.tenants().empty()) {
    // An engine-socket caller, or a daemon before any namespace and without quotas.
    std::fprintf(stderr,
                 "kvcellarctl: no tenants listed (the daemon lists them to admin callers only: "
                 "the admin socket, or a client certificate)\n");
    return 0;
  }
  Table table({"TENANT", "GUARANTEE", "CEILING", "L2_USED", "OF_GUAR", "L2_PAGES", "NS", "LOOKUPS",
               "L2_HIT", "L3_HIT", "EVICT_OWN", "EVICT_OTHER", "EVICT_WMARK", "REFUSED"});
  for (const v1::TenantStatus& t : only.tenants()) {
    table.Add({t.tenant().empty() ? "\"\"" : t.tenant(),
               t.has_quota() ? HumanBytes(t.guarantee_bytes()) : "-",
               t.has_quota() ? HumanBytes(t.ceiling_bytes()) : "-", HumanBytes(t.l2_used_bytes()),
               t.guarantee_bytes() > 0 ? Rate(t.l2_used_bytes(), t.guarantee_bytes()) : "-",
               absl::StrCat(t.l2_pages()), absl::StrCat(t.namespaces()),
               absl::StrCat(t.lookup_pages()), Rate(t.l2_hit_pages(), t.lookup_pages()),
               Rate(t.l3_hit_pages(), t.lookup_pages()), absl::StrCat(t.evicted_own_pages()),
               absl::StrCat(t.evicted_by_other_tenant_pages()),
               absl::StrCat(t.evicted_watermark_pages()), absl::StrCat(t.ceiling_refusals())});
  }
  table.Print();
  return 0;
}

}  // namespace kvcellar::ctl
