// SimCounterChannel: the daemon's side of a SIM engine's CompletionChannel, the "KVCSIG01"
// shared-memory counters specified in cache_service.proto (SimCounterSignals) and docs/api.md
// ("SIM: shared-memory counters"):
//
//   [0, 64)                            "KVCSIG01", u32 version 1, u32 num_load_slots,
//                                      u32 num_layers, u32 num_ready_slots, zero
//   64 + s * S, S = roundup((L+1)*8, 64)  load slot s: L layer words, then the op word
//   64 + num_load_slots * S + r * 64   ready slot r: the ready word
//
// The daemon stores a Load's op id into layer word (s, l) once layer l has landed (or the op
// failed), then (op_id << 1) | failed into the op word once the op is terminal; the engine stores
// a Backup's sim_token into ready word r once its writes are done. Words are little-endian u64,
// written with release stores and read with acquire loads; values only grow, so every wait is
// "word >= value".
//
// This is not gpu/completion.h's CompletionRegion ("KVCCMPL1", one fence word, done/failed
// tickets), which the gpu backends use among themselves; the daemon does not hand the engine's
// region to the device backend but drives these words itself (sim_signal_pump.h).
//
// Threads: any; each word has one writer.
#ifndef KVCELLAR_SERVER_SIM_COUNTER_CHANNEL_H_
#define KVCELLAR_SERVER_SIM_COUNTER_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu/shm_mapping.h"

namespace kvcellar::server {

class SimCounterChannel {
 public:
  static constexpr char kMagic[] = "KVCSIG01";  // 8 bytes in the region, no terminator.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint64_t kHeaderBytes = 64;
  static constexpr uint64_t kReadySlotBytes = 64;  // One cache line per ready slot.

  static uint64_t LoadSlotStride(uint32_t num_layers) {
    return ((uint64_t{num_layers} + 1) * 8 + 63) / 64 * 64;
  }
  static uint64_t Bytes(uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots) {
    return kHeaderBytes + load_slots * LoadSlotStride(num_layers) +
           uint64_t{ready_slots} * kReadySlotBytes;
  }

  // Maps the engine's region and checks it against the registration. Errors are
  // FAILED_PRECONDITION / ERROR_REASON_HANDLE_OPEN_FAILED naming the field: the object is missing
  // or smaller than `size_bytes`, `size_bytes` is below what the counts need, or the header
  // disagrees with the registration.
  static absl::StatusOr<std::shared_ptr<SimCounterChannel>> Open(absl::string_view name,
                                                                 uint64_t size_bytes,
                                                                 uint32_t num_load_slots,
                                                                 uint32_t num_layers,
                                                                 uint32_t num_ready_slots);

  uint32_t num_load_slots() const { return load_slots_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_ready_slots() const { return ready_slots_; }

  void SignalLayer(uint32_t slot, uint32_t layer, uint64_t op_id) const {
    Store(LayerWordOffset(slot, layer), op_id);
  }
  void SignalOp(uint32_t slot, uint64_t op_id, bool failed) const {
    Store(LayerWordOffset(slot, num_layers_), (op_id << 1) | (failed ? 1 : 0));
  }
  uint64_t ready_word(uint32_t slot) const { return Load(ReadyWordOffset(slot)); }

 private:
  SimCounterChannel(gpu::ShmMapping shm, uint32_t load_slots, uint32_t num_layers,
                    uint32_t ready_slots)
      : shm_(std::move(shm)),
        load_slots_(load_slots),
        num_layers_(num_layers),
        ready_slots_(ready_slots) {}

  uint64_t LayerWordOffset(uint32_t slot, uint32_t layer) const {
    return kHeaderBytes + slot * LoadSlotStride(num_layers_) + 8 * uint64_t{layer};
  }
  uint64_t ReadyWordOffset(uint32_t slot) const {
    return kHeaderBytes + load_slots_ * LoadSlotStride(num_layers_) + slot * kReadySlotBytes;
  }
  uint64_t* Word(uint64_t offset) const {
    return reinterpret_cast<uint64_t*>(shm_.data() + offset);
  }
  void Store(uint64_t offset, uint64_t v) const {
    std::atomic_ref<uint64_t>(*Word(offset)).store(v, std::memory_order_release);
  }
  uint64_t Load(uint64_t offset) const {
    return std::atomic_ref<uint64_t>(*Word(offset)).load(std::memory_order_acquire);
  }

  gpu::ShmMapping shm_;
  uint32_t load_slots_ = 0;
  uint32_t num_layers_ = 0;
  uint32_t ready_slots_ = 0;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SIM_COUNTER_CHANNEL_H_
