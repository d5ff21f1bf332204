#include "client/sim_signals.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::client {
namespace {

// Busy polls before a waiter sleeps: a layer copy takes microseconds; a sleep costs ~50 us.
constexpr int kSpinPolls = 2000;
constexpr absl::Duration kSleepStep = absl::Microseconds(20);

// Same bound as the daemon's completion slots (gpu/completion.h kMaxSlots) and layers.
constexpr uint32_t kMaxSlots = 4096;
constexpr uint32_t kMaxLayers = 1024;

}  // namespace

absl::StatusOr<SimSignalRegion> SimSignalRegion::Create(absl::string_view name, uint32_t load_slots,
                                                        uint32_t num_layers, uint32_t ready_slots) {
  if (load_slots > kMaxSlots || ready_slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot counts (", load_slots, ", ", ready_slots, ") must be <= ", kMaxSlots));
  }
  if (num_layers == 0 || num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers (", num_layers, ") not in [1, ", kMaxLayers, "]"));
  }
  absl::StatusOr<platform::ShmMapping> shm =
      platform::ShmMapping::Create(name, Bytes(load_slots, num_layers, ready_slots));
  if (!shm.ok()) return shm.status();
  WriteHeader(shm->data(), load_slots, num_layers, ready_slots);
  std::atomic_thread_fence(std::memory_order_release);
  return SimSignalRegion(*std::move(shm), load_slots, num_layers, ready_slots);
}

absl::StatusOr<SimSignalRegion> SimSignalRegion::Open(absl::string_view name) {
  absl::StatusOr<platform::ShmMapping> head = platform::ShmMapping::Open(name, kHeaderBytes);
  if (!head.ok()) return head.status();
  if (!HasMagic(head->data())) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is not a KVCSIG01 signal region"));
  }
  const Header h = ReadHeader(head->data());
  if (h.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": version ", h.version, " unsupported"));
  }
  const uint32_t load_slots = h.num_load_slots;
  const uint32_t layers = h.num_layers;
  const uint32_t ready_slots = h.num_ready_slots;
  if (load_slots > kMaxSlots || ready_slots > kMaxSlots || layers == 0 || layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": bad header counts"));
  }
  absl::StatusOr<platform::ShmMapping> shm =
      platform::ShmMapping::Open(name, Bytes(load_slots, layers, ready_slots));
  if (!shm.ok()) return shm.status();
  return SimSignalRegion(*std::move(shm), load_slots, layers, ready_slots);
}

CompletionChannelSpec SimSignalRegion::Channel() const {
  CompletionChannelSpec c;
  c.num_load_slots = num_load_slots();
  c.num_ready_slots = num_ready_slots();
  c.sim_shm_name = name();
  c.sim_size_bytes = size();
  return c;
}

void SimSignalRegion::ResetCounters(uint8_t* base, uint64_t size) {
  for (uint64_t off = kHeaderBytes; off + 8 <= size; off += 8) {
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + off))
        .store(0, std::memory_order_release);
  }
}

absl::Status SimSignalRegion::WaitWord(uint64_t offset, uint64_t value, absl::Time deadline) const {
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

absl::Status SimSignalRegion::WaitLayer(uint32_t slot, uint32_t layer, uint64_t op_id,
                                        absl::Time deadline) const {
  if (slot >= num_load_slots() || layer >= num_layers() || op_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WaitLayer(slot ", slot, ", layer ", layer, ", op ", op_id, ") out of range"));
  }
  return WaitWord(LayerWordOffset(slot, layer), op_id, deadline);
}

absl::Status SimSignalRegion::WaitOp(uint32_t slot, uint64_t op_id, absl::Time deadline) const {
  if (slot >= num_load_slots() || op_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WaitOp(slot ", slot, ", op ", op_id, ") out of range"));
  }
  // The op word of op_id is >= (op_id << 1) whether it failed or not.
  if (absl::Status s = WaitWord(OpWordOffset(slot), op_id << 1, deadline); !s.ok()) return s;
  const uint64_t w = op_word(slot);
  if ((w >> 1) != op_id) {
    return absl::FailedPreconditionError(absl::StrCat("load slot ", slot, " already carries op ",
                                                      w >> 1, " (waiting for ", op_id,
                                                      "): its outcome is known only to WaitOps"));
  }
  if (w & 1) return absl::AbortedError(absl::StrCat("load op ", op_id, " failed"));
  return absl::OkStatus();
}

}  // namespace kvcellar::client
