#include "server/cache/cache.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "server/config/tenant_quota.h"
#include "server/errors/cache_error.h"
#include "server/session/namespace_metrics.h"
#include "server/session/tenant_metrics.h"

namespace kvcellar::server {
namespace {

// How long closing a session waits for a cancelled device op to report that it ended, after its
// mapping is closed (the sim device has finished it by then; CUDA drains its streams, bounded by
// its own close timeout).
constexpr absl::Duration kCancelledOpWait = absl::Seconds(10);

core::EvictionPolicyKind PolicyOf(const Config& config) {
  switch (config.eviction.policy) {
    case EvictionPolicy::kLru:
      return core::EvictionPolicyKind::kLru;
    case EvictionPolicy::kAdaptive:
      return core::EvictionPolicyKind::kAdaptive;
    case EvictionPolicy::kS3Fifo:
      break;
  }
  return core::EvictionPolicyKind::kS3Fifo;
}

// tenants.quotas in bytes of the pool actually mapped. LoadConfig checked them against
// pool.capacity; the pool is that rounded down to whole regions, so byte amounts may no longer
// fit: those are clamped to the pool (and logged), never refused at this point.
std::vector<TenantQuotaBytes> QuotasOf(const Config& config, const core::HostPool* pool) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> specs = ParseTenantQuotas(config.tenants.quotas);
  if (!specs.ok() || pool == nullptr) return {};
  const uint64_t pool_bytes = pool->capacity_bytes();
  absl::StatusOr<std::vector<TenantQuotaBytes>> bytes = ResolveTenantQuotas(*specs, pool_bytes);
  if (bytes.ok()) return *std::move(bytes);
  KVLOG(Warn, "tenant quotas clamped to the pool",
        {{"error", bytes.status().ToString()}, {"pool_bytes", pool_bytes}});
  std::vector<TenantQuotaBytes> clamped;
  uint64_t left = pool_bytes;
  for (const TenantQuotaSpec& s : *specs) {
    const uint64_t ceiling = std::min(s.ceiling.Resolve(pool_bytes), pool_bytes);
    const uint64_t guarantee = std::min({s.guarantee.Resolve(pool_bytes), ceiling, left});
    left -= guarantee;
    clamped.push_back({s.tenant, guarantee, ceiling});
  }
  return clamped;
}

NamespaceRegistry::EventSinkFactory EventSinks(EventHub* hub) {
  if (hub == nullptr) return nullptr;
  return [hub](uint32_t id, const core::NamespaceSpec& spec) { return hub->SinkFor(id, spec); };
}

}  // namespace

Cache::Cache(CacheOptions options)
    : config_(std::move(options.config)),
      limits_(CacheLimits::FromConfig(config_)),
      daemon_epoch_(options.daemon_epoch),
      devices_(std::move(options.devices)),
      daemon_objects_(std::move(options.daemon_objects)),
      metrics_(options.metrics != nullptr ? options.metrics : &DefaultRegistry()),
      tenants_(QuotasOf(config_, options.pool)),
      namespaces_(options.pool, PolicyOf(config_),
                  options.l3 != nullptr ? static_cast<int>(options.l3->size()) : 0,
                  EventSinks(options.events), &tenants_),
      l2_(options.pool, &namespaces_, config_.pool.high_watermark, config_.pool.low_watermark,
          &metrics_, &tenants_),
      ops_(&metrics_, absl::Milliseconds(limits_.op_result_retention_ms)),
      no_l3_(options.l3 == nullptr ? L3Tiers::None() : nullptr),
      l3_(options.l3 != nullptr ? options.l3 : no_l3_.get()),
      writer_(
          l3_, &l2_, [this] { return ops_.NextId(); }, &metrics_, config_.storage),
      prefetcher_(l3_, &l2_, &ops_, &pins_, &metrics_, &limits_, config_.storage),
      recovery_(l3_, &namespaces_, options.labels),
      mover_(&devices_, &l2_, &pins_, &ops_, &pump_, &metrics_, &limits_, &writer_),
      matcher_(&pins_, &ops_, &metrics_, &limits_,
               MatcherL3{l3_, &prefetcher_, &writer_,
                         absl::Milliseconds(config_.storage.max_lookup_ms)}),
      admin_(&namespaces_, &sessions_, &pins_, &l2_, &metrics_, absl::Now()),
      closer_(&ops_, [this](SessionEnd& end) { return FinishEnd(end); }) {
  mover_.set_label_log(options.labels);
  metrics_.SetL3Tiers(l3_->names());
  StartL2(options);
  l2_.set_eviction_observer(&writer_);
  if (!l3_->empty()) {
    metrics_.AddCollector([this](MetricWriter& out) {
      l3_->Collect(out);
      recovery_.Collect(out);
    });
  }
  AddCollectors();
  if (options.events != nullptr) {
    metrics_.AddCollector([hub = options.events](MetricWriter& out) { hub->Collect(out); });
  }
  housekeeper_ = std::make_unique<Housekeeper>(
      HousekeeperParts{&sessions_, &pins_, &namespaces_, &ops_, &matcher_, &l2_, &metrics_,
                       [this](const SessionRegistry::Removed& r, absl::string_view reason) {
                         EndSessionNow(r.session, r.last_of_instance, reason);
                       }},
      options.housekeeping_interval);
}

Cache::~Cache() {
  metrics_.RemoveCollectors();
  l2_.set_eviction_observer(nullptr);
  housekeeper_.reset();
  // Drains still running are cut short and their sessions end (their RPCs were answered or
  // cancelled when the server shut down); then the sessions still registered.
  ops_.FinishAllWaiters();
  closer_.Stop();
  for (SessionRegistry::Removed& r : sessions_.TakeAll()) {
    EndSessionNow(r.session, r.last_of_instance, "daemon shutdown");
  }
}

void Cache::StartL2(const CacheOptions& options) {
  L2RecoveryStats& r = l2_recovery_;
  if (options.journal != nullptr && options.journal_attached) {
    const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    r = RecoverL2(
        *options.pool, *options.journal, namespaces_, threads,
        [this](Namespace& ns) { recovery_.OnIndexed(ns); }, options.labels);
    KVLOG(Info, "l2 recovered",
          {{"warm", "true"},
           {"namespaces", r.namespaces},
           {"pages", r.pages},
           {"objects", r.objects},
           {"bytes", r.bytes},
           {"dropped", r.dropped()},
           {"dropped_in_flight", r.dropped_in_flight},
           {"dropped_unsealed", r.dropped_unsealed},
           {"dropped_torn", r.dropped_torn},
           {"dropped_checksum", r.dropped_checksum},
           {"dropped_mismatch", r.dropped_mismatch},
           {"dropped_orphan", r.dropped_orphan},
           {"labelled_pages", r.labelled_pages},
           {"seconds", absl::StrFormat("%.3f", r.seconds)}});
  } else {
    r.enabled = options.journal != nullptr;
    r.cold_reason = r.enabled ? options.cold_reason : "pool.shm_name is empty";
    KVLOG(Info, "l2 started empty", {{"warm", "false"}, {"reason", r.cold_reason}});
  }
  metrics_.AddCollector([this](MetricWriter& out) {
    CollectL2Recovery(l2_recovery_, out);
    const L2Sealer* sealer = l2_.sealer();
    out.AddGauge("kvcellar_l2_journal_pending_seals",
                 "L2 pages landed and waiting for the sealer's checksum (pool.shm_name): after a "
                 "SIGKILL these would not be recovered.",
                 sealer != nullptr ? sealer->pending() : 0);
    out.AddCounter("kvcellar_l2_journal_sealed_total",
                   "L2 pages the sealer checksummed and recorded for a warm restart.",
                   sealer != nullptr ? sealer->sealed() : 0);
    out.AddCounter("kvcellar_l2_journal_overflowed_total",
                   "L2 pages not queued for sealing (queue full): sealed only at shutdown.",
                   sealer != nullptr ? sealer->overflowed() : 0);
  });
}

void Cache::AddCollectors() {
  metrics_.AddCollector([this](MetricWriter& out) {
    size_t workers = 0;
    size_t schedulers = 0;
    for (const std::shared_ptr<Session>& s : sessions_.Snapshot()) {
      (s->info().is_worker() ? workers : schedulers)++;
    }
    const MetricWriter::Label worker[] = {{"role", "worker"}};
    const MetricWriter::Label scheduler[] = {{"role", "scheduler"}};
    out.AddGauge("kvcellar_sessions", "Live engine sessions, by role.", workers, worker);
    out.AddGauge("kvcellar_sessions", "Live engine sessions, by role.", schedulers, scheduler);
    out.AddGauge("kvcellar_instances", "Engine instances with a live session.",
                 sessions_.instances());
    out.AddGauge("kvcellar_namespaces", "Namespaces known to the daemon.", namespaces_.size());
    out.AddGauge("kvcellar_pins", "Live Match pins.", pins_.size());
    out.AddGauge("kvcellar_ops_in_flight", "Load and Backup ops not yet terminal.",
                 ops_.unfinished());
    const L2Usage l2 = GetL2Usage();
    const MetricWriter::Label resident[] = {{"state", "resident"}};
    const MetricWriter::Label in_flight[] = {{"state", "in_flight"}};
    out.AddGauge("kvcellar_l2_pages", "Pages with a committed shard in L2.", l2.pages);
    out.AddGauge("kvcellar_l2_objects",
                 "(page, shard) objects in L2: resident (committed) or in_flight (being written, "
                 "invisible).",
                 l2.objects, resident);
    out.AddGauge("kvcellar_l2_objects",
                 "(page, shard) objects in L2: resident (committed) or in_flight (being written, "
                 "invisible).",
                 l2.in_flight_objects, in_flight);
    out.AddGauge("kvcellar_l2_pinned_pages", "L2 pages pinned by a Match or a copy.",
                 l2.pinned_pages);
    out.AddGauge("kvcellar_l2_pinned_bytes",
                 "Pool slot bytes of pinned L2 pages' objects: not evictable now.",
                 l2.pinned_bytes);
    out.AddGauge("kvcellar_l2_in_flight_bytes",
                 "Pool slot bytes of L2 objects being written (Backup, Prefetch), not yet visible.",
                 l2.in_flight_bytes);
    out.AddGauge("kvcellar_l2_bytes", "Pool slot bytes held by L2 objects.", l2.bytes);
  });
  metrics_.AddCollector(
      [this, cap = static_cast<size_t>(config_.http.max_namespace_series)](MetricWriter& out) {
        CollectNamespaceMetrics(namespaces_.Snapshot(), cap, out);
        WriteTenantMetrics(TenantUsages(), cap, out);
      });
}

absl::StatusOr<std::shared_ptr<Session>> Cache::FindSession(uint64_t session_id) const {
  std::shared_ptr<Session> s = sessions_.Find(session_id, absl::Now());
  if (s == nullptr) return SessionUnknown(session_id);
  return s;
}

absl::Status Cache::CheckNotDraining() const {
  if (!draining_.load(std::memory_order_acquire)) return absl::OkStatus();
  return CacheError(absl::StatusCode::kUnavailable, v1::ERROR_REASON_NOT_READY, "",
                    "the daemon is shutting down; reconnect later");
}

void Cache::SetDraining() {
  draining_.store(true, std::memory_order_release);
  ops_.FinishAllWaiters();
}

Cache::Counts Cache::GetCounts() const {
  return {sessions_.sessions(), sessions_.instances(), namespaces_.size()};
}

Cache::L2Usage Cache::GetL2Usage() const {
  L2Usage u;
  for (const std::shared_ptr<Namespace>& ns : namespaces_.Snapshot()) {
    if (ns->index() == nullptr) continue;
    const core::RadixIndexStats s = ns->index()->Stats();
    u.pages += s.l2_pages;
    u.objects += s.l2_objects;
    u.in_flight_objects += s.l2_inflight_objects;
    u.in_flight_bytes += s.l2_inflight_bytes;
    u.pinned_pages += s.pinned_pages;
    u.pinned_bytes += s.pinned_bytes;
    u.bytes += s.l2_bytes;
  }
  return u;
}

void Cache::FillInfo(DaemonInfo* info) const {
  const Counts counts = GetCounts();
  info->sessions = counts.sessions;
  info->instances = counts.instances;
  info->namespaces = counts.namespaces;
  const L2Usage l2 = GetL2Usage();
  info->pool_pinned_bytes = l2.pinned_bytes;
  info->pool_in_flight_bytes = l2.in_flight_bytes;
  info->tenants = TenantUsages();
}

std::vector<TenantUsage> Cache::TenantUsages() const {
  return CollectTenantUsage(tenants_, namespaces_.Snapshot(), l2_.pool()->capacity_bytes());
}

void Cache::EndSession(std::shared_ptr<Session> session, bool last_of_instance,
                       absl::Duration drain, std::string reason,
                       std::function<void(const EndCounts&)> done) {
  auto end = std::make_unique<SessionEnd>();
  // No new op can start; the mapping stays usable by the ops already running.
  end->mapping = session->Close();
  end->inflight_before = session->inflight_ops();
  end->session = std::move(session);
  end->last_of_instance = last_of_instance;
  end->reason = std::move(reason);
  end->done = std::move(done);
  closer_.Close(std::move(end), absl::Now() + drain);
}

Cache::EndCounts Cache::EndSessionNow(const std::shared_ptr<Session>& session,
                                      bool last_of_instance, absl::string_view reason) {
  SessionEnd end;
  end.mapping = session->Close();
  end.inflight_before = session->inflight_ops();
  end.session = session;
  end.last_of_instance = last_of_instance;
  end.reason = std::string(reason);
  return FinishEnd(end);
}

Cache::EndCounts Cache::FinishEnd(SessionEnd& end) {
  const SessionInfo& info = end.session->info();
  EndCounts counts;
  std::vector<std::shared_ptr<OpRecord>> cancelled = ops_.CancelSessionOps(info.id);
  counts.ops_cancelled = static_cast<uint32_t>(cancelled.size());
  counts.ops_completed =
      end.inflight_before > counts.ops_cancelled ? end.inflight_before - counts.ops_cancelled : 0;
  // Closing the mapping waits for copies in progress and ends the ones not started: after this
  // the daemon never touches the engine's memory again.
  // A worker's mapping comes out of Close() once: release its hold on the geometry once too.
  const bool held_layout = info.is_worker() && end.mapping != nullptr;
  end.mapping.reset();
  if (held_layout) info.ns->ReleaseLayout();
  for (const std::shared_ptr<OpRecord>& op : cancelled) {
    if (op->device != nullptr) op->device->Wait(kCancelledOpWait);
    ops_.TryFinalize(*op);
  }
  if (end.last_of_instance) {
    counts.pins_released = static_cast<uint32_t>(pins_.ReleaseInstance(info.instance_id));
  } else if (info.is_worker()) {
    counts.pins_released = static_cast<uint32_t>(pins_.DropRankHolds(info.instance_id, info.rank));
  }
  KVLOG(Info, "session ended",
        {{"session_id", info.id},
         {"instance_id", info.instance_id},
         {"rank", info.rank},
         {"reason", end.reason},
         {"ops_completed", counts.ops_completed},
         {"ops_cancelled", counts.ops_cancelled},
         {"pins_released", counts.pins_released}});
  return counts;
}

}  // namespace kvcellar::server
