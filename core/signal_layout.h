// SignalLayout: the byte layout of an engine's signal region ("KVCSIG01"), the shared memory
// through which the daemon signals per-layer Load completion and the end of an op, and an engine
// says a Backup's blocks are ready. The one signal format of the project: libkvcellar-client
// creates it and waits on it, the daemon's SIM pump (server/datapath/sim_signal_pump.h) and the
// gpu/ backends write it (the CUDA one from its copy stream). A word at the wrong offset would let
// an engine run a layer whose bytes have not landed. The contract is cache_service.proto
// (SimCounterSignals) and docs/api.md ("SIM: shared-memory counters"):
//
//   [0, 64)                           "KVCSIG01", u32 version = 1, u32 num_load_slots,
//                                     u32 num_layers, u32 num_ready_slots, zero
//   64 + s * S, S = roundup((L + 1) * 8, 64)
//                                     load slot s: L layer words (op id once layer l landed),
//                                     then the op word ((op_id << 1) | failed, once terminal)
//   64 + num_load_slots * S + r * 64  ready slot r: the ready word (the engine's token)
//
// Words are little-endian u64, written with release stores and read with acquire loads, one
// writer each; values only grow within a daemon's lifetime, so every wait is "word >= value".
// An op that fails or is cancelled still stores its id into every layer word before its op word,
// so that no layer waiter blocks forever: a layer word says "the daemon is done with layer l",
// the op word whether the op succeeded.
//
// Pure arithmetic on the format; platform/signal_region.h maps a region and accesses its words.
#ifndef KVCELLAR_CORE_SIGNAL_LAYOUT_H_
#define KVCELLAR_CORE_SIGNAL_LAYOUT_H_

#include <cstdint>
#include <cstring>

namespace kvcellar::core {

class SignalLayout {
 public:
  static constexpr char kMagic[] = "KVCSIG01";  // 8 bytes in the region, no terminator.
  static constexpr uint32_t kVersion = 1;
  static constexpr uint64_t kHeaderBytes = 64;
  static constexpr uint64_t kReadySlotBytes = 64;  // One cache line per ready slot.
  // Load slots and ready slots each: enough for every op a scheduler keeps in flight per rank,
  // with room to spare. Layers are bounded by core::kMaxLayers (kv_layout.h).
  static constexpr uint32_t kMaxSlots = 4096;

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
  // The op word of op `op_id` once it ended.
  static uint64_t OpWord(uint64_t op_id, bool failed) { return (op_id << 1) | (failed ? 1 : 0); }

  SignalLayout() = default;
  SignalLayout(uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots)
      : load_slots_(load_slots), num_layers_(num_layers), ready_slots_(ready_slots) {}

  uint32_t num_load_slots() const { return load_slots_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_ready_slots() const { return ready_slots_; }
  uint64_t Bytes() const { return Bytes(load_slots_, num_layers_, ready_slots_); }

  uint64_t LayerWordOffset(uint32_t slot, uint32_t layer) const {
    return kHeaderBytes + slot * LoadSlotStride(num_layers_) + 8 * uint64_t{layer};
  }
  uint64_t OpWordOffset(uint32_t slot) const { return LayerWordOffset(slot, num_layers_); }
  uint64_t ReadyWordOffset(uint32_t slot) const {
    return kHeaderBytes + load_slots_ * LoadSlotStride(num_layers_) + slot * kReadySlotBytes;
  }

 private:
  uint32_t load_slots_ = 0;
  uint32_t num_layers_ = 0;
  uint32_t ready_slots_ = 0;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_SIGNAL_LAYOUT_H_
