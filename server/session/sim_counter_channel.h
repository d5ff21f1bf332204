// SimCounterChannel: the daemon's side of a SIM engine's CompletionChannel, the "KVCSIG01"
// shared-memory counters (layout: gpu/sim_signal_layout.h, shared with libkvcellar-client). The
// daemon stores a Load's op id into layer word (s, l) once layer l has landed (or the op failed),
// then (op_id << 1) | failed into the op word once the op is terminal; the engine stores a
// Backup's sim_token into ready word r once its writes are done.
//
// This is not gpu/completion.h's CompletionRegion ("KVCCMPL1", one fence word, done/failed
// tickets), which the gpu backends use among themselves; the daemon does not hand the engine's
// region to the device backend but drives these words itself (sim_signal_pump.h).
//
// Threads: any; each word has one writer.
#ifndef KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_
#define KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu/sim_signal_layout.h"
#include "platform/shm_mapping.h"

namespace kvcellar::server {

class SimCounterChannel : public gpu::SimSignalLayout {
 public:
  // Maps the engine's region and checks it against the registration. Errors are
  // FAILED_PRECONDITION / ERROR_REASON_HANDLE_OPEN_FAILED naming the field: the object is missing
  // or smaller than `size_bytes`, `size_bytes` is below what the counts need, or the header
  // disagrees with the registration.
  static absl::StatusOr<std::shared_ptr<SimCounterChannel>> Open(absl::string_view name,
                                                                 uint64_t size_bytes,
                                                                 uint32_t num_load_slots,
                                                                 uint32_t num_layers,
                                                                 uint32_t num_ready_slots);

 private:
  SimCounterChannel(platform::ShmMapping shm, uint32_t load_slots, uint32_t num_layers,
                    uint32_t ready_slots)
      : SimSignalLayout(shm.data(), load_slots, num_layers, ready_slots), shm_(std::move(shm)) {}

  platform::ShmMapping shm_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_
