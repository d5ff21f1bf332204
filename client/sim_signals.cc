#include "client/sim_signals.h"

#include <utility>

namespace kvcellar::client {

absl::StatusOr<SimSignalRegion> SimSignalRegion::Create(absl::string_view name, uint32_t load_slots,
                                                        uint32_t num_layers, uint32_t ready_slots,
                                                        uint32_t mode) {
  absl::StatusOr<platform::SignalRegion> r =
      platform::SignalRegion::Create(name, load_slots, num_layers, ready_slots, mode);
  if (!r.ok()) return r.status();
  return SimSignalRegion(*std::move(r));
}

absl::StatusOr<SimSignalRegion> SimSignalRegion::Open(absl::string_view name) {
  absl::StatusOr<platform::SignalRegion> r = platform::SignalRegion::Open(name);
  if (!r.ok()) return r.status();
  return SimSignalRegion(*std::move(r));
}

CompletionChannelSpec SimSignalRegion::Channel() const {
  CompletionChannelSpec c;
  c.num_load_slots = num_load_slots();
  c.num_ready_slots = num_ready_slots();
  c.sim_shm_name = name();
  c.sim_size_bytes = size();
  return c;
}

}  // namespace kvcellar::client
