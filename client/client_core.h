// ClientCore: what every session of one Client shares: the channel and stub, the options, the
// failure counters and the heartbeat thread. Internal to libkvcellar-client.
//
// The heartbeat thread calls SessionImpl::Tick on every live session whenever one is due (or
// Wake() asks): that renews leases, probes a suspect daemon and re-registers lost sessions, with
// backoff. It holds sessions by weak_ptr, so a Session dropped by the engine simply disappears.
//
// Threading: thread-safe. Counters are relaxed atomics (monotonic, read by stats()).
#ifndef KVCELLAR_CLIENT_CLIENT_CORE_H_
#define KVCELLAR_CLIENT_CLIENT_CORE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client_types.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"

namespace kvcellar::client {

class SessionImpl;

struct StatsCounters {
  std::atomic<uint64_t> rpcs_ok{0};
  std::atomic<uint64_t> rpcs_failed{0};
  std::atomic<uint64_t> rpcs_unavailable{0};
  std::atomic<uint64_t> rpcs_deadline_exceeded{0};
  std::atomic<uint64_t> rpcs_unimplemented{0};
  std::atomic<uint64_t> degraded_calls{0};
  std::atomic<uint64_t> match_calls{0};
  std::atomic<uint64_t> match_pages{0};
  std::atomic<uint64_t> match_l2_hit_pages{0};
  std::atomic<uint64_t> keyed_pages{0};
  std::atomic<uint64_t> keyed_pages_reused{0};
  std::atomic<uint64_t> registrations{0};
  std::atomic<uint64_t> reregistrations{0};
  std::atomic<uint64_t> registration_failures{0};
  std::atomic<uint64_t> sessions_lost{0};
  std::atomic<uint64_t> heartbeats_ok{0};
  std::atomic<uint64_t> heartbeats_failed{0};
  std::atomic<uint64_t> ns_digest_mismatches{0};
  std::atomic<uint64_t> ops_failed_session_lost{0};
  std::atomic<uint64_t> uncertain_submissions{0};

  static void Add(std::atomic<uint64_t>& c, uint64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  ClientStats Snapshot() const;
};

class ClientCore {
 public:
  ClientCore(ClientOptions options, std::string target, std::shared_ptr<grpc::Channel> channel);
  ~ClientCore();
  ClientCore(const ClientCore&) = delete;
  ClientCore& operator=(const ClientCore&) = delete;

  const ClientOptions& options() const { return options_; }
  const std::string& target() const { return target_; }
  v1::CacheService::Stub& stub() { return *stub_; }
  StatsCounters& stats() { return stats_; }

  // Sets the deadline (now + timeout) on a fresh context.
  static void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout);
  // Counts an RPC outcome in stats().
  void CountRpc(const grpc::Status& status);

  // Heartbeat thread. Start() is a no-op when options().heartbeat is false.
  void Start();
  void Stop();
  void Track(std::weak_ptr<SessionImpl> session);
  // Runs the due session work now (a call failed, a session was lost).
  void Wake();

 private:
  void Loop();

  const ClientOptions options_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CacheService::Stub> stub_;
  StatsCounters stats_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::weak_ptr<SessionImpl>> sessions_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_CLIENT_CORE_H_
