// SimSignalRegion: the engine's side of the SIM CompletionChannel ("KVCSIG01"), the shared-memory
// counters through which a SIM daemon signals per-layer Load completion and learns that a
// Backup's blocks are ready. The byte layout is the contract in cache_service.proto
// (SimCounterSignals) and docs/api.md ("SIM: shared-memory counters"):
//
//   [0, 64)                          "KVCSIG01", u32 version = 1, u32 num_load_slots,
//                                    u32 num_layers, u32 num_ready_slots, zero
//   64 + s * S, S = roundup((L + 1) * 8, 64)
//                                    load slot s: L layer words (op id once layer l landed),
//                                    then the op word ((op_id << 1) | failed, once terminal)
//   64 + num_load_slots * S + r * 64 ready slot r: the ready word (engine stores sim tokens)
//
// Words are little-endian u64 (the only hosts this runs on are little-endian), written with
// release stores and read with acquire loads. Op ids and tokens only grow within one daemon
// lifetime, so every wait is "word >= value". A new daemon restarts op ids, so the library zeroes
// the counters before it registers the region again (ResetCounters).
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
#include "gpu/shm_mapping.h"

namespace kvcellar::client {

class SimSignalRegion {
 public:
  static constexpr char kMagic[] = "KVCSIG01";  // 8 bytes, no terminator in the region.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint64_t kHeaderBytes = 64;
  static constexpr uint64_t kReadySlotBytes = 64;  // One cache line per ready slot.

  static uint64_t LoadSlotStride(uint32_t num_layers) {
    return ((uint64_t{num_layers} + 1) * 8 + 63) / 64 * 64;
  }
  static uint64_t Bytes(uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots) {
    return kHeaderBytes + load_slots * LoadSlotStride(num_layers) + ready_slots * kReadySlotBytes;
  }

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
  uint32_t num_load_slots() const { return load_slots_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_ready_slots() const { return ready_slots_; }
  // What RegisterEngine needs to name this region.
  CompletionChannelSpec Channel() const;

  uint64_t LayerWordOffset(uint32_t slot, uint32_t layer) const {
    return kHeaderBytes + slot * LoadSlotStride(num_layers_) + 8 * uint64_t{layer};
  }
  uint64_t OpWordOffset(uint32_t slot) const { return LayerWordOffset(slot, num_layers_); }
  uint64_t ReadyWordOffset(uint32_t slot) const {
    return kHeaderBytes + load_slots_ * LoadSlotStride(num_layers_) + slot * kReadySlotBytes;
  }

  uint64_t layer_word(uint32_t slot, uint32_t layer) const {
    return Load(LayerWordOffset(slot, layer));
  }
  uint64_t op_word(uint32_t slot) const { return Load(OpWordOffset(slot)); }
  uint64_t ready_word(uint32_t slot) const { return Load(ReadyWordOffset(slot)); }

  // Engine -> daemon: the writes of the Backup using ready slot `slot` with this token are done.
  void PublishReady(uint32_t slot, uint64_t token) { Store(ReadyWordOffset(slot), token); }

  // Engine waits (spin briefly, then sleep in short steps). WaitLayer: OK once layer `layer` of
  // the Load `op_id` on `slot` is signalled ("the daemon is done with it", not "it succeeded").
  // WaitOp: OK when the op is DONE, ABORTED when it failed, FAILED_PRECONDITION when a later op
  // already used the slot. DEADLINE_EXCEEDED at the deadline (a dead daemon signals nothing).
  absl::Status WaitLayer(uint32_t slot, uint32_t layer, uint64_t op_id, absl::Time deadline) const;
  absl::Status WaitOp(uint32_t slot, uint64_t op_id, absl::Time deadline) const;

  // Daemon side, for tests of the engine side without a daemon.
  void SignalLayer(uint32_t slot, uint32_t layer, uint64_t op_id) {
    Store(LayerWordOffset(slot, layer), op_id);
  }
  void SignalOp(uint32_t slot, uint64_t op_id, bool failed) {
    Store(OpWordOffset(slot), (op_id << 1) | (failed ? 1 : 0));
  }

  // Zeroes every word after the header (the library does it before re-registering).
  void ResetCounters() { ResetCounters(shm_.data(), shm_.size()); }
  static void ResetCounters(uint8_t* base, uint64_t size);

 private:
  SimSignalRegion(gpu::ShmMapping shm, uint32_t load_slots, uint32_t num_layers,
                  uint32_t ready_slots)
      : shm_(std::move(shm)),
        load_slots_(load_slots),
        num_layers_(num_layers),
        ready_slots_(ready_slots) {}

  uint64_t* Word(uint64_t offset) const {
    return reinterpret_cast<uint64_t*>(shm_.data() + offset);
  }
  void Store(uint64_t offset, uint64_t v) const {
    std::atomic_ref<uint64_t>(*Word(offset)).store(v, std::memory_order_release);
  }
  uint64_t Load(uint64_t offset) const {
    return std::atomic_ref<uint64_t>(*Word(offset)).load(std::memory_order_acquire);
  }
  // Waits until Load(offset) >= value; OK or DEADLINE_EXCEEDED.
  absl::Status WaitWord(uint64_t offset, uint64_t value, absl::Time deadline) const;

  gpu::ShmMapping shm_;
  uint32_t load_slots_ = 0;
  uint32_t num_layers_ = 0;
  uint32_t ready_slots_ = 0;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SIM_SIGNALS_H_
