#include "server/config/tenant_grant.h"

#include <grp.h>
#include <pwd.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcellar::server {
namespace {

// Tenants are at most this long (NamespaceSpec.tenant, docs/api.md).
constexpr size_t kMaxTenantBytes = 1024;
// Grants quote at most this much of a bad entry, so an error stays readable.
constexpr size_t kMaxQuotedBytes = 80;

// A user or group: a number, or a name looked up in the system's databases.
enum class IdKind { kUser, kGroup };

std::string ResolveId(IdKind kind, absl::string_view value, uint32_t* out) {
  if (value.empty()) return kind == IdKind::kUser ? "uid is empty" : "gid is empty";
  if (absl::ascii_isdigit(value[0])) {
    if (!absl::SimpleAtoi(value, out)) return absl::StrCat("'", value, "' is not a valid id");
    return "";
  }
  const std::string name(value);
  std::vector<char> buf(16384);
  if (kind == IdKind::kUser) {
    passwd pw{};
    passwd* found = nullptr;
    if (::getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
      return absl::StrCat("no user '", name, "'");
    }
    *out = found->pw_uid;
  } else {
    group gr{};
    group* found = nullptr;
    if (::getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
      return absl::StrCat("no group '", name, "'");
    }
    *out = found->gr_gid;
  }
  return "";
}

// One grant; returns "" or why it is wrong.
std::string ParseGrant(absl::string_view text, TenantGrant* grant) {
  const size_t eq = text.find('=');
  if (eq == absl::string_view::npos) {
    return "expected TENANT=uid:USER, TENANT=gid:GROUP or TENANT=subject:SUBJECT";
  }
  absl::string_view tenant = text.substr(0, eq);
  absl::string_view identity = text.substr(eq + 1);
  if (tenant.size() > kMaxTenantBytes) {
    return absl::StrCat("the tenant is longer than ", kMaxTenantBytes, " bytes");
  }
  for (char c : tenant) {
    if (absl::ascii_iscntrl(c)) return "the tenant holds a control character";
  }
  grant->tenant = std::string(tenant);
  const size_t colon = identity.find(':');
  absl::string_view kind = identity.substr(0, colon);
  absl::string_view value = colon == absl::string_view::npos ? "" : identity.substr(colon + 1);
  if (colon == absl::string_view::npos) {
    return absl::StrCat("identity '", identity.substr(0, kMaxQuotedBytes),
                        "' is not uid:USER, gid:GROUP or subject:SUBJECT");
  }
  if (kind == "uid") {
    grant->kind = TenantGrant::Kind::kUid;
    return ResolveId(IdKind::kUser, value, &grant->id);
  }
  if (kind == "gid") {
    grant->kind = TenantGrant::Kind::kGid;
    return ResolveId(IdKind::kGroup, value, &grant->id);
  }
  if (kind == "subject") {
    if (value.empty()) return "subject is empty";
    grant->kind = TenantGrant::Kind::kSubject;
    grant->subject = std::string(value);
    return "";
  }
  return absl::StrCat("identity kind '", kind.substr(0, kMaxQuotedBytes),
                      "' is not uid, gid or subject");
}

}  // namespace

absl::StatusOr<std::vector<TenantGrant>> ParseTenantGrants(absl::string_view text) {
  std::vector<TenantGrant> grants;
  int position = 0;
  for (absl::string_view entry : absl::StrSplit(text, ';')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) continue;
    ++position;
    TenantGrant grant;
    if (std::string why = ParseGrant(entry, &grant); !why.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("grant ", position, " '", entry.substr(0, kMaxQuotedBytes),
                       entry.size() > kMaxQuotedBytes ? "...'" : "'", ": ", why));
    }
    grants.push_back(std::move(grant));
  }
  return grants;
}

}  // namespace kvcellar::server
