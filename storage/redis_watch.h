// RedisRemovalWatch: tells a running daemon which of a Redis tier's objects Redis removed by itself
// (a TTL ran out, maxmemory evicted it), so that the index drops them at once and announces
// BlockRemoved on the tier's medium (server/l3/l3_recovery.h), as a file tier's own removals do.
// Without it such a page stays an L3 hit in the index until a prefetch misses it.
//
// How: Redis keyspace notifications. On every primary a connection SUBSCRIBEs to
//   __keyevent@0__:expired   and   __keyevent@0__:evicted
// and each message names one key; those under the tier's key prefix that parse as an object name
// ("<prefix><ns16>:<key64>:<shard>", storage/object_name.h) are handed to the sink, batched
// (what one read brought, at most kMaxBatch). Keys of the tier's index hashes and of anyone
// else are ignored.
//
// Notifications are off on a stock server (notify-keyspace-events ""). With `configure`, the
// watch adds the classes it needs (E, x, e) to what the server has, with CONFIG SET, keeping the
// others; a server that refuses CONFIG (managed services rename it) is logged once, naming the
// setting the operator must make, and the watch subscribes anyway.
//
// Pub/sub is fire and forget: a message published while a connection is down is lost. The
// connection comes back within `retry`, and what was lost meanwhile is found as before: a
// prefetch that misses removes the page from the index, and the next start's readback prunes
// the tier's index.
//
// Nodes: `nodes` is called at start and every `refresh`; one connection (and thread) per node it
// names, started and stopped as the list changes (a cluster failover promotes a replica).
//
// Threads: a supervisor thread and one per node; the sink runs on a node's thread, one call at a
// time per node.
#ifndef KVCELLAR_STORAGE_REDIS_WATCH_H_
#define KVCELLAR_STORAGE_REDIS_WATCH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/file_layout.h"

namespace kvcellar::storage {

struct RedisWatchOptions {
  std::string key_prefix = "kvc:";
  std::string password;
  absl::Duration connect_timeout = absl::Milliseconds(500);
  absl::Duration retry = absl::Seconds(1);    // After a lost connection.
  absl::Duration refresh = absl::Seconds(5);  // How often the node list is asked again.
  bool configure = true;                      // CONFIG SET notify-keyspace-events when needed.
};

struct RedisWatchStats {
  uint64_t messages = 0;    // Notifications received.
  uint64_t removed = 0;     // Of those, the tier's objects handed to the sink.
  uint64_t connects = 0;    // Subscriptions made (reconnects included).
  uint64_t configured = 0;  // Servers whose notification classes the watch set.
};

// The object named by a Redis key under `prefix`, or false for any other key.
bool ParseRedisObjectKey(absl::string_view prefix, absl::string_view key, FileObjectId* out);

class RedisRemovalWatch {
 public:
  using Sink = absl::AnyInvocable<void(absl::Span<const FileObjectId> removed)>;
  // "host:port" or "unix:/path" of every node to watch (every primary).
  using Nodes = std::function<std::vector<std::string>()>;

  // Starts watching; the sink is set later (SetSink): removals before it are dropped.
  RedisRemovalWatch(RedisWatchOptions options, Nodes nodes);
  // Stops every thread (within about 100 ms).
  ~RedisRemovalWatch();
  RedisRemovalWatch(const RedisRemovalWatch&) = delete;
  RedisRemovalWatch& operator=(const RedisRemovalWatch&) = delete;

  // nullptr: none. Once a call returns, the old sink is not running and never will.
  void SetSink(Sink sink) ABSL_LOCKS_EXCLUDED(sink_mu_);
  RedisWatchStats Stats() const;
  // True once a subscription is open on every node named (tests).
  bool subscribed() const;

 private:
  struct NodeWatch;
  void Supervise();
  void Watch(NodeWatch* node);
  void Deliver(absl::Span<const FileObjectId> removed) ABSL_LOCKS_EXCLUDED(sink_mu_);

  const RedisWatchOptions options_;
  const Nodes nodes_;
  std::atomic<bool> stop_{false};

  absl::Mutex sink_mu_;
  Sink sink_ ABSL_GUARDED_BY(sink_mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<NodeWatch>> watches_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> messages_{0};
  std::atomic<uint64_t> removed_{0};
  std::atomic<uint64_t> connects_{0};
  std::atomic<uint64_t> configured_{0};
  std::atomic<bool> warned_config_{false};

  std::thread supervisor_;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_WATCH_H_
