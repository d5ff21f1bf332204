// Daemon: kvcellard's process-level shell. Owns the listeners and the services behind them.
//
// Two gRPC servers: the engine server (Unix socket, optional TCP with TLS) serves CacheService,
// the read-only AdminService RPCs, health and reflection; the admin server (a separate Unix socket
// with tighter permissions) serves all of AdminService, including the RPCs that change state. An
// HTTP listener serves /metrics, /healthz and /readyz.
//
// Threads: Start() and Wait() from the main thread; Shutdown() from any thread (the signal
// thread), once or more.
#ifndef KVCELLAR_SERVER_DAEMON_H_
#define KVCELLAR_SERVER_DAEMON_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/host_pool.h"
#include "gpu/device_backend.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "platform/host_memory.h"
#include "server/admin/daemon_info.h"
#include "server/config/config.h"
#include "server/datapath/device_set.h"
#include "server/events/event_hub.h"
#include "server/events/label_log.h"
#include "server/l3/l3_tier_admin.h"
#include "server/l3/l3_tiers.h"
#include "server/metrics/metrics.h"
#include "server/rpc/malformed_request.h"
#include "server/rpc/peer_credentials.h"
#include "server/rpc/unix_listener.h"

namespace kvcellar::server {

class AdminServiceImpl;
class Cache;
class MetricsRegistry;
class CacheServiceImpl;
class HttpServer;
class MetricsRegistry;

class Daemon {
 public:
  // `config_file` is reported by GetConfig ("" when running on defaults and overrides).
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const Config& config,
                                                       std::string config_file);
  ~Daemon();

  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Stops accepting RPCs, lets in-flight ones finish until server.drain_timeout_ms, then cancels
  // the rest and stops the HTTP listener. Idempotent.
  void Shutdown();
  // Blocks until Shutdown() has completed.
  void Wait();

  // A consistent copy of the daemon's state; thread-safe.
  DaemonInfo Info() const;
  bool ready() const;

 private:
  Daemon(const Config& config, std::string config_file);
  absl::Status StartListeners();
  // The phases of StartListeners, in order.
  // The cache, its RPC service, and the admin services (engine-facing and operator-facing).
  // The KV event hub (config_.events): binds its ZMQ endpoints.
  absl::Status StartEvents();
  void CreateServices(MetricsRegistry& registry);
  // The engine-facing server (Unix socket, TCP when configured); returns the TCP address or
  // "none".
  absl::StatusOr<std::string> StartEngineServer();
  // The operator-facing server on the admin socket, unless there is none.
  absl::Status StartAdminServer();
  // The HTTP listener (metrics, health); returns its address or "none".
  absl::StatusOr<std::string> StartHttpServer(MetricsRegistry& registry);
  // Message size and interceptors, the same for every gRPC server.
  void ConfigureServer(grpc::ServerBuilder& builder);
  void AddListener(ListenerInfo listener);

  absl::Status CreateHostPool();
  // With pool.shm_name: maps the pool's slot journal beside it (core/slot_journal.h) and decides
  // whether this start is warm (pool and journal re-attached, same geometry) or why not.
  absl::Status AttachJournal();
  // The pool's and the journal's shm objects, which no engine may register as its memory.
  std::vector<platform::DaemonObject> DaemonObjects() const;
  // The device backend of config device.kind, with the host pool registered with it; with a CUDA
  // primary and device.host_memory_engines, also a sim backend for host-memory engines.
  absl::Status CreateDeviceBackend();
  // Opens events.label_log when events publish; an "auto" log that cannot open is skipped
  // (logged), a named one that cannot is a startup error.
  absl::Status OpenLabelLog();

  const Config config_;
  // The pool's memory, mapped per pool.*; unmapped last, after everything that uses the pool.
  std::unique_ptr<platform::HostMemory> pool_memory_;
  std::unique_ptr<core::HostPool> pool_;  // Carves pool_memory_.
  // The pool's journal and its memory (nullptr without pool.shm_name); outlive the pool's users.
  std::unique_ptr<platform::HostMemory> journal_memory_;
  std::unique_ptr<core::SlotJournal> journal_;
  bool journal_attached_ = false;  // Warm start: recover L2 from journal_.
  std::string cold_reason_;        // Otherwise, why L2 starts empty.
  std::unique_ptr<gpu::DeviceBackend> device_;  // Destroyed after the service, before the pool.
  std::vector<void*> registered_chunks_;        // Pool chunks registered with device_.
  // The sim backend serving DEVICE_KIND_SIM engines beside a CUDA device_, or nullptr. Destroyed
  // with device_.
  std::unique_ptr<gpu::DeviceBackend> host_memory_device_;
  DeviceSet devices_;  // device_ first, then host_memory_device_ if any.
  // L3 backends: destroyed after the service (whose writes and reads they complete), before the
  // pool (whose slots their I/O reads and writes).
  std::unique_ptr<L3Tiers> l3_;
  // KV events: the indexes report to it, WatchEvents streams watch it; outlives both.
  std::unique_ptr<EventHub> events_;
  // Pages' labels kept for a restart (events.label_log), or nullptr; outlives the cache.
  std::unique_ptr<LabelLog> labels_;
  std::unique_ptr<Cache> cache_;  // The composition root; outlives its service.
  PeerCredentials peer_credentials_;  // Of engine-socket connections; outlives the service.
  // Requests that do not parse, on every server: outlives them.
  MalformedRequestLog malformed_requests_{&DefaultRegistry()};
  std::unique_ptr<CacheServiceImpl> cache_service_;
  std::unique_ptr<L3TierAdmin> l3_admin_;  // nullptr without L3 tiers.
  std::unique_ptr<AdminServiceImpl> engine_admin_service_;  // Read-only RPCs.
  std::unique_ptr<AdminServiceImpl> admin_service_;         // All RPCs.
  std::unique_ptr<grpc::Server> engine_server_;
  // Accepts the engine socket's connections for engine_server_: stops before the server goes.
  std::unique_ptr<UnixListener> unix_listener_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::unique_ptr<HttpServer> http_server_;
  std::string unix_socket_;
  std::optional<std::string> admin_socket_;

  mutable absl::Mutex mu_;
  // Listeners are added while the first ones already serve GetStatus: guarded.
  DaemonInfo info_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stopped_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_DAEMON_H_
