// EventHub: the daemon's KV events for cache-aware routers (docs/events.md).
//
// Every namespace's radix index reports each page's first copy and last copy per medium
// (core/index_events.h) to the hub's sink for that namespace. The hub queues them (bounded:
// events.max_queue_size; past it events are dropped and counted), and its publisher thread, every
// events.batch_interval_ms, turns the queue into batches, one namespace per batch, consecutive
// pages of a chain folded into one BlockStored. Each batch gets the next sequence number (per
// daemon, from 0), is encoded in vLLM's format (kv_event_batch.h) and goes to:
//  - ZMQ (events.endpoint): PUB of [topic, seq as 8 bytes big-endian, payload], as vLLM's
//    ZmqEventPublisher sends them; the topic is events.topic with {node}, {tenant} and {model}
//    replaced; and a ROUTER (events.replay_endpoint) that answers a request [start seq as 8
//    bytes big-endian] with every buffered batch from that seq on, then an end marker of seq -1,
//    as vLLM's replay does;
//  - the replay buffer (the last events.buffer_steps batches);
//  - every watcher (WatchEvents streams), which must not block.
// When events are dropped, the next batch's seq skips one, so subscribers see the gap, and each
// namespace's AllBlocksCleared follows what was queued before: subscribers start that node's
// state afresh rather than keep pages whose removal they never heard of.
//
// Nothing is queued while nobody can receive it (no ZMQ endpoint and no watcher): the sinks then
// return after one relaxed load. A namespace's first batch is AllBlocksCleared: whatever a
// subscriber knew of this node's namespace from an earlier daemon is void.
//
// Threads: sinks are called by the indexes under their locks, from any thread; Watch, Unwatch
// and the accessors from any thread; ZMQ sockets are used by the publisher thread only.
#ifndef KVCELLAR_SERVER_EVENTS_EVENT_HUB_H_
#define KVCELLAR_SERVER_EVENTS_EVENT_HUB_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/index_events.h"
#include "core/namespace_spec.h"
#include "server/events/kv_event_batch.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {

struct EventHubOptions {
  std::string endpoint;         // ZMQ PUB; "" = none. Bound when it has '*' or is ipc://.
  std::string replay_endpoint;  // ZMQ ROUTER, bound; "" = none.
  std::string topic;            // Template: {node}, {tenant}, {model}.
  std::string node;             // "" = the host name.
  int64_t buffer_steps = 10'000;
  int64_t hwm = 100'000;
  int64_t max_queue_size = 100'000;
  absl::Duration batch_interval = absl::Milliseconds(10);
  bool int_hashes = true;  // Block hashes as vLLM's integers (events.block_hashes).
  // The first batch's sequence number; nullopt: microseconds since the Unix epoch at Start, so a
  // restarted daemon numbers its batches above every earlier run's (fewer than 10^6 batches a
  // second are ever published: batch_interval_ms >= 1), and a subscriber that ignores numbers
  // at or below the last it applied (NVIDIA Dynamo's indexer does) does not ignore the restart.
  std::optional<uint64_t> first_seq;
  // With a ZMQ publisher: after this long without a batch, an empty one (the last batch's topic),
  // so that a subscriber that lost batches (a restarted daemon's AllBlocksCleared, sent while it
  // was reconnecting) sees the gap in sequence numbers within this time and asks for a replay.
  // Zero: none.
  absl::Duration heartbeat = absl::ZeroDuration();
  // L3 tiers as "STORAGE:<name>" each, rather than vLLM's "STORAGE" per locality.
  bool per_tier_media = false;
  // The L3 tiers, in lookup order.
  struct L3Tier {
    std::string name;
    bool shared = false;  // Other nodes use it too.
  };
  std::vector<L3Tier> l3_tiers;
};

// A WatchEvents stream. Offer must not block: it queues or drops.
class EventWatcher {
 public:
  virtual ~EventWatcher() = default;
  virtual void Offer(const std::shared_ptr<const KvEventBatch>& batch) = 0;
};

class EventHub {
 public:
  // Binds or connects the ZMQ sockets and starts the publisher thread. InvalidArgument naming
  // events.endpoint or events.replay_endpoint when ZMQ refuses it.
  static absl::StatusOr<std::unique_ptr<EventHub>> Start(EventHubOptions options);
  // Publishes what is queued, then stops. Watchers must be gone.
  ~EventHub();
  EventHub(const EventHub&) = delete;
  EventHub& operator=(const EventHub&) = delete;

  // The sink of namespace `ns_id` (owned by the hub, valid for its life). Queues the
  // namespace's AllBlocksCleared.
  core::IndexEventSink* SinkFor(uint32_t ns_id, const core::NamespaceSpec& spec);

  // Starts offering batches to `watcher`: first the buffered ones from `from_seq` on (when
  // given), then every new one, in order. Returns the next sequence number to be published.
  uint64_t Watch(EventWatcher* watcher, std::optional<uint64_t> from_seq);
  // After it returns, `watcher` is offered nothing more.
  void Unwatch(EventWatcher* watcher);

  // The endpoints as bound (a tcp port 0 resolved); "" when not configured.
  const std::string& endpoint() const { return bound_endpoint_; }
  const std::string& replay_endpoint() const { return bound_replay_endpoint_; }

  // kvcellar_events_* samples.
  void Collect(MetricWriter& out) const;

 private:
  class NamespaceSink;
  struct Pending {
    const NamespaceSink* sink;  // Sinks live as long as the hub.
    core::IndexEvent event;
    bool cleared;  // AllBlocksCleared of the namespace (event unused).
  };

  explicit EventHub(EventHubOptions options);
  absl::Status OpenSockets();
  void Push(const NamespaceSink* sink, const core::IndexEvent& event, bool cleared);
  bool Active() const;
  void Run();
  // Publishes what is queued.
  void Flush();
  // An empty batch after options_.heartbeat without one.
  void Heartbeat();
  void Publish(std::shared_ptr<KvEventBatch> batch);
  // Whether an index event is news for subscribers: always, but for an L3 tier's under "STORAGE"
  // media, only the first tier of its locality to hold the page or the last to let it go.
  bool Announced(const core::IndexEvent& e) const;
  void ServeReplay();

  const EventHubOptions options_;
  std::vector<std::string> media_;  // [0]: L2, [t + 1]: L3 tier t.
  std::vector<std::string> locality_;
  uint8_t local_tiers_ = 0;   // L3 tiers of this node alone, as a bit mask.
  uint8_t shared_tiers_ = 0;  // L3 tiers other nodes share.

  void* zmq_ = nullptr;  // Context.
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  std::string bound_endpoint_;
  std::string bound_replay_endpoint_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::vector<Pending> queue_;  // Guarded by queue_mu_.
  uint64_t lost_ = 0;           // Guarded by queue_mu_: dropped since the last flush.
  bool stop_ = false;           // Guarded by queue_mu_.

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<NamespaceSink>> sinks_;       // Guarded by mu_.
  std::deque<std::shared_ptr<const KvEventBatch>> buffer_;  // Guarded by mu_.
  absl::flat_hash_set<EventWatcher*> watchers_;             // Guarded by mu_.
  uint64_t next_seq_ = 0;                                   // Guarded by mu_.
  std::atomic<int> watcher_count_{0};

  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> events_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> replays_{0};
  std::atomic<uint64_t> replays_rejected_{0};
  absl::Time last_reject_log_ = absl::InfinitePast();  // Publisher thread only.
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_EVENTS_EVENT_HUB_H_
