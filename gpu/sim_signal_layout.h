// SimSignalLayout: the byte layout of a sim engine's signal region ("KVCSIG01"), the shared
// memory through which a daemon signals per-layer Load completion and an engine says a Backup's
// blocks are ready. One definition for both sides (libkvcellar-client's SimSignalRegion and the
// daemon's SimCounterChannel): a word at the wrong offset would let an engine run a layer whose
// bytes have not landed. The contract is cache_service.proto (SimCounterSignals) and
// docs/api.md ("SIM: shared-memory counters"):
//
//   [0, 64)                           "KVCSIG01", u32 version = 1, u32 num_load_slots,
//                                     u32 num_layers, u32 num_ready_slots, zero
//   64 + s * S, S = roundup((L + 1) * 8, 64)
//                                     load slot s: L layer words (op id once layer l landed),
//                                     then the op word ((op_id << 1) | failed, once terminal)
//   64 + num_load_slots * S + r * 64  ready slot r: the ready word (the engine's sim token)
//
// Words are little-endian u64, written with release stores and read with acquire loads, one
// writer each; values only grow within a daemon's lifetime, so every wait is "word >= value".
//
// Threads: any; the class holds the geometry and a pointer to memory its owner maps.
#ifndef KVCELLAR_GPU_SIM_SIGNAL_LAYOUT_H_
#define KVCELLAR_GPU_SIM_SIGNAL_LAYOUT_H_

#include <atomic>
#include <cstdint>
#include <cstring>

#include "platform/bus_fault_guard.h"

namespace kvcellar::gpu {

class SimSignalLayout {
 public:
  static constexpr char kMagic[] = "KVCSIG01";  // 8 bytes in the region, no terminator.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint64_t kHeaderBytes = 64;
  static constexpr uint64_t kReadySlotBytes = 64;  // One cache line per ready slot.

  // The header after the magic.
  struct Header {
    uint32_t version = 0;
    uint32_t num_load_slots = 0;
    uint32_t num_layers = 0;
    uint32_t num_ready_slots = 0;
  };

  static uint64_t LoadSlotStride(uint32_t num_layers) {
    return ((uint64_t{num_layers} + 1) * 8 + 63) / 64 * 64;
  }
  static uint64_t Bytes(uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots) {
    return kHeaderBytes + uint64_t{load_slots} * LoadSlotStride(num_layers) +
           uint64_t{ready_slots} * kReadySlotBytes;
  }
  static void WriteHeader(uint8_t* base, uint32_t load_slots, uint32_t num_layers,
                          uint32_t ready_slots) {
    std::memcpy(base, kMagic, 8);
    const Header h{kVersion, load_slots, num_layers, ready_slots};
    std::memcpy(base + 8, &h, sizeof(h));
  }
  static bool HasMagic(const uint8_t* base) { return std::memcmp(base, kMagic, 8) == 0; }
  static Header ReadHeader(const uint8_t* base) {
    Header h;
    std::memcpy(&h, base + 8, sizeof(h));
    return h;
  }

  uint32_t num_load_slots() const { return load_slots_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_ready_slots() const { return ready_slots_; }

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

  // Daemon -> engine.
  void SignalLayer(uint32_t slot, uint32_t layer, uint64_t op_id) const {
    Store(LayerWordOffset(slot, layer), op_id);
  }
  void SignalOp(uint32_t slot, uint64_t op_id, bool failed) const {
    Store(OpWordOffset(slot), (op_id << 1) | (failed ? 1 : 0));
  }
  // Engine -> daemon: the writes of the Backup using ready slot `slot` with this token are done.
  void PublishReady(uint32_t slot, uint64_t token) const {
    Store(ReadyWordOffset(slot), token);
  }

 protected:
  static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
                "shared-memory words must be lock-free atomics to work across processes");

  SimSignalLayout() = default;
  SimSignalLayout(uint8_t* base, uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots)
      : base_(base), load_slots_(load_slots), num_layers_(num_layers), ready_slots_(ready_slots) {}

  // The engine may truncate the region under the daemon: in the daemon a faulting access reads
  // 0 (nothing published) or is dropped (platform/bus_fault_guard.h).
  void Store(uint64_t offset, uint64_t v) const { platform::StoreSharedWord(Word(offset), v); }
  uint64_t Load(uint64_t offset) const {
    uint64_t v = 0;
    platform::LoadSharedWord(Word(offset), &v);
    return v;
  }

 private:
  uint64_t* Word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(base_ + offset); }

  // The mapping's address; its owner (the derived class) keeps the mapping alive, and a moved
  // mapping keeps its address.
  uint8_t* base_ = nullptr;
  uint32_t load_slots_ = 0;
  uint32_t num_layers_ = 0;
  uint32_t ready_slots_ = 0;
};

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_SIM_SIGNAL_LAYOUT_H_
