// SimSignalRegion: the engine's side of the SIM CompletionChannel ("KVCSIG01"): the signal region
// (platform/signal_region.h, format core/signal_layout.h) through which a SIM daemon signals
// per-layer Load completion and learns that a Backup's blocks are ready, plus what
// RegisterEngine needs to name it. A new daemon restarts op ids, so the library zeroes the
// counters before it registers the region again (ResetCounters).
//
// Threading: waits and reads from any thread; one writer per word (daemon: layer and op words;
// engine: ready words).
#ifndef KVCELLAR_CLIENT_SIM_SIGNALS_H_
#define KVCELLAR_CLIENT_SIM_SIGNALS_H_

#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client_types.h"
#include "platform/signal_region.h"

namespace kvcellar::client {

class SimSignalRegion : public platform::SignalRegion {
 public:
  // Creates the shm object `name` (zero-filled, permission bits `mode`) and writes the header.
  // Owns the name.
  static absl::StatusOr<SimSignalRegion> Create(absl::string_view name, uint32_t load_slots,
                                                uint32_t num_layers, uint32_t ready_slots,
                                                uint32_t mode = platform::ShmMapping::kDefaultMode);
  // Maps an existing region and checks its header (tests, tools).
  static absl::StatusOr<SimSignalRegion> Open(absl::string_view name);

  SimSignalRegion() = default;
  SimSignalRegion(SimSignalRegion&&) noexcept = default;
  SimSignalRegion& operator=(SimSignalRegion&&) noexcept = default;

  // What RegisterEngine needs to name this region.
  CompletionChannelSpec Channel() const;

 private:
  explicit SimSignalRegion(platform::SignalRegion region)
      : platform::SignalRegion(std::move(region)) {}
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SIM_SIGNALS_H_
