// The daemon's configuration: one schema, one typed struct, three layers.
//
// Every key is one entry in the schema table in config.cc (dotted path, type, default, allowed
// values, one-line doc). The effective configuration is built in layers, later wins:
//   embedded defaults  <  the YAML file (`--config FILE`)  <  `--set key=value`, in order.
// Every error names the key and says why, so `kvcellard --check-config` can print it as is.
//
// Value syntax (the same in the file and in --set):
//   - size: bytes as an integer, or an integer with a unit: KiB, MiB, GiB, TiB are powers of 1024;
//     KB, MB, GB, TB are powers of 1000 (`4GB` = 4 * 10^9 bytes); B is bytes.
//   - durations: integers in milliseconds; their keys end in `_ms`.
//   - octal mode: a string of 3 or 4 octal digits, like "0660".
//   - choice: one of the listed words, lower case.
//   - `--set` takes the value verbatim (no YAML quoting); `--set k=` sets a string to "".
// Relative paths resolve against the daemon's working directory (`/` under systemd).
//
// Thread safety: all functions are pure or read-only over immutable tables; call from any thread.
// ResolveUnixSocketPath() and ResolveAdminSocketPath() read the environment.
#ifndef KVCELLAR_SERVER_CONFIG_CONFIG_H_
#define KVCELLAR_SERVER_CONFIG_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "platform/log.h"

namespace kvcellar::server {

// Choice types. The enumerators are in the order of the schema's choice list, starting at 0:
// config.cc converts by index, so keep the two in step.
enum class LogFormat { kKv };
enum class TlsMode { kPlaintext, kTls, kMtls };
enum class HugePages { kAuto, kOn, kOff };
enum class EvictionPolicy { kS3Fifo, kLru, kAdaptive };
enum class DeviceKind { kAuto, kCuda, kSim };
enum class CudaCopyPath { kCopyEngine, kKernel, kAuto };
enum class L3WritePolicy { kWriteThrough, kWriteThroughSelective, kWriteBack, kL2Only };
enum class L3PrefetchPolicy { kNone, kBestEffort, kWaitComplete, kTimeout };

// Field names match the key names; see config/kvcellard.yaml for what each one means. A
// value-initialized Config is not the defaults: use DefaultConfig() or LoadConfig().
struct ListenConfig {
  std::string unix_socket;  // "" = ResolveUnixSocketPath()'s default.
  uint32_t unix_socket_mode = 0;
  std::string unix_socket_group;  // "" = the process's group; a name or a numeric gid.
  std::string admin_socket;       // "" = next to unix_socket; "none" = no admin socket.
  uint32_t admin_socket_mode = 0;
  int64_t max_connections_per_uid = 0;  // Open engine-socket connections per peer uid; 0 = any.
  std::string tcp_address;  // "" = no TCP listener; else host:port.
  // Host shared memory (sim regions, signal regions) registered over TCP, whose peers have no
  // uid to check ownership against (docs/security.md). Off: refused.
  bool tcp_host_memory = false;
  bool operator==(const ListenConfig&) const = default;
};

struct TlsConfig {
  TlsMode mode{};  // Applies to listen.tcp_address only.
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  bool operator==(const TlsConfig&) const = default;
};

// Who may register engines under which tenant (server/config/tenant_grant.h says the syntax).
struct TenantsConfig {
  std::string allow;  // "" = every peer may register every tenant.
  // Per-tenant L2 guarantees and ceilings (server/config/tenant_quota.h); "" = none.
  std::string quotas;
  bool operator==(const TenantsConfig&) const = default;
};

struct HttpConfig {
  std::string address;  // "" = no metrics/health HTTP listener.
  // Distinct (tenant, model) label pairs with per-namespace series; the rest share "other".
  int64_t max_namespace_series = 0;
  bool operator==(const HttpConfig&) const = default;
};

struct LogConfig {
  platform::LogLevel level{};
  LogFormat format{};
  bool operator==(const LogConfig&) const = default;
};

struct ServerConfig {
  int64_t drain_timeout_ms = 0;
  int64_t max_batch_pages = 0;
  uint64_t max_message_bytes = 0;  // Fits in an int: gRPC's limit is an int.
  bool operator==(const ServerConfig&) const = default;
};

struct PoolConfig {
  uint64_t capacity = 0;     // Bytes; a multiple of region_size.
  uint64_t region_size = 0;  // Bytes; a multiple of 2 MiB.
  HugePages huge_pages{};
  std::string shm_name;  // "" = anonymous memory (no warm restart).
  double high_watermark = 0;
  double low_watermark = 0;  // < high_watermark.
  bool operator==(const PoolConfig&) const = default;
};

struct EvictionConfig {
  EvictionPolicy policy{};
  bool operator==(const EvictionConfig&) const = default;
};

struct SessionsConfig {
  int64_t lease_ms = 0;
  int64_t pin_lease_ms = 0;
  bool operator==(const SessionsConfig&) const = default;
};

struct DeviceConfig {
  DeviceKind kind{};
  // With a CUDA primary device: also serve DEVICE_KIND_SIM sessions, engines whose KV lives in
  // host shared memory (SGLang's HiCache host pool), through a second, sim backend.
  bool host_memory_engines = true;
  // How the CUDA backend moves pages: the copy engines (DMA), the copy kernel, or the kernel for
  // small runs and the copy engines for large ones (gpu/cuda/cuda_device.h).
  CudaCopyPath cuda_copy_path{};
  bool operator==(const DeviceConfig&) const = default;
};

// L3: the tiers (server/config/l3_tier_spec.h says the syntax of `tiers`) and the policies that move
// pages between them and L2.
struct StorageConfig {
  std::string tiers;           // "" = no L3.
  std::string redis_password;  // Secret. AUTH for every redis tier.
  L3WritePolicy write_policy{};
  int64_t selective_hits = 0;  // write_through_selective: L2 hits before the page is written.
  L3PrefetchPolicy prefetch_policy{};
  int64_t prefetch_timeout_base_ms = 0;
  int64_t prefetch_timeout_per_1k_tokens_ms = 0;
  uint64_t max_pending_write_bytes = 0;     // L2 -> L3 bytes in flight; more are dropped.
  uint64_t max_pending_prefetch_bytes = 0;  // L3 -> L2 bytes in flight; more are THROTTLED.
  int64_t max_lookup_ms = 0;                // Cap on MatchRequest.l3_lookup_timeout_ms.
  bool operator==(const StorageConfig&) const = default;
};

// KV events for routers (server/events/event_hub.h, docs/events.md). The names follow vLLM's
// KVEventsConfig (endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic).
struct EventsConfig {
  std::string endpoint;         // ZMQ PUB; "" = none (WatchEvents still works).
  std::string replay_endpoint;  // ZMQ ROUTER for replay; "" = none.
  std::string topic;            // {node}, {tenant}, {model} are replaced.
  std::string node;             // "" = the host name.
  int64_t buffer_steps = 0;     // Batches kept for replay.
  int64_t hwm = 0;              // ZMQ send high-water mark of the PUB socket.
  int64_t max_queue_size = 0;   // Events waiting for the publisher; more are dropped.
  int64_t batch_interval_ms = 0;
  // Block hashes as vLLM publishes them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or
  // as 32-byte keys.
  enum class BlockHashes : uint8_t { kInt, kBytes };
  BlockHashes block_hashes = BlockHashes::kInt;
  // Whether engines are asked for each page's tokens (BackupSequence.token_ids) while events
  // publish, and the most bytes the index of one namespace keeps for them.
  bool page_tokens = true;
  uint64_t max_token_bytes = 0;
  // L3 media: vLLM's "STORAGE" for all of the node's tiers (one medium per locality), or
  // "STORAGE:<tier name>" per tier.
  enum class StorageMedia : uint8_t { kStorage, kPerTier };
  StorageMedia storage_media = StorageMedia::kStorage;
  int64_t heartbeat_ms = 0;  // An empty batch after this long without one (ZMQ); 0: none.
  // Where pages' tokens are kept for a restart (server/events/label_log.h): "auto" (beside the
  // pool's shm object when pool.shm_name is set), "off", or a file path.
  std::string label_log;
  bool operator==(const EventsConfig&) const = default;
};

struct Config {
  ListenConfig listen;
  TlsConfig tls;
  TenantsConfig tenants;
  HttpConfig http;
  LogConfig log;
  ServerConfig server;
  PoolConfig pool;
  EvictionConfig eviction;
  SessionsConfig sessions;
  DeviceConfig device;
  StorageConfig storage;
  EventsConfig events;
  bool operator==(const Config&) const = default;
};

enum class ConfigType {
  kString,
  kInt,
  kDouble,
  kSize,        // Bytes; see the unit syntax above.
  kDurationMs,  // Milliseconds, an integer.
  kChoice,
  kFileMode,  // Octal permission bits, written as a string like "0660".
  kBool,      // true or false.
};

// "string", "integer", "number", "size", "duration in ms", "choice", "octal mode", "boolean".
absl::string_view ConfigTypeName(ConfigType type);

// One schema entry, for docs and tests. The table itself lives in config.cc.
struct ConfigKeyInfo {
  std::string path;  // "pool.capacity"
  ConfigType type = ConfigType::kString;
  std::string default_value;         // As ConfigToYaml writes it, unquoted: "1GiB", "0660", "info".
  std::string constraint;            // Human-readable allowed values ("in (0, 1]"), or "".
  std::vector<std::string> choices;  // For kChoice, in enum order.
  bool secret = false;               // Value hidden by ConfigToYaml(..., redact_secrets=true).
  std::string doc;
};

// Every key, in file order (section by section).
const std::vector<ConfigKeyInfo>& ConfigSchema();

// The embedded defaults.
Config DefaultConfig();

// Builds the effective config: defaults, then `file` if given, then each `key=value` override in
// order. Errors: NotFound/PermissionDenied/... when the file cannot be read; InvalidArgument for
// anything wrong in it or in the overrides, one line per problem found, each naming the key and
// its source (`FILE:LINE:COL:` or `--set 'k=v':`). An empty file gives the defaults. Files named
// by tls.* keys must exist and be readable at load.
absl::StatusOr<Config> LoadConfig(const std::optional<std::string>& file,
                                  absl::Span<const std::string> overrides);

// The config as canonical YAML: every key, in schema order, one `section:` block each, strings
// double-quoted. Stable byte for byte for equal configs (no yaml-cpp emitter involved), and it
// loads back to the same Config. With redact_secrets, non-empty values of secret keys read
// "<redacted>".
std::string ConfigToYaml(const Config& config, bool redact_secrets);

// Lowercase hex SHA-256 of ConfigToYaml(config, /*redact_secrets=*/true). Redacted so that the
// digest, which is exported (metrics, GetConfig), never lets anyone test guesses of a secret;
// the price is that two configs differing only in a secret share a digest.
std::string ConfigDigest(const Config& config);

// listen.unix_socket if set; else platform::DefaultSocketPath(): `$RUNTIME_DIRECTORY/kvcellard.sock`
// (systemd's RuntimeDirectory=), else `$XDG_RUNTIME_DIR/kvcellar/kvcellard.sock`, else
// `/tmp/kvcellar-<uid>/kvcellard.sock` (the rule the client library and kvcellarctl share). The
// caller creates a missing parent directory with mode 0700 (and, under /tmp, must check that an
// existing one is owned by this uid and not group/other writable: anyone can pre-create it).
std::string ResolveUnixSocketPath(const Config& config);

// nullopt when listen.admin_socket is "none"; the path when set; else `kvcellard-admin.sock` in
// the directory of ResolveUnixSocketPath().
std::optional<std::string> ResolveAdminSocketPath(const Config& config);

// Parses a size as the config's value syntax describes ("64MiB", "4GB", "4096"); nullopt when it
// is not one. For other config-like text (storage.tiers options).
std::optional<uint64_t> ParseSizeValue(absl::string_view text);

namespace config_internal {
// ConfigToYaml with the redaction decision taken per key path; lets tests exercise redaction
// whether or not the schema has a secret key yet.
std::string ConfigToYaml(const Config& config,
                         absl::FunctionRef<bool(absl::string_view path)> redact);
}  // namespace config_internal

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CONFIG_CONFIG_H_
