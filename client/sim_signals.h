// SimSignalRegion: the engine's side of the SIM CompletionChannel ("KVCSIG01"): it creates the
// shared-memory counters (layout: gpu/sim_signal_layout.h) through which a SIM daemon signals
// per-layer Load completion and learns that a Backup's blocks are ready, and waits on them.
// A new daemon restarts op ids, so the library zeroes the counters before it registers the
// region again (ResetCounters).
//
// Threading: waits and reads from any thread; one writer per word (daemon: layer and op words;
// engine: ready words).
#ifndef KVCELLAR_CLIENT_SIM_SIGNALS_H_
#define KVCELLAR_CLIENT_SIM_SIGNALS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client_types.h"
#include "gpu/sim_signal_layout.h"
#include "platform/shm_mapping.h"

namespace kvcellar::client {

class SimSignalRegion : public gpu::SimSignalLayout {
 public:
  // Creates the shm object `name` (zero-filled) and writes the header. Owns the name.
  static absl::StatusOr<SimSignalRegion> Create(absl::string_view name, uint32_t load_slots,
                                                uint32_t num_layers, uint32_t ready_slots);
  // Maps an existing region and checks its header (tests, tools).
  static absl::StatusOr<SimSignalRegion> Open(absl::string_view name);

  SimSignalRegion() = default;
  SimSignalRegion(SimSignalRegion&&) noexcept = default;
  SimSignalRegion& operator=(SimSignalRegion&&) noexcept = default;

  bool valid() const { return shm_.data() != nullptr; }
  const std::string& name() const { return shm_.name(); }
  uint64_t size() const { return shm_.size(); }
  // What RegisterEngine needs to name this region.
  CompletionChannelSpec Channel() const;

  // Engine waits (spin briefly, then sleep in short steps). WaitLayer: OK once layer `layer` of
  // the Load `op_id` on `slot` is signalled ("the daemon is done with it", not "it succeeded").
  // WaitOp: OK when the op is DONE, ABORTED when it failed, FAILED_PRECONDITION when a later op
  // already used the slot. DEADLINE_EXCEEDED at the deadline (a dead daemon signals nothing).
  absl::Status WaitLayer(uint32_t slot, uint32_t layer, uint64_t op_id, absl::Time deadline) const;
  absl::Status WaitOp(uint32_t slot, uint64_t op_id, absl::Time deadline) const;

  // Zeroes every word after the header (the library does it before re-registering).
  void ResetCounters() { ResetCounters(shm_.data(), shm_.size()); }
  static void ResetCounters(uint8_t* base, uint64_t size);

 private:
  SimSignalRegion(platform::ShmMapping shm, uint32_t load_slots, uint32_t num_layers,
                  uint32_t ready_slots)
      : SimSignalLayout(shm.data(), load_slots, num_layers, ready_slots), shm_(std::move(shm)) {}
  // Waits until Load(offset) >= value; OK or DEADLINE_EXCEEDED.
  absl::Status WaitWord(uint64_t offset, uint64_t value, absl::Time deadline) const;

  platform::ShmMapping shm_;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SIM_SIGNALS_H_
