// How the schema turns YAML scalars and --set text into a typed Config, and back.
//
// Every value, from the table's defaults, the file or --set, goes through one path: text ->
// ParseAndStore() -> Config field. Canonical text comes from FormatValue(), so ConfigToYaml()
// output loads back to an equal Config and its bytes (hence the digest) depend only on the
// values, never on how they were spelled or on a YAML library's emitter.
#include "server/config/config_schema.h"

#include <fcntl.h>
#include <grp.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "platform/runtime_paths.h"
#include "server/config/l3_tier_spec.h"
#include "server/config/tenant_grant.h"
#include "server/config/tenant_quota.h"

namespace kvcellar::server {
namespace config_schema {


constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;
// The x86-64 (and 4 KiB-granule arm64) huge page: regions must be whole huge pages to be backed
// by them.
constexpr uint64_t kHugePageSize = 2 * kMiB;
// sockaddr_un::sun_path is 108 bytes on Linux, including the terminating NUL.
constexpr size_t kMaxUnixSocketPath = sizeof(sockaddr_un{}.sun_path) - 1;
// NAME_MAX: a POSIX shm name is one file name under /dev/shm.
constexpr size_t kMaxShmName = 255;

// The key's path is the member's path, spelled once: they cannot disagree.
// clang-format off
#define KVC_FIELD(section, name)                                                  \
  #section "." #name,                                                             \
  MakeField([](Config& c) -> auto& { return c.section.name; },                    \
            [](const Config& c) -> const auto& { return c.section.name; })

#define KVC_ENUM(section, name)                                                   \
  #section "." #name,                                                             \
  EnumField{[](const Config& c) { return static_cast<int>(c.section.name); },     \
            [](Config& c, int v) {                                                \
              c.section.name = static_cast<decltype(c.section.name)>(v);          \
            }}
// clang-format on

// ---- Value syntax -------------------------------------------------------------------------

struct SizeUnit {
  absl::string_view name;
  uint64_t bytes;
};
constexpr SizeUnit kSizeUnits[] = {
    {"TiB", kTiB},
    {"GiB", kGiB},
    {"MiB", kMiB},
    {"KiB", kKiB},
    {"TB", 1000000000000ULL},
    {"GB", 1000000000ULL},
    {"MB", 1000000ULL},
    {"KB", 1000ULL},
    {"B", 1},
};
extern const char kSizeSyntax[];
const char kSizeSyntax[] =
    "a size (bytes, or an integer with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)";

std::optional<uint64_t> ParseSize(absl::string_view text) { return ParseSizeValue(text); }

// The exact form with the smallest number, binary units winning ties: 4000000000 is "4GB", not
// "3906250KiB"; a byte count no unit divides stays a plain integer.
std::string FormatSize(uint64_t bytes) {
  const SizeUnit* best = nullptr;
  for (const SizeUnit& u : kSizeUnits) {
    if (bytes == 0 || u.bytes == 1 || bytes % u.bytes != 0) continue;
    if (best == nullptr || bytes / u.bytes < bytes / best->bytes) best = &u;
  }
  if (best == nullptr) return absl::StrCat(bytes);
  return absl::StrCat(bytes / best->bytes, best->name);
}

std::optional<double> ParseDouble(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

// Shortest text that reads back to the same double ("0.95", not "0.94999999999999996").
std::string FormatDouble(double value) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, end);
}

std::optional<uint32_t> ParseMode(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text.size() < 3 || text.size() > 4) return std::nullopt;
  uint32_t mode = 0;
  for (char c : text) {
    if (c < '0' || c > '7') return std::nullopt;
    mode = mode * 8 + static_cast<uint32_t>(c - '0');
  }
  return mode;
}

std::string FormatMode(uint32_t mode) { return absl::StrFormat("%04o", mode); }

// YAML double-quoted scalar; escapes keep the output one line per key and plain ASCII-safe.
std::string QuoteYaml(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20 || u == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", u);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

std::string FormatInterval(double lo, bool lo_open, double hi, bool hi_open) {
  return absl::StrCat(lo_open ? "(" : "[", FormatDouble(lo), ", ", FormatDouble(hi),
                      hi_open ? ")" : "]");
}

// ---- String checks ------------------------------------------------------------------------

std::string CheckSocketPath(absl::string_view value) {
  if (value.size() > kMaxUnixSocketPath) {
    return absl::StrCat("is ", value.size(), " bytes long; a Unix socket path holds at most ",
                        kMaxUnixSocketPath);
  }
  return "";
}

std::string CheckAdminSocket(absl::string_view value) {
  if (value == kAdminSocketNone) return "";
  return CheckSocketPath(value);
}

std::string CheckZmqEndpoint(absl::string_view value) {
  if (value.empty()) return "";
  for (absl::string_view scheme : {"tcp://", "ipc://", "inproc://"}) {
    if (absl::StartsWith(value, scheme) && value.size() > scheme.size() &&
        std::none_of(value.begin(), value.end(),
                     [](char c) { return absl::ascii_isspace(c) || absl::ascii_iscntrl(c); })) {
      return "";
    }
  }
  return absl::StrCat("must be a ZeroMQ endpoint such as tcp://*:5557, tcp://indexer:5557 or "
                      "ipc:///run/kvcellar/events, or \"\" for none; got '",
                      value, "'");
}

std::string CheckHostPort(absl::string_view value) {
  if (value.empty()) return "";
  std::string syntax = absl::StrCat(
      "must be host:port such as 127.0.0.1:9740 or [::1]:9740, or \"\" to disable; got '", value,
      "'");
  size_t colon = value.rfind(':');
  if (colon == absl::string_view::npos) return syntax;
  absl::string_view host = value.substr(0, colon);
  absl::string_view port = value.substr(colon + 1);
  if (host.empty()) return syntax;
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return syntax;
  } else if (absl::StrContains(host, ':')) {
    return syntax;  // A bare IPv6 address: which colon starts the port is ambiguous.
  }
  for (char c : host) {
    if (absl::ascii_isspace(c) || absl::ascii_iscntrl(c)) return syntax;
  }
  uint32_t port_number = 0;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return absl::StrCat("port must be an integer in [0, 65535]; got '", value, "'");
  }
  return "";
}

std::string CheckGroup(absl::string_view value) {
  if (value.empty()) return "";
  uint32_t gid = 0;
  if (std::all_of(value.begin(), value.end(), absl::ascii_isdigit)) {
    if (!absl::SimpleAtoi(value, &gid)) return absl::StrCat("is not a valid gid: '", value, "'");
    return "";
  }
  std::string name(value);
  std::vector<char> buf(16384);
  group entry;
  group* found = nullptr;
  int rc;
  while ((rc = getgrnam_r(name.c_str(), &entry, buf.data(), buf.size(), &found)) == ERANGE &&
         buf.size() < (size_t{1} << 24)) {
    buf.resize(buf.size() * 2);
  }
  if (rc != 0) {
    return absl::StrCat("names group '", value, "', which cannot be looked up: ", strerror(rc));
  }
  if (found == nullptr) return absl::StrCat("names no group known on this host: '", value, "'");
  return "";
}

std::string CheckL3Tiers(absl::string_view value) {
  absl::StatusOr<std::vector<L3TierSpec>> specs = ParseL3TierSpecs(value);
  if (specs.ok()) return "";
  return absl::StrCat("is invalid: ", specs.status().message());
}

std::string CheckTenantGrants(absl::string_view value) {
  absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(value);
  if (grants.ok()) return "";
  return absl::StrCat("is invalid: ", grants.status().message());
}

std::string CheckTenantQuotas(absl::string_view value) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> quotas = ParseTenantQuotas(value);
  if (quotas.ok()) return "";
  return absl::StrCat("is invalid: ", quotas.status().message());
}

std::string CheckShmName(absl::string_view value) {
  if (value.empty()) return "";
  absl::string_view name = absl::StripPrefix(value, "/");
  if (name.empty() || name.size() > kMaxShmName || absl::StrContains(name, '/') || name == "." ||
      name == "..") {
    return absl::StrCat(
        "must be a POSIX shared memory name like /kvcellar (one file name, at most ", kMaxShmName,
        " bytes, no '/' but a leading one), or \"\"; got '", value, "'");
  }
  return "";
}

std::string CheckLabelLog(absl::string_view value) {
  if (value.empty() || absl::EndsWith(value, "/")) {
    return absl::StrCat("must be auto, off, or a file path; got '", value, "'");
  }
  return "";
}

std::string CheckAdminMode(uint32_t mode) {
  if ((mode & 0007) != 0) {
    return absl::StrCat(
        "must grant nothing to others (whoever can connect may call admin RPCs), "
        "got '",
        FormatMode(mode), "'");
  }
  return "";
}

// ---- The schema table ---------------------------------------------------------------------

KeySpec StringKey(const char* path, Field<std::string> field, const char* default_text,
                  StringCheck check, const char* constraint, const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kString;
  k.binding = field;
  k.default_text = default_text;
  k.string_check = check;
  k.constraint = constraint;
  k.doc = doc;
  return k;
}

KeySpec IntKey(const char* path, Field<int64_t> field, const char* default_text, int64_t min,
               int64_t max, const char* doc, ConfigType type = ConfigType::kInt) {
  KeySpec k;
  k.path = path;
  k.type = type;
  k.binding = field;
  k.default_text = default_text;
  k.int_min = min;
  k.int_max = max;
  k.constraint = absl::StrCat("in [", min, ", ", max, "]");
  k.doc = doc;
  return k;
}

KeySpec DurationKey(const char* path, Field<int64_t> field, const char* default_text, int64_t min,
                    int64_t max, const char* doc) {
  return IntKey(path, field, default_text, min, max, doc, ConfigType::kDurationMs);
}

struct SizeRange {
  uint64_t min = 0;
  uint64_t max = std::numeric_limits<uint64_t>::max();
  uint64_t multiple = 1;
};

KeySpec SizeKey(const char* path, Field<uint64_t> field, const char* default_text, SizeRange range,
                const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kSize;
  k.binding = field;
  k.default_text = default_text;
  k.size_min = range.min;
  k.size_max = range.max;
  k.size_multiple = range.multiple;
  if (range.max == std::numeric_limits<uint64_t>::max()) {
    k.constraint = absl::StrCat("at least ", FormatSize(range.min));
  } else {
    k.constraint = absl::StrCat("in [", FormatSize(range.min), ", ", FormatSize(range.max), "]");
  }
  if (range.multiple > 1) {
    absl::StrAppend(&k.constraint, ", a multiple of ", FormatSize(range.multiple));
  }
  k.doc = doc;
  return k;
}

struct DoubleRange {
  double min;
  bool min_open;
  double max;
  bool max_open;
};

KeySpec DoubleKey(const char* path, Field<double> field, const char* default_text,
                  DoubleRange range, const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kDouble;
  k.binding = field;
  k.default_text = default_text;
  k.double_min = range.min;
  k.double_min_open = range.min_open;
  k.double_max = range.max;
  k.double_max_open = range.max_open;
  k.constraint =
      absl::StrCat("in ", FormatInterval(range.min, range.min_open, range.max, range.max_open));
  k.doc = doc;
  return k;
}

KeySpec ChoiceKey(const char* path, EnumField field, const char* default_text,
                  std::vector<std::string> choices, const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kChoice;
  k.binding = field;
  k.default_text = default_text;
  k.constraint = absl::StrCat("one of ", absl::StrJoin(choices, ", "));
  k.choices = std::move(choices);
  k.doc = doc;
  return k;
}

KeySpec ModeKey(const char* path, Field<uint32_t> field, const char* default_text, ModeCheck check,
                const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kFileMode;
  k.binding = field;
  k.default_text = default_text;
  k.mode_check = check;
  k.constraint = check == nullptr ? "octal, at most 0777" : "octal, at most 0770, none for others";
  k.doc = doc;
  return k;
}

KeySpec BoolKey(const char* path, Field<bool> field, const char* default_text, const char* doc) {
  KeySpec k;
  k.path = path;
  k.type = ConfigType::kBool;
  k.binding = field;
  k.default_text = default_text;
  k.constraint = "true or false";
  k.doc = doc;
  return k;
}

// Marks a key whose value ConfigToYaml(..., redact_secrets=true) and ConfigDigest() hide (a
// password, a token; not a path to a key file): Secret(StringKey(...)).
// A string key whose value is a list: the file may write it as a YAML sequence of strings,
// which is joined with `separator` (the string form stays the canonical one).
KeySpec ListKey(KeySpec k, char separator) {
  k.list_separator = separator;
  return k;
}

KeySpec Secret(KeySpec k) {
  k.secret = true;
  return k;
}

// Every key. Adding a key: a field in config.h, an entry here, and its documented default in
// config/kvcellard.yaml (the tests fail until the file has it).
std::vector<KeySpec> SchemaTable() {
  constexpr int64_t kOneHourMs = 3600 * 1000;
  return {
      // listen
      StringKey(
          KVC_FIELD(listen, unix_socket), "", CheckSocketPath, "path, at most 107 bytes, or \"\"",
          "Unix socket for the engine API; \"\" = $RUNTIME_DIRECTORY/kvcellard.sock, else "
          "$XDG_RUNTIME_DIR/kvcellar/kvcellard.sock, else /tmp/kvcellar-<uid>/kvcellard.sock"),
      ModeKey(KVC_FIELD(listen, unix_socket_mode), "0660", nullptr,
              "Permission bits of the engine socket: who may connect."),
      StringKey(KVC_FIELD(listen, unix_socket_group), "", CheckGroup,
                "group name or numeric gid, or \"\"",
                "Group owning both sockets; \"\" = the daemon's group."),
      StringKey(KVC_FIELD(listen, admin_socket), "", CheckAdminSocket, "path, \"none\", or \"\"",
                "Unix socket for admin RPCs; \"\" = kvcellard-admin.sock beside unix_socket; "
                "\"none\" = no admin socket."),
      ModeKey(KVC_FIELD(listen, admin_socket_mode), "0600", CheckAdminMode,
              "Permission bits of the admin socket; must grant nothing to others."),
      IntKey(KVC_FIELD(listen, max_connections_per_uid), "256", 0, 1'000'000,
             "Open connections to unix_socket one user (uid) may hold; the daemon closes the "
             "ones past it at once, so one team's runaway client cannot take the fds every "
             "engine needs. 0 = no limit."),
      StringKey(KVC_FIELD(listen, tcp_address), "", CheckHostPort, "host:port, or \"\"",
                "TCP listener for the engine and admin API (see tls); \"\" = none."),
      BoolKey(KVC_FIELD(listen, tcp_host_memory), "false",
              "Let engines on the TCP listener register host shared memory (SIM regions and "
              "signal regions). A TCP peer has no uid, so the daemon cannot check that it owns "
              "what it names: only for nodes whose engines all trust each other. Off: refused "
              "(PERMISSION_DENIED); engines on the Unix socket are checked instead."),
      // tls
      ChoiceKey(KVC_ENUM(tls, mode), "plaintext", {"plaintext", "tls", "mtls"},
                "Security of the TCP listener: plaintext, TLS, or TLS with client certificates "
                "(mtls; a client certificate grants admin)."),
      StringKey(KVC_FIELD(tls, cert_file), "", nullptr, "readable file, or \"\"",
                "PEM server certificate chain; required by tls and mtls."),
      StringKey(KVC_FIELD(tls, key_file), "", nullptr, "readable file, or \"\"",
                "PEM private key of cert_file; required by tls and mtls."),
      StringKey(KVC_FIELD(tls, client_ca_file), "", nullptr, "readable file, or \"\"",
                "PEM CA bundle that client certificates must chain to; required by mtls."),
      // tenants
      ListKey(StringKey(KVC_FIELD(tenants, allow), "", CheckTenantGrants, "tenant grants, or \"\"",
                        "Who may register engines under which tenant, separated by ';': "
                        "TENANT=uid:USER, TENANT=gid:GROUP (Unix socket peers), "
                        "TENANT=subject:SUBJECT (mTLS client certificates), or a YAML list of "
                        "them; \"\" = every peer may use every tenant (docs/security.md)."),
              ';'),
      ListKey(StringKey(KVC_FIELD(tenants, quotas), "", CheckTenantQuotas, "tenant quotas, or \"\"",
                        "Per-tenant shares of the L2 pool, separated by ';': "
                        "TENANT=guarantee:AMOUNT,ceiling:AMOUNT (either part may be left out), "
                        "or a YAML list of them. AMOUNT is a fraction of pool.capacity (0.5, "
                        "50%) or a size (4GiB). Eviction takes pages of tenants above their "
                        "guarantee first, and a tenant at its ceiling evicts its own; guarantees "
                        "may sum to at most the pool. \"\" = no quotas (docs/security.md)."),
              ';'),
      // http
      StringKey(KVC_FIELD(http, address), "127.0.0.1:9740", CheckHostPort, "host:port, or \"\"",
                "HTTP listener for /metrics, /healthz and /readyz; \"\" = none."),
      IntKey(KVC_FIELD(http, max_namespace_series), "64", 0, 10'000,
             "Distinct (tenant, model) pairs given their own kvcellar_namespace_* series, in "
             "order of first use; later ones are summed into tenant=\"other\", "
             "model=\"other\". Bounds the label cardinality."),
      // log
      ChoiceKey(KVC_ENUM(log, level), "info", {"debug", "info", "warn", "error"},
                "Lowest level of log lines written."),
      ChoiceKey(KVC_ENUM(log, format), "kv", {"kv"},
                "Log line format: kv = one line per event, key=value fields."),
      // server
      DurationKey(KVC_FIELD(server, drain_timeout_ms), "5000", 0, 600000,
                  "On SIGTERM, how long in-flight RPCs may finish before they are cancelled."),
      IntKey(KVC_FIELD(server, max_batch_pages), "65536", 1, int64_t{1} << 20,
             "Most pages one Match/Load/Backup batch may name; larger batches are rejected."),
      SizeKey(KVC_FIELD(server, max_message_bytes), "64MiB", {.min = kMiB, .max = kGiB},
              "Largest gRPC message the daemon receives."),
      // pool
      SizeKey(KVC_FIELD(pool, capacity), "1GiB", {.min = 64 * kMiB},
              "Bytes of pinned host memory for the L2 pool; a multiple of region_size."),
      SizeKey(KVC_FIELD(pool, region_size), "64MiB",
              {.min = kHugePageSize, .max = 16 * kGiB, .multiple = kHugePageSize},
              "Bytes mapped and registered with the GPU at a time."),
      ChoiceKey(KVC_ENUM(pool, huge_pages), "auto", {"auto", "on", "off"},
                "Back the pool with huge pages: auto = when available, on = required, off = "
                "never."),
      StringKey(KVC_FIELD(pool, shm_name), "", CheckShmName, "POSIX shm name, or \"\"",
                "Named shared memory object holding the pool, re-attached by a restarted daemon "
                "(warm restart); \"\" = anonymous memory."),
      DoubleKey(KVC_FIELD(pool, high_watermark), "0.95", {0, true, 1, false},
                "Pool fill fraction at which eviction starts."),
      DoubleKey(KVC_FIELD(pool, low_watermark), "0.90", {0, true, 1, true},
                "Pool fill fraction at which eviction stops; below high_watermark."),
      // eviction
      ChoiceKey(KVC_ENUM(eviction, policy), "adaptive", {"s3fifo", "lru", "adaptive"},
                "Which unpinned L2 pages are evicted first."),
      // sessions
      DurationKey(KVC_FIELD(sessions, lease_ms), "10000", 100, kOneHourMs,
                  "A session without a Heartbeat for this long expires; its pins and ops end."),
      DurationKey(KVC_FIELD(sessions, pin_lease_ms), "30000", 100, kOneHourMs,
                  "A pin taken by Match is dropped if not consumed within this long."),
      // device
      ChoiceKey(KVC_ENUM(device, kind), "auto", {"auto", "cuda", "sim"},
                "Device backend: cuda, sim (shared memory, no GPU), or auto = cuda when a GPU "
                "is present, else sim."),
      BoolKey(KVC_FIELD(device, host_memory_engines), "true",
              "With kind cuda (or auto resolving to cuda): also serve engines whose KV lives in "
              "host shared memory (DEVICE_KIND_SIM, e.g. SGLang's HiCache host pool) with a "
              "second, memcpy backend. Without a GPU the sim device serves them anyway."),
      ChoiceKey(KVC_ENUM(device, cuda_copy_path), "copy_engine", {"copy_engine", "kernel", "auto"},
                "How the CUDA backend copies: copy_engine (DMA; leaves the engine's kernels "
                "alone), kernel (a copy kernel, faster for small blocks but without MPS it "
                "time-slices the GPU with the engine: a GEMM ran 66% slower beside it on an "
                "H200), or auto = the kernel for runs up to 64 KiB."),
      // storage
      ListKey(StringKey(KVC_FIELD(storage, tiers), "", CheckL3Tiers, "tier specs, or \"\"",
                        "L3 tiers in lookup order, fastest first, separated by spaces or ';': "
                        "file:/DIR?name=nvme&capacity=500GiB, redis:HOST:PORT?prefix=kvc:, "
                        "redis-cluster:H1:P1,H2:P2 (options in docs/storage.md), or a YAML list of "
                        "them; \"\" = no L3."),
              ' '),
      Secret(StringKey(KVC_FIELD(storage, redis_password), "", nullptr, "",
                       "Password (AUTH) for every redis tier; \"\" = none.")),
      ChoiceKey(KVC_ENUM(storage, write_policy), "write_through",
                {"write_through", "write_through_selective", "write_back", "l2_only"},
                "Default L2 -> L3 write policy (an engine's Backup may name another): every page "
                "at once, pages hit selective_hits times, pages evicted from L2, or never."),
      IntKey(KVC_FIELD(storage, selective_hits), "2", 1, 1'000'000,
             "write_through_selective: L2 hits a page needs before it is written to L3."),
      ChoiceKey(KVC_ENUM(storage, prefetch_policy), "best_effort",
                {"none", "best_effort", "wait_complete", "timeout"},
                "Default L3 -> L2 prefetch policy for Match and Prefetch requests that name none."),
      DurationKey(KVC_FIELD(storage, prefetch_timeout_base_ms), "20", 1, kOneHourMs,
                  "timeout policy without a request timeout: deadline = base + per 1K tokens "
                  "x tokens fetched, capped at the daemon's max prefetch timeout."),
      DurationKey(KVC_FIELD(storage, prefetch_timeout_per_1k_tokens_ms), "5", 0, kOneHourMs,
                  "timeout policy: milliseconds added per 1024 tokens being prefetched."),
      SizeKey(KVC_FIELD(storage, max_pending_write_bytes), "1GiB", {.min = 0, .max = 1 * kTiB},
              "L2 -> L3 bytes in flight at most; pages past it are not written (counted)."),
      SizeKey(KVC_FIELD(storage, max_pending_prefetch_bytes), "1GiB", {.min = 0, .max = 1 * kTiB},
              "L3 -> L2 bytes in flight at most; pages past it are THROTTLED."),
      DurationKey(KVC_FIELD(storage, max_lookup_ms), "50", 0, 10'000,
                  "Cap on a Match's l3_lookup_timeout_ms (asking L3 backends for pages the "
                  "index does not know)."),
      // events
      StringKey(KVC_FIELD(events, endpoint), "", CheckZmqEndpoint, "ZeroMQ endpoint, or \"\"",
                "Where KV events are published (ZMQ PUB, vLLM's format, docs/events.md): bound "
                "when it has '*' or is ipc://, else connected; \"\" = no ZMQ publisher."),
      StringKey(KVC_FIELD(events, replay_endpoint), "", CheckZmqEndpoint,
                "ZeroMQ endpoint, or \"\"",
                "ZMQ ROUTER (bound) answering replay requests for buffered batches; \"\" = none."),
      StringKey(KVC_FIELD(events, topic), "kv@{node}@{model}", nullptr, "string",
                "Topic of each batch; {node}, {tenant} and {model} are replaced by events.node "
                "and the namespace's tenant and model id."),
      StringKey(KVC_FIELD(events, node), "", nullptr, "string, or \"\"",
                "This node's name in topics; \"\" = the host name."),
      IntKey(KVC_FIELD(events, buffer_steps), "10000", 1, 10'000'000,
             "Batches kept for replay (replay_endpoint and WatchEvents from_seq)."),
      IntKey(KVC_FIELD(events, hwm), "100000", 1, 100'000'000,
             "ZMQ send high-water mark: batches queued per slow subscriber before it loses "
             "them (and sees the gap in sequence numbers)."),
      IntKey(KVC_FIELD(events, max_queue_size), "100000", 1, 100'000'000,
             "Index events waiting for the publisher at most; more are dropped (counted, and "
             "the next batch's sequence number skips one)."),
      DurationKey(KVC_FIELD(events, batch_interval_ms), "10", 1, 10'000,
                  "How often queued events are published as batches."),
      ChoiceKey(KVC_ENUM(events, block_hashes), "int", {"int", "bytes"},
                "Block hashes in events: int, vLLM's default (the hash's last 8 bytes, "
                "big-endian; an engine's own hash where it keys pages itself), or bytes (the "
                "32-byte page keys)."),
      DurationKey(KVC_FIELD(events, heartbeat_ms), "1000", 0, 3'600'000,
                  "With events.endpoint: after this long without a batch, an empty one, so that "
                  "a subscriber that lost batches (a restarted daemon's first ones) sees the gap "
                  "in sequence numbers and asks for a replay; 0 = none."),
      ChoiceKey(KVC_ENUM(events, storage_media), "storage", {"storage", "per_tier"},
                "How L3 pages are announced: storage, as vLLM's MEDIUM_STORAGE (\"STORAGE\", one "
                "medium for the node's own tiers and one for shared ones: stored when the first "
                "tier of the kind holds a page, removed when the last lets it go), which routers "
                "count as the node's disk tier; or per_tier (\"STORAGE:<tier name>\")."),
      BoolKey(KVC_FIELD(events, page_tokens), "true",
              "While events publish (events.endpoint), engines send each backed-up page's "
              "tokens and BlockStored events carry them (token_ids), as routers that hash "
              "tokens need."),
      StringKey(KVC_FIELD(events, label_log), "auto", CheckLabelLog, "auto, off, or a file path",
                "Where pages' tokens are kept so that a restarted daemon announces the pages it "
                "recovers (L2 warm restart, L3 scans) with them: auto = /dev/shm/<pool.shm_name>"
                ".labels when pool.shm_name is set (the pool's lifetime), none otherwise; off; "
                "or a file (on disk it survives reboots, as file tiers do)."),
      SizeKey(KVC_FIELD(events, max_token_bytes), "1GiB", {.min = 0, .max = 1 * kTiB},
              "Memory one namespace's index keeps for its pages' tokens at most (about 80 B "
              "plus 4 B per token per page); pages past it are announced without tokens. 0 = no "
              "limit."),
  };
}

#undef KVC_FIELD
#undef KVC_ENUM

// ---- Parse and format one value -----------------------------------------------------------

std::string Quoted(absl::string_view s) { return absl::StrCat("'", s, "'"); }

// Parses `text` as the value of `spec` and stores it in `config`. On error returns the message,
// starting with the quoted key path.
absl::Status ParseAndStore(const KeySpec& spec, absl::string_view text, Config* config) {
  const std::string key = Quoted(spec.path);
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(key, " ", parts...));
  };
  if (absl::StrContains(text, '\0')) return invalid("must not contain a NUL byte");
  switch (spec.type) {
    case ConfigType::kString: {
      if (spec.string_check != nullptr) {
        std::string why = spec.string_check(text);
        if (!why.empty()) return invalid(why);
      }
      std::get<Field<std::string>>(spec.binding).mut(*config) = std::string(text);
      return absl::OkStatus();
    }
    case ConfigType::kInt:
    case ConfigType::kDurationMs: {
      int64_t value = 0;
      if (!absl::SimpleAtoi(text, &value)) {
        return invalid(spec.type == ConfigType::kDurationMs
                           ? "expects an integer number of milliseconds, got "
                           : "expects an integer, got ",
                       Quoted(text));
      }
      if (value < spec.int_min || value > spec.int_max) {
        return invalid("must be in [", spec.int_min, ", ", spec.int_max, "], got ", value);
      }
      std::get<Field<int64_t>>(spec.binding).mut(*config) = value;
      return absl::OkStatus();
    }
    case ConfigType::kSize: {
      std::optional<uint64_t> value = ParseSize(text);
      if (!value) return invalid("expects ", kSizeSyntax, ", got ", Quoted(text));
      if (*value < spec.size_min || *value > spec.size_max) {
        return invalid("must be ", spec.constraint, ", got ", FormatSize(*value));
      }
      if (*value % spec.size_multiple != 0) {
        return invalid("must be a multiple of ", FormatSize(spec.size_multiple), ", got ",
                       FormatSize(*value));
      }
      std::get<Field<uint64_t>>(spec.binding).mut(*config) = *value;
      return absl::OkStatus();
    }
    case ConfigType::kDouble: {
      std::optional<double> value = ParseDouble(text);
      if (!value) return invalid("expects a number, got ", Quoted(text));
      bool below = spec.double_min_open ? *value <= spec.double_min : *value < spec.double_min;
      bool above = spec.double_max_open ? *value >= spec.double_max : *value > spec.double_max;
      if (below || above)
        return invalid("must be ", spec.constraint, ", got ", FormatDouble(*value));
      std::get<Field<double>>(spec.binding).mut(*config) = *value;
      return absl::OkStatus();
    }
    case ConfigType::kChoice: {
      auto it = std::find(spec.choices.begin(), spec.choices.end(), text);
      if (it == spec.choices.end()) {
        return invalid("must be ", spec.constraint, ", got ", Quoted(text));
      }
      std::get<EnumField>(spec.binding).set(*config, static_cast<int>(it - spec.choices.begin()));
      return absl::OkStatus();
    }
    case ConfigType::kFileMode: {
      std::optional<uint32_t> mode = ParseMode(text);
      if (!mode) {
        return invalid("expects an octal mode string like \"0660\", got ", Quoted(text));
      }
      if (*mode > 0777) {
        return invalid("must be at most 0777 (no setuid, setgid or sticky bits), got ",
                       Quoted(FormatMode(*mode)));
      }
      if (spec.mode_check != nullptr) {
        std::string why = spec.mode_check(*mode);
        if (!why.empty()) return invalid(why);
      }
      std::get<Field<uint32_t>>(spec.binding).mut(*config) = *mode;
      return absl::OkStatus();
    }
    case ConfigType::kBool: {
      // YAML 1.2's core schema spellings; not 1.1's yes/no/on/off.
      const std::string lower = absl::AsciiStrToLower(text);
      if (lower != "true" && lower != "false") {
        return invalid("expects true or false, got ", Quoted(text));
      }
      std::get<Field<bool>>(spec.binding).mut(*config) = lower == "true";
      return absl::OkStatus();
    }
  }
  return invalid("has an unknown type");  // Unreachable: the switch covers every type.
}

Formatted FormatValue(const KeySpec& spec, const Config& config) {
  switch (spec.type) {
    case ConfigType::kString:
      return {std::get<Field<std::string>>(spec.binding).get(config), true};
    case ConfigType::kInt:
    case ConfigType::kDurationMs:
      return {absl::StrCat(std::get<Field<int64_t>>(spec.binding).get(config)), false};
    case ConfigType::kSize: {
      uint64_t bytes = std::get<Field<uint64_t>>(spec.binding).get(config);
      std::string text = FormatSize(bytes);
      // A plain byte count stays a YAML integer; "64MiB" must be a string.
      return {text, text != absl::StrCat(bytes)};
    }
    case ConfigType::kDouble:
      return {FormatDouble(std::get<Field<double>>(spec.binding).get(config)), false};
    case ConfigType::kChoice: {
      int index = std::get<EnumField>(spec.binding).get(config);
      if (index < 0 || static_cast<size_t>(index) >= spec.choices.size()) {
        return {absl::StrCat("<invalid ", index, ">"), true};  // A Config not from LoadConfig.
      }
      // Quoted: YAML 1.1 readers (PyYAML) would take a bare `on`/`off` for a boolean.
      return {spec.choices[index], true};
    }
    case ConfigType::kFileMode:
      return {FormatMode(std::get<Field<uint32_t>>(spec.binding).get(config)), true};
    case ConfigType::kBool:
      return {std::get<Field<bool>>(spec.binding).get(config) ? "true" : "false", false};
  }
  return {"", true};
}

// ---- The schema, built once ---------------------------------------------------------------

absl::string_view SectionOf(absl::string_view path) { return path.substr(0, path.find('.')); }

absl::string_view LeafOf(absl::string_view path) {
  size_t dot = path.rfind('.');
  return dot == absl::string_view::npos ? path : path.substr(dot + 1);
}

const Schema& GetSchema() {
  static const Schema* const schema = [] {
    auto* s = new Schema;
    s->keys = SchemaTable();
    for (size_t i = 0; i < s->keys.size(); ++i) {
      const KeySpec& spec = s->keys[i];
      // A default that does not parse is a bug in the table above; config_test catches it, and
      // the daemon refuses to start rather than run with a half-built config.
      if (absl::Status st = ParseAndStore(spec, spec.default_text, &s->defaults); !st.ok()) {
        std::fprintf(stderr, "kvcellar: bad default in config schema: %s\n",
                     std::string(st.message()).c_str());
        std::abort();
      }
      s->by_path.emplace(spec.path, i);
      std::string section(SectionOf(spec.path));
      if (std::find(s->sections.begin(), s->sections.end(), section) == s->sections.end()) {
        s->sections.push_back(section);
      }
    }
    for (const KeySpec& spec : s->keys) {
      s->infos.push_back(ConfigKeyInfo{
          .path = spec.path,
          .type = spec.type,
          .default_value = FormatValue(spec, s->defaults).text,
          .constraint = spec.constraint,
          .choices = spec.choices,
          .secret = spec.secret,
          .doc = spec.doc,
      });
    }
    return s;
  }();
  return *schema;
}

bool IsSection(absl::string_view name) {
  const auto& sections = GetSchema().sections;
  return std::find(sections.begin(), sections.end(), name) != sections.end();
}

const KeySpec* FindKey(absl::string_view path) {
  const Schema& schema = GetSchema();
  auto it = schema.by_path.find(path);
  return it == schema.by_path.end() ? nullptr : &schema.keys[it->second];
}

// ---- Did you mean -------------------------------------------------------------------------

// Optimal string alignment distance: Levenshtein plus adjacent transpositions ("capactiy").
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::optional<std::string> Suggest(absl::string_view unknown) {
  const Schema& schema = GetSchema();
  // A known key name in the wrong section (or with no section): `pool.policy`, `capacity`.
  absl::string_view leaf = LeafOf(unknown);
  const KeySpec* same_leaf = nullptr;
  int same_leaf_count = 0;
  for (const KeySpec& spec : schema.keys) {
    if (LeafOf(spec.path) == leaf) {
      same_leaf = &spec;
      ++same_leaf_count;
    }
  }
  if (same_leaf_count == 1) return same_leaf->path;
  // Else the nearest name at the same depth, if it is near: a quarter of the letters may differ.
  std::vector<absl::string_view> candidates;
  if (absl::StrContains(unknown, '.')) {
    for (const KeySpec& spec : schema.keys) candidates.push_back(spec.path);
  } else {
    for (const std::string& section : schema.sections) candidates.push_back(section);
  }
  size_t limit = std::max<size_t>(1, unknown.size() / 4);
  std::optional<std::string> best;
  size_t best_distance = limit + 1;
  for (absl::string_view candidate : candidates) {
    size_t distance = EditDistance(unknown, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = std::string(candidate);
    }
  }
  return best;
}

std::string UnknownKey(absl::string_view path) {
  std::string message = absl::StrCat("unknown key ", Quoted(path));
  if (std::optional<std::string> suggestion = Suggest(path)) {
    absl::StrAppend(&message, " (did you mean ", Quoted(*suggestion), "?)");
  }
  return message;
}

}  // namespace config_schema

std::optional<uint64_t> ParseSizeValue(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(text[digits])) ++digits;
  uint64_t number = 0;
  if (digits == 0 || !absl::SimpleAtoi(text.substr(0, digits), &number)) return std::nullopt;
  absl::string_view unit = absl::StripLeadingAsciiWhitespace(text.substr(digits));
  if (unit.empty()) return number;
  for (const config_schema::SizeUnit& u : config_schema::kSizeUnits) {
    if (unit == u.name) {
      if (number > std::numeric_limits<uint64_t>::max() / u.bytes) return std::nullopt;
      return number * u.bytes;
    }
  }
  return std::nullopt;
}


}  // namespace kvcellar::server
