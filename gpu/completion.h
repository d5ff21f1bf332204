// CompletionRegion: the shared-memory page through which an engine and the daemon signal each
// other without an RPC.
//
// The engine creates the region (a POSIX shm object) before RegisterEngine and names it there; the
// daemon maps it for the life of the engine's session. Two directions:
//
//   engine -> daemon: `fence`, the engine's forward-pass counter. The engine stores N (release)
//     once every device write of forward pass N is complete. A sim Gather submitted with
//     ReadyFence::Counter(N) reads no engine byte before fence >= N.
//   daemon -> engine: slots. A Load (scatter) or Backup (gather) names a slot and a ticket; the
//     daemon stores the ticket into the slot's words as the op progresses.
//
// Binary layout, version 1. Every field is a uint64_t in host byte order at an 8-byte aligned
// offset, written only with an atomic store (release) and read only with an atomic load
// (acquire); each has a single writer.
//
//   offset 0    magic (kMagic, "KVCCMPL1")       engine, once at creation
//          8    version (1)                       engine, once
//         16    num_slots (1..kMaxSlots)          engine, once
//         24    num_layers (1..kMaxLayers)        engine, once
//         64    fence                             engine
//        128    slot 0, then slot s at 128 + s * SlotStride(num_layers), where
//               SlotStride = round_up(8 * (2 + num_layers), 64):
//                 +0            done_ticket        daemon
//                 +8            failed_ticket      daemon
//                 +16 + 8 * l   layer_ticket[l]    daemon
//
// Protocol for one op with (slot, ticket); the engine picks tickets strictly increasing per slot
// (a global op counter does) and keeps at most one op in flight per slot:
//   success: layer_ticket[0] = ticket, ..., layer_ticket[L-1] = ticket (scatter only, in layer
//     order, each only after every item's bytes of that layer are in engine memory), then
//     done_ticket = ticket.
//   failure or cancel: failed_ticket = ticket, then every layer_ticket[l] = ticket (so that no
//     waiter, CPU or GPU, blocks forever), then done_ticket = ticket.
// The engine may run layer l once layer_ticket[l] >= ticket; before it uses the step's results it
// checks done_ticket >= ticket and failed_ticket != ticket, and recomputes otherwise ("any cache
// error is a miss"). Because failed_ticket is stored before the layer words it releases, a waiter
// that saw layer_ticket[l] >= ticket (acquire) and failed_ticket != ticket knows layer l landed.
//
// CUDA: the daemon writes the same words from its copy stream (a one-thread kernel into the
// region, registered with cudaHostRegister), so an engine can wait on the GPU with
// cuStreamWaitValue64(layer word, ticket, CU_STREAM_WAIT_VALUE_GEQ) on its own registration of the
// region, or poll from the CPU.
#ifndef KVCELLAR_GPU_COMPLETION_H_
#define KVCELLAR_GPU_COMPLETION_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "platform/bus_fault_guard.h"
#include "platform/shm_mapping.h"

namespace kvcellar::gpu {

class CompletionRegion {
 public:
  static constexpr uint64_t kMagic = 0x314c504d4343564bull;  // "KVCCMPL1" little-endian.
  static constexpr uint64_t kVersion = 1;
  // Enough for every op a scheduler keeps in flight per rank, with room to spare.
  static constexpr uint32_t kMaxSlots = 4096;
  static constexpr uint64_t kMagicOffset = 0;
  static constexpr uint64_t kVersionOffset = 8;
  static constexpr uint64_t kNumSlotsOffset = 16;
  static constexpr uint64_t kNumLayersOffset = 24;
  static constexpr uint64_t kFenceOffset = 64;
  static constexpr uint64_t kSlotsOffset = 128;
  static constexpr uint64_t kDoneInSlot = 0;
  static constexpr uint64_t kFailedInSlot = 8;
  static constexpr uint64_t kLayersInSlot = 16;

  static uint64_t SlotStride(uint32_t num_layers) {
    return (8 * (2 + uint64_t{num_layers}) + 63) / 64 * 64;
  }
  static uint64_t Bytes(uint32_t num_slots, uint32_t num_layers) {
    return kSlotsOffset + uint64_t{num_slots} * SlotStride(num_layers);
  }

  // Engine side: creates the shm object `name`, zeroes it and writes the header.
  static absl::StatusOr<CompletionRegion> Create(absl::string_view name, uint32_t num_slots,
                                                 uint32_t num_layers);
  // Daemon side: maps an existing region and checks its header: INVALID_ARGUMENT naming the
  // field when the magic, version or counts are wrong or num_layers differs from the layout's.
  static absl::StatusOr<CompletionRegion> Attach(absl::string_view name, uint32_t num_layers);

  CompletionRegion() = default;
  CompletionRegion(CompletionRegion&&) noexcept = default;
  CompletionRegion& operator=(CompletionRegion&&) noexcept = default;

  bool valid() const { return shm_.data() != nullptr; }
  uint32_t num_slots() const { return num_slots_; }
  uint32_t num_layers() const { return num_layers_; }
  const std::string& name() const { return shm_.name(); }
  uint8_t* base() const { return shm_.data(); }
  uint64_t size() const { return shm_.size(); }

  // Offsets of a slot's words from base(), for writers that are not this class (CUDA kernels).
  static uint64_t DoneOffset(uint32_t num_layers, uint32_t slot) {
    return kSlotsOffset + slot * SlotStride(num_layers) + kDoneInSlot;
  }
  static uint64_t FailedOffset(uint32_t num_layers, uint32_t slot) {
    return kSlotsOffset + slot * SlotStride(num_layers) + kFailedInSlot;
  }
  static uint64_t LayerOffset(uint32_t num_layers, uint32_t slot, uint32_t layer) {
    return kSlotsOffset + slot * SlotStride(num_layers) + kLayersInSlot + 8 * uint64_t{layer};
  }

  // Engine -> daemon.
  void PublishFence(uint64_t value) { Store(kFenceOffset, value); }
  uint64_t fence() const { return Load(kFenceOffset); }

  // Daemon -> engine.
  void SignalLayer(uint32_t slot, uint32_t layer, uint64_t ticket) {
    Store(LayerOffset(num_layers_, slot, layer), ticket);
  }
  void SignalDone(uint32_t slot, uint64_t ticket) { Store(DoneOffset(num_layers_, slot), ticket); }
  // The whole failure sequence: failed, every layer, done.
  void SignalFailed(uint32_t slot, uint64_t ticket);

  uint64_t layer_ticket(uint32_t slot, uint32_t layer) const {
    return Load(LayerOffset(num_layers_, slot, layer));
  }
  uint64_t done_ticket(uint32_t slot) const { return Load(DoneOffset(num_layers_, slot)); }
  uint64_t failed_ticket(uint32_t slot) const { return Load(FailedOffset(num_layers_, slot)); }

  // Engine-side waits (spin, then sleep in short steps). OK once landed; ABORTED when the op
  // failed; DEADLINE_EXCEEDED at the deadline.
  absl::Status WaitLayer(uint32_t slot, uint32_t layer, uint64_t ticket, absl::Time deadline) const;
  absl::Status WaitDone(uint32_t slot, uint64_t ticket, absl::Time deadline) const;

 private:
  CompletionRegion(platform::ShmMapping shm, uint32_t num_slots, uint32_t num_layers)
      : shm_(std::move(shm)), num_slots_(num_slots), num_layers_(num_layers) {}

  uint64_t* Word(uint64_t offset) const {
    return reinterpret_cast<uint64_t*>(shm_.data() + offset);
  }
  // The engine may truncate the region under the daemon: in the daemon a faulting access reads
  // 0 (nothing signalled, so waits time out) or is dropped (platform/bus_fault_guard.h).
  void Store(uint64_t offset, uint64_t v) const { platform::StoreSharedWord(Word(offset), v); }
  uint64_t Load(uint64_t offset) const {
    uint64_t v = 0;
    platform::LoadSharedWord(Word(offset), &v);
    return v;
  }
  absl::Status WaitWord(uint64_t offset, uint32_t slot, uint64_t ticket, absl::Time deadline) const;

  platform::ShmMapping shm_;
  uint32_t num_slots_ = 0;
  uint32_t num_layers_ = 0;
};

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_COMPLETION_H_
