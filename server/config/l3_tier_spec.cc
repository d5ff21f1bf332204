#include "server/config/l3_tier_spec.h"

#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/config/config.h"

namespace kvcellar::server {
namespace {

constexpr size_t kMaxNameBytes = 32;

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) return false;
  for (char c : name) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '_' || c == '-')) return false;
  }
  return true;
}

std::optional<bool> ParseBool(absl::string_view v) {
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  return std::nullopt;
}

// Applies one option to `spec`; returns "" or why it is wrong (worded after "option K: ").
std::string ApplyOption(L3TierSpec& spec, absl::string_view key, absl::string_view value) {
  const bool file = spec.kind == L3TierSpec::Kind::kFile;
  auto integer = [&](int64_t min, int64_t max, int64_t* out) -> std::string {
    int64_t v = 0;
    if (!absl::SimpleAtoi(value, &v)) return absl::StrCat("'", value, "' is not an integer");
    if (v < min || v > max) return absl::StrCat(v, " is out of range [", min, ", ", max, "]");
    *out = v;
    return "";
  };
  auto boolean = [&](bool* out) -> std::string {
    std::optional<bool> b = ParseBool(value);
    if (!b) return absl::StrCat("'", value, "' is not true or false");
    *out = *b;
    return "";
  };
  int64_t n = 0;
  if (key == "name") {
    if (!ValidName(value)) {
      return absl::StrCat("'", value, "' must be 1..", kMaxNameBytes,
                          " characters of a-z, 0-9, '_' and '-'");
    }
    spec.name = std::string(value);
    return "";
  }
  if (key == "admit_after") {
    std::string why = integer(0, 1'000'000, &n);
    spec.admit_after = static_cast<uint32_t>(n);
    return why;
  }
  if (key == "timeout_ms") return integer(1, 600'000, &spec.timeout_ms);
  if (file) {
    if (key == "capacity") {
      std::optional<uint64_t> bytes = ParseSizeValue(value);
      if (!bytes) return absl::StrCat("'", value, "' is not a size (e.g. 500GiB)");
      spec.capacity_bytes = *bytes;
      return "";
    }
    if (key == "shared") return boolean(&spec.shared);
    if (key == "direct_io") return boolean(&spec.direct_io);
    if (key == "io") {
      if (value != "auto" && value != "io_uring" && value != "threads") {
        return absl::StrCat("'", value, "' is not one of auto, io_uring, threads");
      }
      spec.io = std::string(value);
      return "";
    }
    if (key == "fsync") {
      if (value != "none" && value != "data" && value != "full") {
        return absl::StrCat("'", value, "' is not one of none, data, full");
      }
      spec.fsync = std::string(value);
      return "";
    }
    if (key == "max_inflight") {
      std::string why = integer(1, 65536, &n);
      spec.max_inflight = static_cast<uint32_t>(n);
      return why;
    }
    return "is not an option of file tiers (name, admit_after, timeout_ms, capacity, shared, "
           "direct_io, io, fsync, max_inflight)";
  }
  if (key == "prefix") {
    if (value.empty()) return "must not be empty (tiers sharing a server need distinct prefixes)";
    spec.key_prefix = std::string(value);
    return "";
  }
  if (key == "ttl_s") return integer(0, int64_t{1} << 31, &spec.ttl_s);
  if (key == "index") return boolean(&spec.index);
  if (key == "watch") return boolean(&spec.watch);
  if (key == "connections") {
    std::string why = integer(1, 256, &n);
    spec.connections = static_cast<int>(n);
    return why;
  }
  return "is not an option of redis tiers (name, admit_after, timeout_ms, prefix, ttl_s, "
         "connections, index, watch)";
}

absl::StatusOr<L3TierSpec> ParseOne(absl::string_view text) {
  L3TierSpec spec;
  absl::string_view body = text;
  absl::string_view options;
  if (size_t q = body.find('?'); q != absl::string_view::npos) {
    options = body.substr(q + 1);
    body = body.substr(0, q);
  }
  const size_t colon = body.find(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError("must be KIND:LOCATION (kinds: file, redis, redis-cluster)");
  }
  const absl::string_view kind = body.substr(0, colon);
  const absl::string_view location = body.substr(colon + 1);
  if (kind == "file") {
    spec.kind = L3TierSpec::Kind::kFile;
    if (location.empty() || location[0] != '/') {
      return absl::InvalidArgumentError("a file tier's location must be an absolute directory path");
    }
    spec.path = std::string(location);
  } else if (kind == "redis" || kind == "redis-cluster") {
    spec.kind = kind == "redis" ? L3TierSpec::Kind::kRedis : L3TierSpec::Kind::kRedisCluster;
    for (absl::string_view a : absl::StrSplit(location, ',', absl::SkipEmpty())) {
      // Any "unix:" address is a socket path to the backend (storage/redis_cluster.h
      // ParseRedisAddress), so one without an absolute path is no host:port either.
      const bool unix_address = absl::StartsWith(a, "unix:");
      const size_t port_colon = a.rfind(':');
      int port = 0;
      const bool bad = unix_address ? !absl::StartsWith(a, "unix:/")
                                    : port_colon == absl::string_view::npos || port_colon == 0 ||
                                          !absl::SimpleAtoi(a.substr(port_colon + 1), &port) ||
                                          port <= 0 || port > 65535;
      if (bad) {
        return absl::InvalidArgumentError(
            absl::StrCat("address '", a, "' must be host:port or unix:/path"));
      }
      spec.addresses.emplace_back(a);
    }
    if (spec.addresses.empty()) {
      return absl::InvalidArgumentError("a redis tier needs an address (host:port or unix:/path)");
    }
    if (spec.kind == L3TierSpec::Kind::kRedis && spec.addresses.size() > 1) {
      return absl::InvalidArgumentError(
          "a redis tier takes one address; use redis-cluster: for a list of cluster seeds");
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown kind '", kind, "' (kinds: file, redis, redis-cluster)"));
  }
  for (absl::string_view kv : absl::StrSplit(options, '&', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("option '", kv, "' must be key=value"));
    }
    const absl::string_view key = kv.substr(0, eq);
    if (std::string why = ApplyOption(spec, key, kv.substr(eq + 1)); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("option ", key, ": ", why));
    }
  }
  return spec;
}

}  // namespace

absl::string_view L3TierKindName(L3TierSpec::Kind kind) {
  switch (kind) {
    case L3TierSpec::Kind::kFile: return "file";
    case L3TierSpec::Kind::kRedis: return "redis";
    case L3TierSpec::Kind::kRedisCluster: return "redis-cluster";
  }
  return "unknown";
}

absl::StatusOr<std::vector<L3TierSpec>> ParseL3TierSpecs(absl::string_view text) {
  std::vector<L3TierSpec> specs;
  std::vector<absl::string_view> parts =
      absl::StrSplit(text, absl::ByAnyChar(" \t\n;"), absl::SkipEmpty());
  if (parts.size() > kMaxL3TierSpecs) {
    return absl::InvalidArgumentError(
        absl::StrCat(parts.size(), " tiers given; at most ", kMaxL3TierSpecs, " are supported"));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<L3TierSpec> spec = ParseOne(parts[i]);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tier ", i + 1, " '", parts[i], "': ", spec.status().message()));
    }
    specs.push_back(*std::move(spec));
  }
  // Default names: the kind, numbered from the second tier of a kind on; names must be unique.
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].name.empty()) continue;
    std::string base(L3TierKindName(specs[i].kind));
    std::string name = base;
    for (int n = 2;; ++n) {
      bool taken = false;
      for (const L3TierSpec& other : specs) taken = taken || other.name == name;
      if (!taken) break;
      name = absl::StrCat(base, n);
    }
    specs[i].name = name;
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (specs[i].name == specs[j].name) {
        return absl::InvalidArgumentError(absl::StrCat("tier ", i + 1, " '", parts[i],
                                                       "': name '", specs[i].name,
                                                       "' is already used by tier ", j + 1));
      }
    }
  }
  return specs;
}

}  // namespace kvcellar::server
