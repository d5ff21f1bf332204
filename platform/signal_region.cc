#include "platform/signal_region.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/kv_layout.h"
#include "platform/bus_fault_guard.h"

namespace kvcellar::platform {
namespace {

// Busy polls before a waiter starts sleeping: a layer copy takes microseconds, a sleep costs at
// least ~50 us of wake-up latency.
constexpr int kSpinPolls = 2000;
constexpr absl::Duration kSleepStep = absl::Microseconds(20);

bool CountsInRange(uint32_t load_slots, uint32_t num_layers, uint32_t ready_slots) {
  return load_slots <= SignalRegion::kMaxSlots && ready_slots <= SignalRegion::kMaxSlots &&
         num_layers > 0 && num_layers <= core::kMaxLayers;
}

}  // namespace

absl::StatusOr<SignalRegion> SignalRegion::Create(absl::string_view name, uint32_t load_slots,
                                                  uint32_t num_layers, uint32_t ready_slots,
                                                  uint32_t mode) {
  if (load_slots > kMaxSlots || ready_slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot counts (", load_slots, ", ", ready_slots, ") must be <= ", kMaxSlots));
  }
  if (num_layers == 0 || num_layers > core::kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers (", num_layers, ") not in [1, ", core::kMaxLayers, "]"));
  }
  const core::SignalLayout layout(load_slots, num_layers, ready_slots);
  absl::StatusOr<ShmMapping> shm = ShmMapping::Create(name, layout.Bytes(), mode);
  if (!shm.ok()) return shm.status();
  WriteHeader(shm->data(), load_slots, num_layers, ready_slots);
  // A reader that maps the object after this sees the header.
  std::atomic_thread_fence(std::memory_order_release);
  return SignalRegion(*std::move(shm), layout);
}

absl::StatusOr<SignalRegion> SignalRegion::Open(absl::string_view name,
                                                const EngineMemoryAccess& access) {
  absl::StatusOr<ShmMapping> head = ShmMapping::Open(name, kHeaderBytes, access);
  if (!head.ok()) return head.status();
  if (!HasMagic(head->data())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not a KVCSIG01 signal region (bad magic)"));
  }
  const Header h = ReadHeader(head->data());
  if (h.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": version ", h.version, " unsupported"));
  }
  if (!CountsInRange(h.num_load_slots, h.num_layers, h.num_ready_slots)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": bad header counts"));
  }
  const core::SignalLayout layout(h.num_load_slots, h.num_layers, h.num_ready_slots);
  absl::StatusOr<ShmMapping> shm = ShmMapping::Open(name, layout.Bytes(), access);
  if (!shm.ok()) return shm.status();
  return SignalRegion(*std::move(shm), layout);
}

void SignalRegion::EndOp(uint32_t slot, uint64_t op_id, bool failed, uint32_t first_layer) const {
  for (uint32_t l = first_layer; l < num_layers(); ++l) SignalLayer(slot, l, op_id);
  SignalOp(slot, op_id, failed);
}

void SignalRegion::ResetCounters(uint8_t* base, uint64_t size) {
  for (uint64_t off = kHeaderBytes; off + 8 <= size; off += 8) {
    StoreSharedWord(reinterpret_cast<uint64_t*>(base + off), 0);
  }
}

void SignalRegion::Store(uint64_t offset, uint64_t v) const { StoreSharedWord(Word(offset), v); }

uint64_t SignalRegion::Load(uint64_t offset) const {
  uint64_t v = 0;
  LoadSharedWord(Word(offset), &v);
  return v;
}

absl::Status SignalRegion::WaitWord(uint64_t offset, uint64_t value, absl::Time deadline) const {
  for (int i = 0;; ++i) {
    if (Load(offset) >= value) return absl::OkStatus();
    if (i < kSpinPolls) continue;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("signal word at ", offset, " did not reach ", value, " in time"));
    }
    absl::SleepFor(kSleepStep);
  }
}

absl::Status SignalRegion::WaitLayer(uint32_t slot, uint32_t layer, uint64_t op_id,
                                     absl::Time deadline) const {
  if (slot >= num_load_slots() || layer >= num_layers() || op_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WaitLayer(slot ", slot, ", layer ", layer, ", op ", op_id, ") out of range"));
  }
  return WaitWord(LayerWordOffset(slot, layer), op_id, deadline);
}

absl::Status SignalRegion::WaitOp(uint32_t slot, uint64_t op_id, absl::Time deadline) const {
  if (slot >= num_load_slots() || op_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WaitOp(slot ", slot, ", op ", op_id, ") out of range"));
  }
  // The op word of op_id is >= OpWord(op_id, false) whether it failed or not.
  if (absl::Status s = WaitWord(OpWordOffset(slot), OpWord(op_id, false), deadline); !s.ok()) {
    return s;
  }
  const uint64_t w = op_word(slot);
  if ((w >> 1) != op_id) {
    return absl::FailedPreconditionError(absl::StrCat("load slot ", slot, " already carries op ",
                                                      w >> 1, " (waiting for ", op_id,
                                                      "): its outcome is known only to WaitOps"));
  }
  if (w & 1) return absl::AbortedError(absl::StrCat("load op ", op_id, " failed"));
  return absl::OkStatus();
}

}  // namespace kvcellar::platform
