// L3TierSpec: one L3 storage tier as the operator writes it in `storage.tiers`.
//
// The config schema is flat (section.key scalars: see config.h), so the ordered list of tiers is
// one string: tier specs separated by whitespace or ';', in lookup order (fastest first). Each
// spec is KIND:LOCATION, optionally followed by ?option=value&option=value:
//
//   file:/var/lib/kvcellar/l3?name=nvme&capacity=500GiB
//   file:/mnt/shared/kv?name=shared&shared=true
//   redis:127.0.0.1:6379?name=redis&prefix=kvc:&ttl_s=3600
//   redis:unix:/run/redis/redis.sock
//   redis-cluster:10.0.0.1:7000,10.0.0.2:7000?name=cluster
//
// Options of every kind:
//   name=NAME          the tier's name in metrics, logs and RegisterEngineResponse.l3_tier_names
//                      ([a-z0-9_-], at most 32 bytes); default: the kind, then kind2, kind3...
//   admit_after=N      admission filter: a page is written to this tier only once it has been hit
//                      N times in L2 (saves SSD wear on one-off prompts); default 0 (every page)
//   timeout_ms=MS      default per-batch deadline of the backend; default: the backend's own
// file:  capacity=SIZE (0 = no limit), shared=true|false (other nodes use the directory too),
//        direct_io=true|false, io=auto|io_uring|threads, fsync=none|data|full,
//        max_inflight=N (objects with I/O in flight)
// redis, redis-cluster: prefix=STRING (default "kvc:"), ttl_s=SECONDS (0 = no expiry),
//        connections=N (per node), index=true|false (keep the index a restarted daemon reads
//        back, storage/redis_index.h; default true), watch=true|false (follow what the server
//        expires and evicts through keyspace notifications, storage/redis_watch.h; default
//        true). The password is storage.redis_password (a
//        secret key).
//
// Threads: pure functions.
#ifndef KVCELLAR_SERVER_CONFIG_L3_TIER_SPEC_H_
#define KVCELLAR_SERVER_CONFIG_L3_TIER_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::server {

// The most tiers a daemon takes: the index keeps one bit per tier (core::kMaxL3Tiers).
inline constexpr size_t kMaxL3TierSpecs = 8;

struct L3TierSpec {
  enum class Kind { kFile, kRedis, kRedisCluster };
  Kind kind = Kind::kFile;
  std::string name;
  uint32_t admit_after = 0;
  int64_t timeout_ms = 0;  // 0 = the backend's default.

  // file
  std::string path;
  uint64_t capacity_bytes = 0;
  bool shared = false;
  bool direct_io = true;
  std::string io = "auto";     // auto | io_uring | threads
  std::string fsync = "none";  // none | data | full
  uint32_t max_inflight = 64;

  // redis, redis-cluster
  std::vector<std::string> addresses;
  std::string key_prefix = "kvc:";
  int64_t ttl_s = 0;
  int connections = 4;
  bool index = true;
  bool watch = true;
};

absl::string_view L3TierKindName(L3TierSpec::Kind kind);

// Parses the whole list. InvalidArgument naming the tier (its position and text) and the option,
// e.g. "tier 2 'redis:h:1?ttl_s=x': option ttl_s: 'x' is not an integer".
absl::StatusOr<std::vector<L3TierSpec>> ParseL3TierSpecs(absl::string_view text);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CONFIG_L3_TIER_SPEC_H_
