// EventStream: one WatchEvents call (AdminService), a server-streaming reactor that watches the
// EventHub (server/events/event_hub.h).
//
// The hub offers each batch under its lock; the stream queues at most kMaxQueued of them and
// drops the rest (counted in the next message's `missed`), so a slow reader never slows the
// daemon or grows its memory. One write is in flight at a time.
//
// Threads: Offer from the hub's publisher thread; the reactor callbacks from gRPC's threads. The
// stream deletes itself in OnDone, after it stopped watching.
#ifndef KVCELLAR_SERVER_RPC_EVENT_STREAM_H_
#define KVCELLAR_SERVER_RPC_EVENT_STREAM_H_

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvcellar/v1/admin_service.pb.h"
#include "server/events/event_hub.h"

namespace kvcellar::server {

class EventStream final : public grpc::ServerWriteReactor<kvcellar::v1::WatchEventsResponse>,
                          public EventWatcher {
 public:
  // Batches queued for a slow reader at most.
  static constexpr size_t kMaxQueued = 1024;

  // Starts watching `hub` (which outlives the call) for `request`.
  EventStream(EventHub* hub, const kvcellar::v1::WatchEventsRequest& request);

  void Offer(const std::shared_ptr<const KvEventBatch>& batch) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Starts the next write when none is in flight and one is queued.
  void WriteNextLocked();
  void StopWatching();

  EventHub* const hub_;
  const std::string tenant_;
  const std::string model_id_;
  std::once_flag unwatched_;

  std::mutex mu_;
  std::deque<std::shared_ptr<const KvEventBatch>> queue_;  // Guarded by mu_.
  uint64_t missed_ = 0;                                    // Guarded by mu_.
  bool writing_ = false;                                   // Guarded by mu_.
  bool finished_ = false;                                  // Guarded by mu_.
  kvcellar::v1::WatchEventsResponse response_;             // Guarded by mu_ while writing.
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_EVENT_STREAM_H_
