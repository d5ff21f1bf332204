// Short-lived blocking hiredis connections, for the Redis tiers' control paths that run outside
// the pipelined data path (storage/redis_connection.h): CLUSTER SLOTS (redis_cluster.h) and the
// index readback at start (redis_index.h).
#ifndef KVCELLAR_STORAGE_REDIS_BLOCKING_H_
#define KVCELLAR_STORAGE_REDIS_BLOCKING_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "storage/redis_cluster.h"

struct redisContext;
struct redisReply;

namespace kvcellar::storage {

struct HiredisContextFree {
  void operator()(redisContext* c) const;
};
struct HiredisReplyFree {
  void operator()(redisReply* r) const;
};
using HiredisContext = std::unique_ptr<redisContext, HiredisContextFree>;
using HiredisReply = std::unique_ptr<redisReply, HiredisReplyFree>;

// Connects to `node` within `timeout` (at least 1 ms), which then bounds every command too, and
// sends AUTH when `password` is not empty. UNAVAILABLE when the node does not answer,
// PERMISSION_DENIED when it refuses the password.
absl::StatusOr<HiredisContext> ConnectBlocking(const RedisAddress& node, absl::Duration timeout,
                                               const std::string& password);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_BLOCKING_H_
