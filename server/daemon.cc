#include "server/daemon.h"

#include <sys/stat.h>

#include <limits>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/host_pool.h"
#include "core/slot_journal.h"
#include "gpu/device_factory.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "platform/host_memory.h"
#include "platform/huge_pages.h"
#include "platform/log.h"
#include "server/build_info.h"
#include "server/metrics/http_server.h"
#include "server/metrics/metrics.h"
#include "server/metrics/process_metrics.h"
#include "server/rpc/admin_service.h"
#include "server/rpc/cache_service.h"
#include "server/rpc/malformed_request.h"
#include "server/rpc/rpc_metrics.h"
#include "server/rpc/tls.h"
#include "server/rpc/unix_socket.h"

namespace kvcellar::server {
namespace {

// Sockets are created by gRPC with 0777 & ~umask. Bind them owner-only, then widen to the
// configured mode: no window in which a socket is more open than configured.
constexpr mode_t kOwnerOnlyUmask = 0177;

ListenerInfo::Security TcpSecurity(TlsMode mode) {
  switch (mode) {
    case TlsMode::kPlaintext: return ListenerInfo::Security::kPlaintext;
    case TlsMode::kTls: return ListenerInfo::Security::kTls;
    case TlsMode::kMtls: return ListenerInfo::Security::kMtls;
  }
  return ListenerInfo::Security::kPlaintext;
}

// "host:port" with the port gRPC actually bound (the config may say port 0).
std::string WithPort(const std::string& address, int port) {
  size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon), ":", port);
}

}  // namespace

Daemon::Daemon(const Config& config, std::string config_file) : config_(config) {
  info_.start_time = absl::Now();
  info_.epoch = absl::Uniform<uint64_t>(absl::BitGen());
  info_.config_digest = ConfigDigest(config);
  info_.config_file = std::move(config_file);
}

Daemon::~Daemon() {
  Shutdown();
  // The services must outlive the servers, the device its mappings (held by the cache service),
  // and the pool everything that copies into it.
  unix_listener_.reset();
  engine_server_.reset();
  admin_server_.reset();
  l3_admin_.reset();
  cache_service_.reset();
  cache_.reset();
  if (device_ != nullptr) {
    for (void* chunk : registered_chunks_) {
      if (absl::Status s = device_->UnregisterHostMemory(chunk); !s.ok()) {
        KVLOG(Warn, "host pool unregister failed", {{"error", s.ToString()}});
      }
    }
  }
  host_memory_device_.reset();
  device_.reset();
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const Config& config,
                                                      std::string config_file) {
  std::unique_ptr<Daemon> daemon(new Daemon(config, std::move(config_file)));
  absl::Status status = daemon->StartListeners();
  if (!status.ok()) {
    daemon->Shutdown();
    return status;
  }
  return daemon;
}

absl::Status Daemon::StartListeners() {
  MetricsRegistry& registry = DefaultRegistry();
  if (absl::Status s = RegisterBuildInfo(registry, kVersion, kGitCommit, kBuildType, kCudaEnabled);
      !s.ok()) {
    return s;
  }
  RegisterProcessCollector(registry);
  if (absl::Status s = CreateHostPool(); !s.ok()) return s;
  if (absl::Status s = CreateDeviceBackend(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<L3Tiers>> l3 = L3Tiers::Open(config_.storage);
  if (!l3.ok()) return l3.status();
  l3_ = *std::move(l3);
  if (absl::Status s = StartEvents(); !s.ok()) return s;
  if (absl::Status s = OpenLabelLog(); !s.ok()) return s;
  CreateServices(registry);

  unix_socket_ = ResolveUnixSocketPath(config_);
  admin_socket_ = ResolveAdminSocketPath(config_);
  if (absl::Status s = PrepareUnixSocketPath(unix_socket_); !s.ok()) return s;
  if (admin_socket_) {
    if (absl::Status s = PrepareUnixSocketPath(*admin_socket_); !s.ok()) return s;
  }
  // Before any request can arrive: protobuf's parse errors go to KVLOG, not raw to stderr.
  InstallProtobufLogHandler();
  absl::StatusOr<std::string> tcp_address = StartEngineServer();
  if (!tcp_address.ok()) return tcp_address.status();
  if (absl::Status s = StartAdminServer(); !s.ok()) return s;
  absl::StatusOr<std::string> http_address = StartHttpServer(registry);
  if (!http_address.ok()) return http_address.status();

  for (grpc::Server* server : {engine_server_.get(), admin_server_.get()}) {
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(true);
  }
  std::string digest;
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
    digest = info_.config_digest;
  }
  KVLOG(Info, "ready",
        {{"version", kVersion},
         {"socket", unix_socket_},
         {"admin_socket", admin_socket_.value_or("none")},
         {"tcp", *tcp_address},
         {"http", *http_address},
         {"config_digest", digest}});
  return absl::OkStatus();
}

std::vector<platform::DaemonObject> Daemon::DaemonObjects() const {
  std::vector<platform::DaemonObject> out;
  for (const auto& [memory, what] : {std::pair{pool_memory_.get(), "the daemon's L2 pool"},
                                     std::pair{journal_memory_.get(), "the daemon's L2 journal"}}) {
    if (memory == nullptr || memory->shm_fd() < 0) continue;
    // The descriptor is open and ours: fstat fails only on a broken process.
    absl::StatusOr<platform::FileId> id = platform::FileId::OfFd(memory->shm_fd());
    if (id.ok()) out.push_back({*id, what});
  }
  return out;
}

void Daemon::CreateServices(MetricsRegistry& registry) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  CacheOptions cache_options;
  cache_options.config = config_;
  cache_options.pool = pool_.get();
  cache_options.journal = journal_.get();
  cache_options.journal_attached = journal_attached_;
  cache_options.cold_reason = cold_reason_;
  cache_options.devices = devices_;
  cache_options.l3 = l3_.get();
  cache_options.metrics = &registry;
  cache_options.events = events_.get();
  cache_options.daemon_objects = DaemonObjects();
  {
    absl::MutexLock lock(&mu_);
    cache_options.daemon_epoch = info_.epoch;
  }
  cache_options.labels = labels_.get();
  cache_ = std::make_unique<Cache>(std::move(cache_options));
  if (labels_ != nullptr) {
    // Compaction rewrites the log from every index's labels; recovered labels not yet taken are
    // kept until the L3 tiers' scans have entered the indexes.
    labels_->SetSnapshot(
        [cache = cache_.get()](LabelLog::Emit emit) {
          for (const std::shared_ptr<Namespace>& ns : cache->namespaces().Snapshot()) {
            const core::RadixIndex* index = ns->index();
            if (index == nullptr) continue;
            index->ForEachLabel(
                [&](const core::PageKey& key, const std::shared_ptr<const core::PageLabel>& l) {
                  emit(ns->digest(), key, l);
                });
          }
        },
        [cache = cache_.get()] { return !cache->l3_recovery().Settled(); });
  }
  cache_service_ = std::make_unique<CacheServiceImpl>(cache_.get(), &peer_credentials_);
  if (!l3_->empty()) {
    l3_admin_ = std::make_unique<L3TierAdmin>(l3_.get(), &cache_->namespaces());
  }
  auto info = [this] { return Info(); };
  // Without L3 tiers the admin services get no L3Admin (nullptr): TIER_L3 reports nothing.
  engine_admin_service_ = std::make_unique<AdminServiceImpl>(
      info, config_, /*allow_mutations=*/false, &cache_->admin(), l3_admin_.get(), events_.get());
  admin_service_ = std::make_unique<AdminServiceImpl>(
      info, config_, /*allow_mutations=*/true, &cache_->admin(), l3_admin_.get(), events_.get());
}

absl::Status Daemon::OpenLabelLog() {
  const std::string& setting = config_.events.label_log;
  // Labels exist only while events publish (CacheLimits::label_pages).
  if (config_.events.endpoint.empty() || setting == "off") return absl::OkStatus();
  const bool automatic = setting == "auto";
  if (automatic && config_.pool.shm_name.empty()) return absl::OkStatus();
  LabelLogOptions options;
  options.path = automatic ? absl::StrCat("/dev/shm/",
                                          absl::StripPrefix(config_.pool.shm_name, "/"), ".labels")
                           : setting;
  options.max_recovered_bytes = config_.events.max_token_bytes == 0
                                    ? std::numeric_limits<uint64_t>::max()
                                    : config_.events.max_token_bytes;
  absl::StatusOr<std::unique_ptr<LabelLog>> log = LabelLog::Open(options);
  if (!log.ok()) {
    if (!automatic) return log.status();
    KVLOG(Warn, "label log not kept: recovered pages are announced without tokens",
          {{"path", options.path}, {"error", log.status().message()}});
    return absl::OkStatus();
  }
  labels_ = *std::move(log);
  DefaultRegistry().AddCollector([log = labels_.get()](MetricWriter& out) {
    const LabelLogStats s = log->Stats();
    out.AddGauge("kvcellar_label_log_bytes",
                 "Size of the label log (events.label_log): pages' tokens kept for a restart.",
                 static_cast<double>(s.file_bytes));
    out.AddCounter("kvcellar_label_log_appended_total",
                   "Page labels written to the label log since the start.",
                   static_cast<double>(s.appended));
    out.AddGauge("kvcellar_label_log_recovered",
                 "Page labels read back from the label log at the start.",
                 static_cast<double>(s.recovered));
    out.AddCounter("kvcellar_label_log_restored_total",
                   "Recovered pages given their label back (L2 warm restart, L3 scans).",
                   static_cast<double>(s.taken));
    out.AddCounter("kvcellar_label_log_errors_total",
                   "Label log writes that failed (those pages are announced without tokens after "
                   "a restart).",
                   static_cast<double>(s.write_errors));
  });
  return absl::OkStatus();
}

absl::Status Daemon::StartEvents() {
  const EventsConfig& c = config_.events;
  EventHubOptions o;
  o.endpoint = c.endpoint;
  o.replay_endpoint = c.replay_endpoint;
  o.topic = c.topic;
  o.node = c.node;
  o.buffer_steps = c.buffer_steps;
  o.hwm = c.hwm;
  o.max_queue_size = c.max_queue_size;
  o.batch_interval = absl::Milliseconds(c.batch_interval_ms);
  o.int_hashes = c.block_hashes == EventsConfig::BlockHashes::kInt;
  o.per_tier_media = c.storage_media == EventsConfig::StorageMedia::kPerTier;
  o.heartbeat = absl::Milliseconds(c.heartbeat_ms);
  for (size_t i = 0; i < l3_->size(); ++i) {
    o.l3_tiers.push_back({l3_->tier(i).spec.name, l3_->tier(i).shared});
  }
  absl::StatusOr<std::unique_ptr<EventHub>> hub = EventHub::Start(std::move(o));
  if (!hub.ok()) return hub.status();
  events_ = *std::move(hub);
  return absl::OkStatus();
}

void Daemon::ConfigureServer(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.server.max_message_bytes));
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  // First: server interceptors see PRE_SEND_STATUS in list order, and the metrics should count
  // the INVALID_ARGUMENT a malformed request is given, not gRPC's UNIMPLEMENTED.
  factories.push_back(std::make_unique<MalformedRequestInterceptorFactory>(&malformed_requests_));
  factories.push_back(std::make_unique<RpcMetricsInterceptorFactory>(&DefaultRegistry()));
  builder.experimental().SetInterceptorCreators(std::move(factories));
}

absl::StatusOr<std::string> Daemon::StartEngineServer() {
  // Engine server: the Unix socket (accepted by unix_listener_, which knows each peer's
  // credentials), and TCP when configured.
  grpc::ServerBuilder engine;
  ConfigureServer(engine);
  int tcp_port = 0;
  if (!config_.listen.tcp_address.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
        MakeServerCredentials(config_.tls);
    if (!creds.ok()) return creds.status();
    engine.AddListeningPort(config_.listen.tcp_address, *creds, &tcp_port);
  }
  engine.RegisterService(cache_service_.get());
  engine.RegisterService(engine_admin_service_.get());

  engine_server_ = engine.BuildAndStart();
  if (engine_server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", config_.listen.tcp_address,
                     "' (listen.tcp_address: address in use, or a bad address)"));
  }
  absl::StatusOr<std::unique_ptr<UnixListener>> listener = UnixListener::Start(
      unix_socket_, engine_server_.get(), &peer_credentials_,
      static_cast<size_t>(config_.listen.max_connections_per_uid), &DefaultRegistry());
  if (!listener.ok()) return listener.status();
  unix_listener_ = *std::move(listener);
  if (!config_.listen.tcp_address.empty() && tcp_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", config_.listen.tcp_address, "' (listen.tcp_address)"));
  }
  if (absl::Status s = SecureUnixSocket(unix_socket_, config_.listen.unix_socket_mode,
                                        config_.listen.unix_socket_group);
      !s.ok()) {
    return s;
  }
  std::string tcp_address = "none";
  AddListener({ListenerInfo::Kind::kUnix, unix_socket_, ListenerInfo::Security::kUnixPermissions});
  if (tcp_port != 0) {
    tcp_address = WithPort(config_.listen.tcp_address, tcp_port);
    AddListener({ListenerInfo::Kind::kTcp, tcp_address, TcpSecurity(config_.tls.mode)});
  }
  return tcp_address;
}

absl::Status Daemon::StartAdminServer() {
  // Admin server: its own socket, owner-only by default.
  if (!admin_socket_) return absl::OkStatus();
  grpc::ServerBuilder admin;
  ConfigureServer(admin);
  admin.AddListeningPort(absl::StrCat("unix:", *admin_socket_), grpc::InsecureServerCredentials());
  admin.RegisterService(admin_service_.get());
  const mode_t old_umask = ::umask(kOwnerOnlyUmask);
  admin_server_ = admin.BuildAndStart();
  ::umask(old_umask);
  if (admin_server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on unix:", *admin_socket_));
  }
  if (absl::Status s = SecureUnixSocket(*admin_socket_, config_.listen.admin_socket_mode, "");
      !s.ok()) {
    return s;
  }
  AddListener(
      {ListenerInfo::Kind::kAdmin, *admin_socket_, ListenerInfo::Security::kUnixPermissions});
  return absl::OkStatus();
}

absl::StatusOr<std::string> Daemon::StartHttpServer(MetricsRegistry& registry) {
  if (config_.http.address.empty()) return std::string("none");
  absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
      config_.http.address, &registry, [this] { return ready(); }, [] { return true; });
  if (!http.ok()) return http.status();
  http_server_ = std::move(*http);
  std::string http_address = WithPort(config_.http.address, http_server_->port());
  AddListener({ListenerInfo::Kind::kHttp, http_address, ListenerInfo::Security::kPlaintext});
  return http_address;
}

void Daemon::AddListener(ListenerInfo listener) {
  absl::MutexLock lock(&mu_);
  info_.listeners.push_back(std::move(listener));
}

DaemonInfo Daemon::Info() const {
  absl::MutexLock lock(&mu_);
  DaemonInfo info = info_;
  if (pool_ != nullptr) {
    info.pool_capacity_bytes = pool_->capacity_bytes();
    for (const core::SizeClassStats& c : pool_->Stats()) info.pool_used_bytes += c.bytes_used;
    info.pool_huge_pages = pool_memory_->backing() != platform::HugePageBacking::kNone;
  }
  if (cache_ != nullptr) {
    cache_->FillInfo(&info);
    info.l2_recovery = cache_->l2_recovery();
  }
  if (device_ != nullptr) info.device_kind = std::string(device_->name());
  if (l3_ != nullptr) {
    const std::vector<L3ScanStats> recovery =
        cache_ != nullptr ? cache_->l3_recovery().Stats() : std::vector<L3ScanStats>();
    for (size_t i = 0; i < l3_->size(); ++i) {
      const L3Tier& t = l3_->tier(i);
      const storage::BackendStats s = t.backend->Stats();
      info.l3_tiers.push_back({t.spec.name, std::string(L3TierKindName(t.spec.kind)), s.healthy,
                               s.used_bytes, s.capacity_bytes, s.last_error, s.last_error_unix_ms,
                               i < recovery.size() ? recovery[i] : L3ScanStats()});
    }
  }
  info.ready = started_ && !shutting_down_;
  info.draining = shutting_down_;
  return info;
}

absl::Status Daemon::CreateHostPool() {
  platform::HostMemoryOptions memory;
  memory.shm_name = config_.pool.shm_name;
  // A pool of another capacity starts empty (AttachJournal says why) rather than not at all.
  memory.recreate_on_size_change = true;
  switch (config_.pool.huge_pages) {
    case HugePages::kAuto: memory.huge_pages = platform::HugePages::kAuto; break;
    case HugePages::kOn: memory.huge_pages = platform::HugePages::kOn; break;
    case HugePages::kOff: memory.huge_pages = platform::HugePages::kOff; break;
  }
  core::HostPoolOptions options;
  options.capacity_bytes = config_.pool.capacity;
  options.region_bytes = config_.pool.region_size;
  // huge_pages=on maps hugetlb pages or fails, and the pool's regions must be whole ones.
  if (memory.huge_pages == platform::HugePages::kOn) {
    options.huge_page_bytes = platform::HugePageBytes();
  }
  auto pool_error = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("host pool (pool.*): ", s.message()));
  };
  // The pool's options are checked before anything is mapped; then the memory, then the pool.
  absl::StatusOr<uint64_t> bytes = core::HostPool::MemoryBytes(options);
  if (!bytes.ok()) return pool_error(bytes.status());
  memory.bytes = *bytes;
  absl::StatusOr<std::unique_ptr<platform::HostMemory>> mapped = platform::HostMemory::Map(memory);
  if (!mapped.ok()) return pool_error(mapped.status());
  pool_memory_ = *std::move(mapped);
  absl::StatusOr<std::unique_ptr<core::HostPool>> pool =
      core::HostPool::Create(options, pool_memory_->bytes());
  if (!pool.ok()) return pool_error(pool.status());
  pool_ = std::move(*pool);
  if (!config_.pool.shm_name.empty()) {
    if (absl::Status s = AttachJournal(); !s.ok()) return pool_error(s);
  }
  KVLOG(Info, "host pool mapped",
        {{"capacity_bytes", pool_->capacity_bytes()},
         {"region_bytes", pool_->region_bytes()},
         {"backing", platform::HugePageBackingName(pool_memory_->backing())},
         {"shm_name", config_.pool.shm_name.empty() ? "none" : config_.pool.shm_name},
         {"reattached", pool_memory_->reattached() ? "true" : "false"}});

  // Pool occupancy, read from the pool at scrape time. One series per size class in use: at
  // most the pool's class count (tens), a bounded label set.
  DefaultRegistry().AddCollector([pool = pool_.get()](MetricWriter& out) {
    out.AddGauge("kvcellar_pool_capacity_bytes", "Bytes of host memory in the L2 pool.",
                 static_cast<double>(pool->capacity_bytes()));
    out.AddGauge("kvcellar_pool_free_regions",
                 "Regions of the L2 pool not assigned to any size class.",
                 static_cast<double>(pool->FreeRegions()));
    for (const core::SizeClassStats& c : pool->Stats()) {
      if (c.regions == 0) continue;
      std::string slot = absl::StrCat(c.slot_bytes);
      const MetricWriter::Label labels[] = {{"slot_bytes", slot}};
      out.AddGauge("kvcellar_pool_used_bytes", "Bytes of L2 pool slots holding pages, by slot size.",
                   static_cast<double>(c.bytes_used), labels);
      out.AddGauge("kvcellar_pool_class_capacity_bytes",
                   "Bytes of pool regions assigned to a size class: its capacity until more "
                   "free regions are assigned to it.",
                   static_cast<double>(c.regions * pool->region_bytes()), labels);
      out.AddGauge("kvcellar_pool_slots", "L2 pool slots carved for a size class.",
                   static_cast<double>(c.slots_total), labels);
      out.AddGauge("kvcellar_pool_slots_used", "L2 pool slots in use, by slot size.",
                   static_cast<double>(c.slots_used), labels);
    }
  });
  return absl::OkStatus();
}

absl::Status Daemon::AttachJournal() {
  const core::SlotJournalGeometry geometry = core::SlotJournalGeometry::Of(*pool_);
  absl::StatusOr<uint64_t> bytes = core::SlotJournal::Bytes(geometry);
  if (!bytes.ok()) return bytes.status();
  platform::HostMemoryOptions memory;
  // Whole base pages; never huge pages: it is small, and re-attached by size.
  memory.bytes = (*bytes + 4095) / 4096 * 4096;
  memory.huge_pages = platform::HugePages::kOff;
  memory.shm_name = absl::StrCat(config_.pool.shm_name, ".journal");
  memory.recreate_on_size_change = true;
  absl::StatusOr<std::unique_ptr<platform::HostMemory>> mapped = platform::HostMemory::Map(memory);
  if (!mapped.ok()) {
    return absl::Status(mapped.status().code(),
                        absl::StrCat("slot journal: ", mapped.status().message()));
  }
  journal_memory_ = *std::move(mapped);
  const std::span<uint8_t> journal_bytes = journal_memory_->bytes();
  if (!pool_memory_->reattached()) {
    cold_reason_ =
        pool_memory_->previous_bytes() != 0
            ? absl::StrCat("pool.capacity changed: the pool's shm object had ",
                           pool_memory_->previous_bytes(), " bytes, the pool now maps ",
                           pool_memory_->size())
            : "the pool's shm object was created (first start, or it was removed: a reboot "
              "clears /dev/shm)";
  } else if (!journal_memory_->reattached()) {
    cold_reason_ = "the pool's journal was missing or of another size";
  } else {
    absl::StatusOr<std::unique_ptr<core::SlotJournal>> attached =
        core::SlotJournal::Attach(geometry, journal_bytes);
    if (attached.ok()) {
      journal_ = *std::move(attached);
      journal_attached_ = true;
    } else {
      cold_reason_ = std::string(attached.status().message());
    }
  }
  if (journal_ == nullptr) {
    absl::StatusOr<std::unique_ptr<core::SlotJournal>> formatted =
        core::SlotJournal::Format(geometry, journal_bytes);
    if (!formatted.ok()) return formatted.status();
    journal_ = *std::move(formatted);
  }
  pool_->set_journal(journal_.get());
  return absl::OkStatus();
}

absl::Status Daemon::CreateDeviceBackend() {
  // Each cudaHostRegister call pins and maps its range; 1 GiB chunks keep one call short and the
  // number of calls small for pools of hundreds of GiB (the sim device ignores registration).
  constexpr uint64_t kRegisterChunkBytes = core::kGiB;
  gpu::DeviceBackendOptions options;
  switch (config_.device.kind) {
    case DeviceKind::kAuto: options.kind = gpu::DeviceKind::kAuto; break;
    case DeviceKind::kCuda: options.kind = gpu::DeviceKind::kCuda; break;
    case DeviceKind::kSim: options.kind = gpu::DeviceKind::kSim; break;
  }
  switch (config_.device.cuda_copy_path) {
    case CudaCopyPath::kCopyEngine:
      options.cuda.copy_path = gpu::CudaDeviceOptions::CopyPath::kMemcpy;
      break;
    case CudaCopyPath::kKernel:
      options.cuda.copy_path = gpu::CudaDeviceOptions::CopyPath::kKernel;
      break;
    case CudaCopyPath::kAuto:
      options.cuda.copy_path = gpu::CudaDeviceOptions::CopyPath::kAuto;
      break;
  }
  absl::StatusOr<std::unique_ptr<gpu::DeviceBackend>> device = gpu::CreateDeviceBackend(options);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrCat("device backend (device.kind): ", device.status().message()));
  }
  device_ = *std::move(device);
  absl::Status registered =
      pool_->ForEachChunk(kRegisterChunkBytes, [this](void* base, uint64_t bytes) {
        absl::Status s = device_->RegisterHostMemory(base, bytes);
        if (s.ok()) registered_chunks_.push_back(base);
        return s;
      });
  if (!registered.ok()) {
    return absl::Status(registered.code(), absl::StrCat("registering the host pool with the ",
                                                        device_->name(), " device: ",
                                                        registered.message()));
  }
  devices_ = DeviceSet(device_.get());
  // Engines whose KV lives in host shared memory need no GPU: with the sim primary they are
  // served already; beside CUDA they get a sim backend of their own. The pool is not registered
  // with it (the sim device copies from any host memory).
  if (KindOf(device_.get()) == v1::DEVICE_KIND_CUDA && config_.device.host_memory_engines) {
    absl::StatusOr<std::unique_ptr<gpu::SimDevice>> sim = gpu::SimDevice::Create({});
    if (!sim.ok()) {
      return absl::Status(sim.status().code(),
                          absl::StrCat("host-memory device (device.host_memory_engines): ",
                                       sim.status().message()));
    }
    host_memory_device_ = *std::move(sim);
    if (absl::Status s = devices_.Add(host_memory_device_.get()); !s.ok()) return s;
  }
  KVLOG(Info, "device backend ready",
        {{"device", device_->name()},
         {"serves", devices_.KindNames()},
         {"pool_chunks", registered_chunks_.size()}});
  return absl::OkStatus();
}

bool Daemon::ready() const {
  absl::MutexLock lock(&mu_);
  return started_ && !shutting_down_;
}

void Daemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  // Engines learn it from Heartbeat; new data ops are refused; waiting WaitOps return now.
  if (cache_ != nullptr) cache_->SetDraining();
  absl::Time start = absl::Now();
  std::chrono::system_clock::time_point deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(config_.server.drain_timeout_ms);
  for (grpc::Server* server : {engine_server_.get(), admin_server_.get()}) {
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(false);
  }
  // Shutdown(deadline) stops accepting at once, waits for in-flight RPCs until the deadline and
  // cancels whatever is still running then. Both servers share one deadline.
  if (unix_listener_) unix_listener_->Stop();  // No new engine connections.
  if (engine_server_) engine_server_->Shutdown(deadline);
  if (admin_server_) admin_server_->Shutdown(deadline);
  if (http_server_) http_server_->Stop();
  if (engine_server_) RemoveUnixSocket(unix_socket_);
  if (admin_server_ && admin_socket_) RemoveUnixSocket(*admin_socket_);
  KVLOG(Info, "drained", {{"drain_ms", absl::ToInt64Milliseconds(absl::Now() - start)}});
  stopped_.Notify();
}

void Daemon::Wait() { stopped_.WaitForNotification(); }

}  // namespace kvcellar::server
