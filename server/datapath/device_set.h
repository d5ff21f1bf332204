// DeviceSet: the device backends a daemon serves, by the DeviceKind engines register with.
//
// A daemon has one primary backend (config device.kind). With a CUDA primary it may also have a
// sim backend for engines whose KV lives in host shared memory (device.host_memory_engines:
// SGLang's HiCache host pool). A session uses the backend of its own kind (SessionInfo
// device_kind) for OpenEngine and every copy; the L2 pool is registered with the primary only
// (cudaHostRegister; the sim device needs no registration). With one backend the set has one
// entry and the same code path runs.
//
// Does not own the backends: the daemon (or a test) does, and they outlive every user of the set.
// Immutable once built, so any thread may read it.
#ifndef KVCELLAR_SERVER_DATAPATH_DEVICE_SET_H_
#define KVCELLAR_SERVER_DATAPATH_DEVICE_SET_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/common.pb.h"

namespace kvcellar::server {

// The kind a backend serves, from its name(): "cuda" -> CUDA, "sim" -> SIM; UNSPECIFIED for
// nullptr or another name.
v1::DeviceKind KindOf(const gpu::DeviceBackend* backend);

// For messages: "DEVICE_KIND_CUDA, DEVICE_KIND_SIM"; `if_none` when `kinds` is empty.
std::string DeviceKindNames(absl::Span<const v1::DeviceKind> kinds, absl::string_view if_none);

class DeviceSet {
 public:
  // Serves nothing: WORKER registrations are refused (DEVICE_UNAVAILABLE).
  DeviceSet() = default;
  // One backend, or none when `primary` is nullptr.
  explicit DeviceSet(gpu::DeviceBackend* primary);

  // Adds `backend` as the one serving KindOf(backend); the first added is the primary.
  // INVALID_ARGUMENT for a backend of no known kind or a kind already served.
  absl::Status Add(gpu::DeviceBackend* backend);

  // The backend serving `kind`, or nullptr.
  gpu::DeviceBackend* For(v1::DeviceKind kind) const;
  // The primary backend and its kind (nullptr and UNSPECIFIED when empty).
  gpu::DeviceBackend* primary() const;
  v1::DeviceKind primary_kind() const;
  // The kinds served, primary first.
  absl::Span<const v1::DeviceKind> kinds() const { return kinds_; }
  bool empty() const { return kinds_.empty(); }
  // For messages: "DEVICE_KIND_CUDA, DEVICE_KIND_SIM", or "none".
  std::string KindNames() const;

 private:
  std::vector<v1::DeviceKind> kinds_;
  std::vector<gpu::DeviceBackend*> backends_;  // Parallel to kinds_.
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_DATAPATH_DEVICE_SET_H_
