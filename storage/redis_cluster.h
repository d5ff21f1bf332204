// Redis Cluster routing: key hash slots, the slot-to-node map, and the redirects that correct it.
//
// A cluster splits the key space into 16384 hash slots, CRC16(key) mod 16384, where a key with a
// non-empty "{...}" section hashes only that section (a hash tag). Each primary serves some slot
// ranges. A client keeps a slot map (from CLUSTER SLOTS) and sends each command to the slot's
// primary; when the map is stale the node answers
//   -MOVED <slot> <host:port>   the slot lives there now: update the map, resend there;
//   -ASK <slot> <host:port>     the slot is being migrated and this key has moved already: resend
//                               there once, preceded by ASKING, and leave the map alone.
// The map is refreshed as a whole after MOVED (a resharding moves many slots at once) and after
// connection errors (a failover changes the primary), at most once per refresh interval.
//
// CLUSTER SLOTS rather than CLUSTER SHARDS: SHARDS only exists from Redis 7.0, SLOTS works on
// every Redis and Valkey version a site may run, and the backend needs only the primaries.
//
// Threads: the free functions are pure. SlotMap: Lookup from any thread without a lock; the
// writers (SetSlot, Replace, NodeId) lock its mutex.
#ifndef KVCELLAR_STORAGE_REDIS_CLUSTER_H_
#define KVCELLAR_STORAGE_REDIS_CLUSTER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcellar::storage {

inline constexpr int kClusterSlots = 16384;

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as in the Redis Cluster spec.
uint16_t Crc16(absl::string_view data);
// The key's slot, honoring hash tags.
uint16_t KeyHashSlot(absl::string_view key);

// "host:port", "[v6addr]:port" or "unix:/path/to.sock".
struct RedisAddress {
  bool is_unix = false;
  std::string host;  // Or the socket path when is_unix.
  int port = 0;
  std::string ToString() const;
};
absl::StatusOr<RedisAddress> ParseRedisAddress(absl::string_view text);

struct Redirect {
  enum class Kind { kMoved, kAsk };
  Kind kind = Kind::kMoved;
  uint16_t slot = 0;
  std::string address;  // "host:port"
};
// Parses the text of a "-MOVED 3999 127.0.0.1:6381" or "-ASK ..." error (without the '-').
// False for any other error.
bool ParseRedirect(absl::string_view error, Redirect* out);

struct SlotRange {
  uint16_t first = 0;
  uint16_t last = 0;  // Inclusive.
  std::string address;  // The range's primary, "host:port".
};

// CLUSTER SLOTS on one node, over a short-lived blocking hiredis connection. A primary reported
// with an empty host ("the address you reached me at") gets the queried node's host.
absl::StatusOr<std::vector<SlotRange>> FetchClusterSlots(const RedisAddress& node,
                                                         absl::Duration timeout,
                                                         const std::string& password);

// Slot -> node id; node ids index a list of addresses that only grows (a node that left keeps its
// id, unused). Lookups are lock-free: the routing of every command reads it.
class SlotMap {
 public:
  static constexpr int kUnknown = -1;

  SlotMap();
  int Lookup(uint16_t slot) const { return slots_[slot].load(std::memory_order_acquire); }
  void SetSlot(uint16_t slot, int node) { slots_[slot].store(node, std::memory_order_release); }
  // The id of `address`, added if new.
  int NodeId(const std::string& address);
  std::string Address(int node) const;
  size_t node_count() const;
  // Replaces the whole map (slots no range covers become unknown).
  void Replace(const std::vector<SlotRange>& ranges);

 private:
  std::array<std::atomic<int>, kClusterSlots> slots_;
  mutable absl::Mutex mu_;
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_CLUSTER_H_
