// SimCounterChannel: the daemon's side of a SIM engine's CompletionChannel, the engine's
// "KVCSIG01" signal region (platform/signal_region.h, format core/signal_layout.h, the same class
// libkvcellar-client creates it with), opened and checked against the engine's registration. The
// daemon stores a Load's op id into layer word (s, l) once layer l has landed (or the op failed),
// then (op_id << 1) | failed into the op word once the op is terminal; the engine stores a
// Backup's sim_token into ready word r once its writes are done.
//
// The daemon drives these words itself (sim_signal_pump.h) rather than handing the region to the
// device backend: the op word carries the Load's state in the op table (CANCELLED when its session
// ended, DONE for a Load with nothing to copy and so no device op), which the device op alone
// does not know.
//
// Threads: any; each word has one writer.
#ifndef KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_
#define KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/signal_layout.h"
#include "platform/shm_mapping.h"
#include "platform/signal_region.h"

namespace kvcellar::server {

class SimCounterChannel : public platform::SignalRegion {
 public:
  // Maps the engine's region and checks it against the registration. Errors are
  // FAILED_PRECONDITION / ERROR_REASON_HANDLE_OPEN_FAILED naming the field: the object is missing
  // or smaller than `size_bytes`, `size_bytes` is below what the counts need, or the header
  // disagrees with the registration. PERMISSION_DENIED (memory_access.h) when `access` refuses
  // the object or the OS refuses the daemon; nothing is mapped then.
  static absl::StatusOr<std::shared_ptr<SimCounterChannel>> Open(
      absl::string_view name, uint64_t size_bytes, uint32_t num_load_slots, uint32_t num_layers,
      uint32_t num_ready_slots,
      const platform::EngineMemoryAccess& access = platform::EngineMemoryAccess::Unchecked());

 private:
  SimCounterChannel(platform::ShmMapping shm, const core::SignalLayout& layout)
      : SignalRegion(std::move(shm), layout) {}
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_SIM_COUNTER_CHANNEL_H_
