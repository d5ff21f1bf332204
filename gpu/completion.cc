#include "gpu/completion.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/kv_layout.h"

namespace kvcellar::gpu {
namespace {

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "shared-memory words must be lock-free atomics to work across processes");

// Busy polls before a waiter starts sleeping: a layer copy takes microseconds, a sleep at least
// ~50us of wake-up latency.
constexpr int kSpinPolls = 2000;
constexpr absl::Duration kSleepStep = absl::Microseconds(20);

}  // namespace

absl::StatusOr<CompletionRegion> CompletionRegion::Create(absl::string_view name,
                                                          uint32_t num_slots, uint32_t num_layers) {
  if (num_slots == 0 || num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_slots (", num_slots, ") not in [1, ", kMaxSlots, "]"));
  }
  if (num_layers == 0 || num_layers > core::kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers (", num_layers, ") not in [1, ", core::kMaxLayers, "]"));
  }
  absl::StatusOr<platform::ShmMapping> shm =
      platform::ShmMapping::Create(name, Bytes(num_slots, num_layers));
  if (!shm.ok()) return shm.status();
  CompletionRegion r(*std::move(shm), num_slots, num_layers);
  r.Store(kVersionOffset, kVersion);
  r.Store(kNumSlotsOffset, num_slots);
  r.Store(kNumLayersOffset, num_layers);
  r.Store(kMagicOffset, kMagic);  // Last: a reader that sees the magic sees the header.
  return r;
}

absl::StatusOr<CompletionRegion> CompletionRegion::Attach(absl::string_view name,
                                                          uint32_t num_layers) {
  uint64_t slots;
  {
    absl::StatusOr<platform::ShmMapping> head = platform::ShmMapping::Open(name, kSlotsOffset);
    if (!head.ok()) return head.status();
    CompletionRegion h(*std::move(head), 0, 0);
    if (uint64_t m = h.Load(kMagicOffset); m != kMagic) {
      return absl::InvalidArgumentError(absl::StrCat("completion region ", name, ": magic is 0x",
                                                     absl::Hex(m),
                                                     ", not a kvcellar completion region"));
    }
    if (uint64_t v = h.Load(kVersionOffset); v != kVersion) {
      return absl::InvalidArgumentError(absl::StrCat("completion region ", name, ": version ", v,
                                                     " unsupported (want ", kVersion, ")"));
    }
    slots = h.Load(kNumSlotsOffset);
    if (slots == 0 || slots > kMaxSlots) {
      return absl::InvalidArgumentError(absl::StrCat("completion region ", name, ": num_slots ",
                                                     slots, " not in [1, ", kMaxSlots, "]"));
    }
    if (uint64_t l = h.Load(kNumLayersOffset); l != num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("completion region ", name, ": num_layers ", l,
                                                     " differs from the layout's ", num_layers));
    }
  }
  absl::StatusOr<platform::ShmMapping> shm =
      platform::ShmMapping::Open(name, Bytes(static_cast<uint32_t>(slots), num_layers));
  if (!shm.ok()) return shm.status();
  return CompletionRegion(*std::move(shm), static_cast<uint32_t>(slots), num_layers);
}

void CompletionRegion::SignalFailed(uint32_t slot, uint64_t ticket) {
  Store(FailedOffset(num_layers_, slot), ticket);
  for (uint32_t l = 0; l < num_layers_; ++l) SignalLayer(slot, l, ticket);
  SignalDone(slot, ticket);
}

absl::Status CompletionRegion::WaitWord(uint64_t offset, uint32_t slot, uint64_t ticket,
                                        absl::Time deadline) const {
  for (int i = 0;; ++i) {
    if (Load(offset) >= ticket) {
      if (failed_ticket(slot) == ticket) {
        return absl::AbortedError(
            absl::StrCat("op with ticket ", ticket, " on slot ", slot, " failed"));
      }
      return absl::OkStatus();
    }
    if (i < kSpinPolls) continue;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("ticket ", ticket, " on slot ", slot, " not signalled in time"));
    }
    absl::SleepFor(kSleepStep);
  }
}

absl::Status CompletionRegion::WaitLayer(uint32_t slot, uint32_t layer, uint64_t ticket,
                                         absl::Time deadline) const {
  return WaitWord(LayerOffset(num_layers_, slot, layer), slot, ticket, deadline);
}

absl::Status CompletionRegion::WaitDone(uint32_t slot, uint64_t ticket, absl::Time deadline) const {
  return WaitWord(DoneOffset(num_layers_, slot), slot, ticket, deadline);
}

}  // namespace kvcellar::gpu
