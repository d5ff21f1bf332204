// Housekeeper: the cache's periodic pass. Every interval it reaps sessions whose lease lapsed
// (their ops cancelled, pins dropped, mappings closed, through the cache's EndSessionNow), expires
// pin leases and the index's lapsed page pins, forgets old op results and memoized Match answers,
// frees pages an admin Clear doomed once their copies ended, and evicts L2 down to the low
// watermark when the pool is above the high one.
//
// Threads: one thread of its own runs the pass; RunOnce may also be called from any thread
// (tests). Destruction stops and joins the thread.
#ifndef KVCELLAR_SERVER_CACHE_HOUSEKEEPER_H_
#define KVCELLAR_SERVER_CACHE_HOUSEKEEPER_H_

#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/datapath/matcher.h"
#include "server/l2/l2_space.h"
#include "server/metrics/cache_metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/op_table.h"
#include "server/session/pin_table.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

// What the pass works on; every pointer outlives the housekeeper.
struct HousekeeperParts {
  SessionRegistry* sessions = nullptr;
  PinTable* pins = nullptr;
  NamespaceRegistry* namespaces = nullptr;
  OpTable* ops = nullptr;
  Matcher* matcher = nullptr;
  L2Space* l2 = nullptr;
  CacheMetrics* metrics = nullptr;
  // Ends a session already removed from the registry (Cache::EndSessionNow: no drain, so it
  // waits only for the device to end the ops it cancels).
  std::function<void(const SessionRegistry::Removed&, absl::string_view reason)> end_session;
};

class Housekeeper {
 public:
  // Starts the thread, which runs the pass every `interval`.
  Housekeeper(HousekeeperParts parts, absl::Duration interval);
  ~Housekeeper();
  Housekeeper(const Housekeeper&) = delete;
  Housekeeper& operator=(const Housekeeper&) = delete;

  // One pass now.
  void RunOnce();

 private:
  void Loop();

  const HousekeeperParts parts_;
  const absl::Duration interval_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CACHE_HOUSEKEEPER_H_
