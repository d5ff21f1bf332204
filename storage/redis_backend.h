// RedisBackend: the L3 tier in Redis or Valkey, standalone or cluster, shared by every daemon
// that points at it.
//
// Each object is one string value: the 128-byte header of storage/object_format.h followed by the
// payload, under the key
//   <key_prefix><ns>:<page key>:<shard>     e.g. kvc:882cbfe3f98cb863:354fe3...:0
// (<ns>: first 8 bytes of the namespace digest in hex, <page key>: 64 hex characters). Reads check
// the header and CRC like the file backend, so a value damaged in memory, a truncated write, or
// another namespace's value under a colliding name is a miss, removed (UNLINK) and counted.
// Optional TTL (SET ... PX) lets Redis age objects out on its own; otherwise its maxmemory policy
// does (an OOM error is kRejected).
//
// Index (redis_index.h): with `index` on, every SET is followed in its pipeline by an HSET of the
// object's entry (parent link, size, namespace) in a per-namespace hash, every UNLINK by an HDEL,
// and at Create a readback thread reads the hashes back (SCAN + HSCAN, within
// index_readback_timeout) and hands what it found to SetIndexSink's sink, so a restarted daemon
// knows what the tier holds without a lookup per page.
//
// Batches are pipelined: a batch is split by node (cluster) and over that node's connections,
// and each connection (storage/redis_connection.h) writes all its commands and reads all replies
// in one round trip, with no copy of a payload on either side.
//
// Failures never hang: every connect and every pipeline runs under a deadline (the batch's, at
// most command_timeout by default). A dead server fails objects with kRetry within the connect
// timeout, and after a failed connect a node is not retried for `reconnect_backoff` (objects fail
// at once meanwhile); a stalled server fails them at the deadline, and the connection is dropped
// (replies might still arrive). When the server comes back the next batch reconnects.
// In a cluster a failed node may have been replaced by its replica: objects it failed are resent
// to their slot's primary after an immediate refresh of the slot map when that moved them, and
// for a minute after a failure the map is refreshed every refresh_interval, so that a daemon
// idle through a failover learns the new primary before its next request.
//
// Cluster: see redis_cluster.h. MOVED updates the slot and resends (up to max_redirects per
// object), ASK resends once with ASKING; either, and connection errors, schedule a topology
// refresh (CLUSTER SLOTS) on a background thread, rate-limited.
//
// Threads: all Backend methods from any thread. Each connection has its own worker thread
// (connections_per_node per node), which runs one pipeline at a time and calls `done` when it
// resolves a batch's last object; a refresher thread updates the cluster map; a callback thread
// delivers batches that completed during submission.
#ifndef KVCELLAR_STORAGE_REDIS_BACKEND_H_
#define KVCELLAR_STORAGE_REDIS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/backend.h"
#include "storage/redis_index.h"
#include "storage/redis_watch.h"

namespace kvcellar::storage {

struct RedisBackendOptions {
  // Standalone: one address. Cluster: seed nodes (any subset of the cluster).
  // "host:port", "[v6]:port" or "unix:/path".
  std::vector<std::string> addresses;
  bool cluster = false;
  int connections_per_node = 4;
  absl::Duration connect_timeout = absl::Milliseconds(500);
  // Default batch deadline when a request has none.
  absl::Duration command_timeout = absl::Seconds(2);
  // After a failed connect, objects for that node fail at once for this long.
  absl::Duration reconnect_backoff = absl::Milliseconds(100);
  // Least time between two cluster topology refreshes.
  absl::Duration refresh_interval = absl::Milliseconds(100);
  std::string key_prefix = "kvc:";
  absl::Duration ttl = absl::ZeroDuration();  // Zero: no expiry.
  std::string password;  // AUTH on connect when set.
  // Redis refuses strings over proto-max-bulk-len (512 MiB by default), header included.
  uint64_t max_object_bytes = (uint64_t{512} << 20) - 128;
  size_t max_batch_items = 8192;
  int max_redirects = 5;
  // Keep the index (HSET/HDEL beside each SET/UNLINK) and read it back at Create.
  bool index = true;
  absl::Duration index_readback_timeout = absl::Seconds(60);
  // Learn what the server expires and evicts while the daemon runs (storage/redis_watch.h):
  // keyspace notifications, enabled on the server with CONFIG SET when they are off.
  bool watch_removals = true;
};

using RedisIndexSink = absl::AnyInvocable<void(RedisIndexResult result)>;

// Create returns the implementation (redis_backend.cc); this class adds what only this tier
// answers. Destroying it completes every batch in flight (servers that do not answer fail them at
// their deadline).
class RedisBackend : public Backend {
 public:
  // Fails only on bad options: an unreachable server is an L3 that is down, not a startup error
  // (objects get kRetry until it answers).
  static absl::StatusOr<std::unique_ptr<RedisBackend>> Create(const RedisBackendOptions& options);

  // The Redis key of an object (tests, tools).
  virtual std::string ObjectKey(const PageKey& ns, const PageKey& key, uint32_t shard) const = 0;
  // The index key that holds this object's entry (tests, tools).
  virtual std::string IndexKey(const PageKey& ns, const PageKey& key, uint32_t shard) const = 0;

  // Hands the index readback's result to `sink`, once: at once on this thread when the readback
  // has finished (later calls get nothing), else on the readback thread when it finishes.
  // nullptr removes a sink that has not run; once that call returns, the old sink is not running
  // and never will. Without `index` nothing is ever delivered.
  virtual void SetIndexSink(RedisIndexSink sink) = 0;

  // Tells `sink` of the tier's objects the server removed by itself (TTL, maxmemory) as their
  // notifications arrive (redis_watch.h), on a watch thread; nullptr: none. Once a call returns,
  // the old sink is not running and never will. Without watch_removals nothing is delivered.
  virtual void SetRemovalSink(RedisRemovalWatch::Sink sink) = 0;
  // The watch's counts (zeros without watch_removals).
  virtual RedisWatchStats WatchStats() const = 0;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_BACKEND_H_
