#include "server/l3/l3_tiers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "storage/file_backend.h"
#include "storage/redis_backend.h"

namespace kvcellar::server {
namespace {

absl::StatusOr<std::unique_ptr<storage::Backend>> OpenBackend(const L3TierSpec& spec,
                                                              const StorageConfig& config) {
  if (spec.kind == L3TierSpec::Kind::kFile) {
    storage::FileBackendOptions o;
    o.root = spec.path;
    o.capacity_bytes = spec.capacity_bytes;
    o.shared = spec.shared;
    o.direct_io = spec.direct_io;
    o.io.kind = spec.io == "io_uring" ? storage::IoEngineKind::kUring
                : spec.io == "threads" ? storage::IoEngineKind::kThreadPool
                                       : storage::IoEngineKind::kAuto;
    o.fsync = spec.fsync == "data"   ? storage::FsyncPolicy::kData
              : spec.fsync == "full" ? storage::FsyncPolicy::kDataAndDirectory
                                     : storage::FsyncPolicy::kNone;
    o.max_inflight_objects = spec.max_inflight;
    if (spec.timeout_ms > 0) o.default_timeout = absl::Milliseconds(spec.timeout_ms);
    absl::StatusOr<std::unique_ptr<storage::FileBackend>> b = storage::FileBackend::Open(o);
    if (!b.ok()) return b.status();
    return std::unique_ptr<storage::Backend>(*std::move(b));
  }
  storage::RedisBackendOptions o;
  o.addresses = spec.addresses;
  o.cluster = spec.kind == L3TierSpec::Kind::kRedisCluster;
  o.connections_per_node = spec.connections;
  o.key_prefix = spec.key_prefix;
  o.ttl = absl::Seconds(spec.ttl_s);
  o.password = config.redis_password;
  o.index = spec.index;
  o.watch_removals = spec.watch;
  if (spec.timeout_ms > 0) o.command_timeout = absl::Milliseconds(spec.timeout_ms);
  absl::StatusOr<std::unique_ptr<storage::RedisBackend>> b = storage::RedisBackend::Create(o);
  if (!b.ok()) return b.status();
  return std::unique_ptr<storage::Backend>(*std::move(b));
}

}  // namespace

absl::StatusOr<std::unique_ptr<L3Tiers>> L3Tiers::Open(const StorageConfig& config) {
  absl::StatusOr<std::vector<L3TierSpec>> specs = ParseL3TierSpecs(config.tiers);
  if (!specs.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'storage.tiers' is invalid: ", specs.status().message()));
  }
  std::unique_ptr<L3Tiers> tiers(new L3Tiers());
  for (L3TierSpec& spec : *specs) {
    absl::StatusOr<std::unique_ptr<storage::Backend>> backend = OpenBackend(spec, config);
    if (!backend.ok()) {
      return absl::Status(backend.status().code(),
                          absl::StrCat("'storage.tiers': tier '", spec.name,
                                       "' cannot be opened: ", backend.status().message()));
    }
    L3Tier tier;
    tier.shared = (*backend)->capabilities().shared_across_nodes;
    tier.backend = *std::move(backend);
    tier.spec = std::move(spec);
    KVLOG(Info, "l3 tier opened",
          {{"tier", tier.spec.name},
           {"backend", tier.backend->name()},
           {"shared", tier.shared ? "true" : "false"},
           {"admit_after", tier.spec.admit_after}});
    tiers->tiers_.push_back(std::move(tier));
  }
  return tiers;
}

L3Tiers::~L3Tiers() = default;

std::vector<std::string> L3Tiers::names() const {
  std::vector<std::string> out;
  for (const L3Tier& t : tiers_) out.push_back(t.spec.name);
  return out;
}

bool L3Tiers::any_admission() const {
  for (const L3Tier& t : tiers_) {
    if (t.spec.admit_after > 0) return true;
  }
  return false;
}

void L3Tiers::Collect(MetricWriter& out) const {
  for (const L3Tier& t : tiers_) {
    const storage::BackendStats s = t.backend->Stats();
    const std::string kind(L3TierKindName(t.spec.kind));
    for (size_t k = 0; k < storage::kOpKindCount; ++k) {
      const storage::OpStats& op = s.ops[k];
      const absl::string_view op_name = storage::OpKindName(static_cast<storage::OpKind>(k));
      for (size_t st = 0; st < storage::kObjectStatusCount; ++st) {
        const MetricWriter::Label labels[] = {
            {"tier", t.spec.name},
            {"op", op_name},
            {"status", storage::ObjectStatusName(static_cast<storage::ObjectStatus>(st))}};
        out.AddCounter("kvcellar_l3_objects_total",
                       "L3 objects handled by backend operation and final status (ok, not_found, "
                       "rejected, retry, device_error, checksum_error).",
                       static_cast<double>(op.by_status[st]), labels);
        // The failures again, by backend kind and reason: what an L3 error alert watches.
        // ok and not_found (a miss) are no errors.
        const auto status = static_cast<storage::ObjectStatus>(st);
        if (status == storage::ObjectStatus::kOk || status == storage::ObjectStatus::kNotFound) {
          continue;
        }
        const MetricWriter::Label error_labels[] = {{"tier", t.spec.name},
                                                    {"backend", kind},
                                                    {"op", op_name},
                                                    {"reason", storage::ObjectStatusName(status)}};
        out.AddCounter("kvcellar_l3_errors_total",
                       "L3 objects that failed, by tier, backend kind (file, redis, "
                       "redis-cluster), operation and reason (rejected, retry, device_error, "
                       "checksum_error).",
                       static_cast<double>(op.by_status[st]), error_labels);
      }
      const MetricWriter::Label labels[] = {{"tier", t.spec.name}, {"op", op_name}};
      out.AddCounter("kvcellar_l3_batches_total", "L3 backend batches by operation.",
                     static_cast<double>(op.batches), labels);
      out.AddCounter("kvcellar_l3_bytes_total",
                     "Payload bytes of L3 objects read (get) and written (put) successfully.",
                     static_cast<double>(op.bytes), labels);
      out.AddCounter("kvcellar_l3_deadline_exceeded_total",
                     "L3 batches that hit their deadline.",
                     static_cast<double>(op.deadline_exceeded), labels);
    }
    const MetricWriter::Label tier[] = {{"tier", t.spec.name}, {"kind", kind}};
    out.AddCounter("kvcellar_l3_corrupt_removed_total",
                   "Corrupt, torn or foreign L3 objects found, removed and never served.",
                   static_cast<double>(s.corrupt_removed), tier);
    out.AddCounter("kvcellar_l3_evicted_objects_total",
                   "Objects the tier evicted to stay within its capacity.",
                   static_cast<double>(s.evicted_objects), tier);
    out.AddCounter("kvcellar_l3_evicted_bytes_total", "Bytes of the objects the tier evicted.",
                   static_cast<double>(s.evicted_bytes), tier);
    if (const storage::RedisBackend* redis = t.redis(); redis != nullptr && t.spec.watch) {
      out.AddCounter("kvcellar_l3_server_removed_objects_total",
                     "Objects a Redis tier's server expired (TTL) or evicted (maxmemory) by "
                     "itself, learned from its keyspace notifications: each left the index.",
                     static_cast<double>(redis->WatchStats().removed), tier);
    }
    out.AddGauge("kvcellar_l3_used_bytes", "Bytes the tier holds (file tiers: this node's files).",
                 static_cast<double>(s.used_bytes), tier);
    out.AddGauge("kvcellar_l3_capacity_bytes", "The tier's capacity; 0 = no limit.",
                 static_cast<double>(s.capacity_bytes), tier);
    out.AddGauge("kvcellar_l3_indexed_objects", "Objects the tier's own index knows.",
                 static_cast<double>(s.indexed_objects), tier);
    out.AddGauge("kvcellar_l3_index_complete",
                 "1 once a file tier's startup scan has finished (always 1 for others).",
                 s.index_complete ? 1 : 0, tier);
    out.AddCounter("kvcellar_l3_redirects_total", "Redis Cluster MOVED and ASK redirections.",
                   static_cast<double>(s.redirects), tier);
    out.AddCounter("kvcellar_l3_reconnects_total", "Redis reconnections.",
                   static_cast<double>(s.reconnects), tier);
  }
}

}  // namespace kvcellar::server
