#include "gpu/device_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvcellar::gpu {
namespace {

// How often Wait() lets a backend probe for completion it is not notified of. Only matters on
// error paths (a CUDA context that died before running the op's host callback).
constexpr absl::Duration kProbeInterval = absl::Milliseconds(1);

}  // namespace

bool DeviceOp::Poll() {
  if (done_.load(std::memory_order_acquire)) return true;
  Probe();
  return done_.load(std::memory_order_acquire);
}

bool DeviceOp::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!Poll()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    const absl::Time slice = std::min(deadline, now + kProbeInterval);
    auto finished = [this]() { return done_.load(std::memory_order_acquire); };
    mu_.LockWhenWithDeadline(absl::Condition(&finished), slice);
    mu_.Unlock();
  }
  return true;
}

absl::Status DeviceOp::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

bool DeviceOp::Finish(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (done_.load(std::memory_order_relaxed)) return false;
  status_ = std::move(status);
  if (status_.ok()) SetLayersDone(num_layers_);
  done_.store(true, std::memory_order_release);
  return true;
}

absl::Status ValidateCopyItems(absl::Span<const CopyItem> items, const core::KvLayout& layout,
                               uint32_t num_groups, bool distinct_blocks) {
  if (items.size() > kMaxCopyItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("items: ", items.size(), " in one batch, more than ", kMaxCopyItems));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].group >= num_groups) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "].group (", items[i].group,
                                                     ") out of range [0, ", num_groups, ")"));
    }
    const uint32_t blocks = layout.GroupBlocks(items[i].group);
    if (items[i].device_block >= blocks) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "].device_block (",
                                                     items[i].device_block, ") out of range [0, ",
                                                     blocks, ")"));
    }
    if (items[i].host_page == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "].host_page is null"));
    }
  }
  if (distinct_blocks && items.size() > 1) {
    // Two pages scattered into one block would race: the block's bytes would be neither page.
    // Groups with pools of their own have blocks of their own: (group, block) is the block.
    const bool own_pools = layout.separate_group_pools();
    std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint32_t>> order(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      order[i] = {{own_pools ? items[i].group : 0, items[i].device_block},
                  static_cast<uint32_t>(i)};
    }
    std::sort(order.begin(), order.end());
    for (size_t i = 1; i < order.size(); ++i) {
      if (order[i].first == order[i - 1].first) {
        return absl::InvalidArgumentError(
            absl::StrCat("items[", order[i].second, "].device_block (", order[i].first.second,
                         ") duplicates items[", order[i - 1].second, "].device_block"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<platform::SignalRegion> OpenCompletionRegion(
    absl::string_view name, uint32_t num_layers, const platform::EngineMemoryAccess& access) {
  absl::StatusOr<platform::SignalRegion> r = platform::SignalRegion::Open(name, access);
  if (!r.ok()) {
    return platform::WithPrefix(r.status(), "completion_region: ");
  }
  if (r->num_layers() != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("completion_region: ", name, ": num_layers ",
                                                   r->num_layers(), " differs from the layout's ",
                                                   num_layers));
  }
  return r;
}

absl::StatusOr<std::string> NormalizeDeviceUuid(absl::string_view uuid) {
  absl::string_view rest = uuid;
  if (rest.size() >= 4 && (absl::EqualsIgnoreCase(rest.substr(0, 4), "GPU-") ||
                           absl::EqualsIgnoreCase(rest.substr(0, 4), "MIG-"))) {
    rest.remove_prefix(4);
  }
  std::string hex;
  hex.reserve(32);
  for (char c : rest) {
    if (c == '-') continue;
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_uuid \"", uuid, "\": not a GPU UUID (hex digits and dashes)"));
    }
    hex.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
  }
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_uuid \"", uuid, "\": ", hex.size(), " hex digits, want 32"));
  }
  return hex;
}

std::string FormatGpuUuid(const uint8_t b[16]) {
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

}  // namespace kvcellar::gpu
