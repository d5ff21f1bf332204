// SimSignalPump: drives the SIM engines' counters (sim_counter_channel.h) for the ops that use
// them, on one polling thread.
//
//   Loads with signal_layers: publishes layer word (slot, l) = op id as soon as the device op
//     reports layer l landed (DeviceOp::layers_done(), an acquire read of a counter the device
//     releases after the layer's bytes), so the engine runs layer l while later layers copy.
//     FinishLoad, called when the op is terminal, signals any layer not yet signalled (a failed
//     or cancelled Load still signals every layer exactly once) and then the op word.
//   Backups with a ready signal: the gather is not submitted before the engine's ready word
//     reaches the Backup's sim_token, so no engine byte is read early. GatedGather returns a
//     DeviceOp that stands for the gather from submission on: it finishes with the gather's
//     status, or CANCELLED when cancelled (the ready timeout) before the word fired; once
//     cancelled, the gather is never submitted.
//
// Nothing to wait on exists (the engine just stores a word; the device has no per-layer
// callback), so the thread polls while it has work, every kMinPoll, backing off to kMaxPoll
// while nothing moves, and sleeps on a condition variable when idle.
//
// Threads: any thread adds and finishes work; the pump thread (owned) polls. One mutex guards the
// work lists, and is held while the thread stores words and submits a gated gather: after
// FinishLoad or a gated op's Cancel returns, the thread writes nothing more for that op.
#ifndef KVCELLAR_SERVER_DATAPATH_SIM_SIGNAL_PUMP_H_
#define KVCELLAR_SERVER_DATAPATH_SIM_SIGNAL_PUMP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device_backend.h"
#include "server/session/sim_counter_channel.h"

namespace kvcellar::server {

class SimSignalPump {
 public:
  SimSignalPump();
  ~SimSignalPump();
  SimSignalPump(const SimSignalPump&) = delete;
  SimSignalPump& operator=(const SimSignalPump&) = delete;

  // Publishes the layers of Load `op_id` on `slot` as `op` (may be null: nothing to copy) lands
  // them, until FinishLoad(op_id).
  void WatchLoad(uint64_t op_id, gpu::OpHandle op, std::shared_ptr<SimCounterChannel> channel,
                 uint32_t slot) ABSL_LOCKS_EXCLUDED(mu_);
  // The Load is terminal: signals the layers not yet signalled, then the op word.
  void FinishLoad(uint64_t op_id, bool failed) ABSL_LOCKS_EXCLUDED(mu_);

  // A gather that `submit` issues once ready word `slot` of `channel` reaches `token`.
  gpu::OpHandle GatedGather(std::function<absl::StatusOr<gpu::OpHandle>()> submit,
                            std::shared_ptr<SimCounterChannel> channel, uint32_t slot,
                            uint64_t token, uint32_t num_layers) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Gated;
  struct LoadWatch {
    gpu::OpHandle op;
    std::shared_ptr<SimCounterChannel> channel;
    uint32_t slot = 0;
    uint32_t next_layer = 0;  // Layers [0, next_layer) are signalled.
  };
  struct GateWatch {
    std::shared_ptr<Gated> op;
    std::shared_ptr<SimCounterChannel> channel;
    uint32_t slot = 0;
    uint64_t token = 0;
  };

  void Run();
  // One pass over the work; returns whether anything moved.
  bool PollLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, LoadWatch> loads_ ABSL_GUARDED_BY(mu_);
  std::vector<GateWatch> gates_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_DATAPATH_SIM_SIGNAL_PUMP_H_
