// SignalRegion: an engine's signal region (the KVCSIG01 format, core/signal_layout.h) mapped into
// this process, with the word accesses both sides make and the one wait every waiter uses.
//
// The engine creates the region (Create: a POSIX shm object) and names it when it registers; the
// daemon maps it for the life of the engine's session (Open, or a derived class that checks the
// header against the registration itself). Every word access is a release store or an acquire
// load through platform/bus_fault_guard.h: the engine may truncate the region under the daemon,
// and then, in the daemon, a store is dropped and a load reads 0 (nothing signalled) instead of
// killing the process.
//
// Waits (WaitLayer, WaitOp) spin briefly, then sleep in short steps until their deadline: one
// loop (WaitWord) for every waiter, so a layer is seen microseconds after it landed without a
// core burnt while nothing comes.
//
// Threads: any; each word has one writer (daemon: layer and op words; engine: ready words).
#ifndef KVCELLAR_PLATFORM_SIGNAL_REGION_H_
#define KVCELLAR_PLATFORM_SIGNAL_REGION_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/signal_layout.h"
#include "platform/shm_mapping.h"

namespace kvcellar::platform {

class SignalRegion : public core::SignalLayout {
 public:
  // Engine side: creates the shm object `name` (zero-filled) and writes the header. Owns the
  // name. INVALID_ARGUMENT when a slot count is above kMaxSlots or num_layers is not in
  // [1, core::kMaxLayers].
  static absl::StatusOr<SignalRegion> Create(absl::string_view name, uint32_t load_slots,
                                             uint32_t num_layers, uint32_t ready_slots,
                                             uint32_t mode = ShmMapping::kDefaultMode);
  // Maps an existing region as far as its header says and checks the header: INVALID_ARGUMENT
  // when the magic, the version or a count is wrong; ShmMapping::Open's errors otherwise (the
  // daemon passes the registering engine's `access`).
  static absl::StatusOr<SignalRegion> Open(
      absl::string_view name, const EngineMemoryAccess& access = EngineMemoryAccess::Unchecked());

  SignalRegion() = default;
  SignalRegion(SignalRegion&&) noexcept = default;
  SignalRegion& operator=(SignalRegion&&) noexcept = default;

  bool valid() const { return shm_.data() != nullptr; }
  const std::string& name() const { return shm_.name(); }
  uint8_t* base() const { return shm_.data(); }
  uint64_t size() const { return shm_.size(); }

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
    Store(OpWordOffset(slot), OpWord(op_id, failed));
  }
  // How every op ends: layers [first_layer, num_layers()) get op_id (those before it were
  // signalled as they landed), then the op word.
  void EndOp(uint32_t slot, uint64_t op_id, bool failed, uint32_t first_layer) const;
  // Engine -> daemon: the writes of the Backup using ready slot `slot` with this token are done.
  void PublishReady(uint32_t slot, uint64_t token) const { Store(ReadyWordOffset(slot), token); }

  // Engine waits. WaitLayer: OK once layer `layer` of op `op_id` on `slot` is signalled ("the
  // daemon is done with it", not "it succeeded"). WaitOp: OK when the op is done, ABORTED when it
  // failed, FAILED_PRECONDITION when a later op already used the slot. DEADLINE_EXCEEDED at the
  // deadline (a dead daemon signals nothing); INVALID_ARGUMENT for a slot, layer or op id 0 out
  // of range.
  absl::Status WaitLayer(uint32_t slot, uint32_t layer, uint64_t op_id, absl::Time deadline) const;
  absl::Status WaitOp(uint32_t slot, uint64_t op_id, absl::Time deadline) const;

  // Zeroes every word after the header (an engine does it before registering the region with a
  // new daemon, whose op ids start again).
  void ResetCounters() { ResetCounters(shm_.data(), shm_.size()); }
  static void ResetCounters(uint8_t* base, uint64_t size);

 protected:
  // `shm` holds at least layout.Bytes() bytes and a header the caller checked.
  SignalRegion(ShmMapping shm, const core::SignalLayout& layout)
      : core::SignalLayout(layout), shm_(std::move(shm)) {}

 private:
  static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
                "shared-memory words must be lock-free atomics to work across processes");

  uint64_t* Word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(base() + offset); }
  void Store(uint64_t offset, uint64_t v) const;
  uint64_t Load(uint64_t offset) const;
  // The wait loop: until Load(offset) >= value; OK or DEADLINE_EXCEEDED.
  absl::Status WaitWord(uint64_t offset, uint64_t value, absl::Time deadline) const;

  ShmMapping shm_;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_SIGNAL_REGION_H_
