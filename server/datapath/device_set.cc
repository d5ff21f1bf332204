#include "server/datapath/device_set.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcellar::server {

v1::DeviceKind KindOf(const gpu::DeviceBackend* backend) {
  if (backend == nullptr) return v1::DEVICE_KIND_UNSPECIFIED;
  if (backend->name() == "sim") return v1::DEVICE_KIND_SIM;
  if (backend->name() == "cuda") return v1::DEVICE_KIND_CUDA;
  return v1::DEVICE_KIND_UNSPECIFIED;
}

DeviceSet::DeviceSet(gpu::DeviceBackend* primary) {
  if (primary != nullptr) Add(primary).IgnoreError();  // No known kind: serves nothing.
}

absl::Status DeviceSet::Add(gpu::DeviceBackend* backend) {
  const v1::DeviceKind kind = KindOf(backend);
  if (kind == v1::DEVICE_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("device backend \"",
                                                   backend == nullptr ? "null" : backend->name(),
                                                   "\" has no DeviceKind"));
  }
  if (For(kind) != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(v1::DeviceKind_Name(kind), " is already served by a backend"));
  }
  kinds_.push_back(kind);
  backends_.push_back(backend);
  return absl::OkStatus();
}

gpu::DeviceBackend* DeviceSet::For(v1::DeviceKind kind) const {
  auto it = std::find(kinds_.begin(), kinds_.end(), kind);
  return it == kinds_.end() ? nullptr : backends_[it - kinds_.begin()];
}

gpu::DeviceBackend* DeviceSet::primary() const {
  return backends_.empty() ? nullptr : backends_.front();
}

v1::DeviceKind DeviceSet::primary_kind() const {
  return kinds_.empty() ? v1::DEVICE_KIND_UNSPECIFIED : kinds_.front();
}

std::string DeviceKindNames(absl::Span<const v1::DeviceKind> kinds, absl::string_view if_none) {
  if (kinds.empty()) return std::string(if_none);
  return absl::StrJoin(kinds, ", ", [](std::string* out, v1::DeviceKind kind) {
    out->append(v1::DeviceKind_Name(kind));
  });
}

std::string DeviceSet::KindNames() const { return DeviceKindNames(kinds_, "none"); }

}  // namespace kvcellar::server
