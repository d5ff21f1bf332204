// DeviceBackend: moves KV bytes between an engine's device blocks and the daemon's host pages.
//
// One instance per device kind serves every engine of that kind on the node (a daemon with a CUDA
// device may also run a SimDevice for engines whose KV lives in host memory:
// server/datapath/device_set.h). The server opens an EngineMapping per registered engine
// (RegisterEngine) and submits one batched op per RPC: a Gather for Backup (device blocks -> host
// page objects) and a Scatter for Load (host page objects -> device blocks). Ops are asynchronous;
// the server polls or waits on the returned DeviceOp.
//
// Implementations: SimDevice (sim_device.h: host shared memory and memcpy, for engines whose KV
// lives in host memory and for machines without a GPU) and the CUDA device (cuda/cuda_device.h:
// IPC handles, copy streams, batched copies, events).
// Both keep the same semantics:
//   - A Gather reads no engine byte before its ReadyFence fires.
//   - A Scatter lands layer by layer: layer i is signalled (the engine's signal region,
//     core/signal_layout.h) only after every item's layer-i bytes are in engine memory, and signals
//     advance in layer order.
//   - Host pages named in an op belong to the op until DeviceOp::Poll() or Wait() reports it done,
//     also after Cancel() and after a failure: the device may still be writing them until then.
//   - Submit either enqueues the op or fails having copied nothing.
//
// Threading: DeviceBackend and DeviceOp are thread-safe; any RPC thread may call them. An
// EngineMapping may be used by several threads at once, but is destroyed by one thread once no
// other thread submits to it. Destroying it finishes its ops and returns only when no copy can
// touch engine memory any more: the sim device cancels what has not started (CANCELLED) and waits
// for running copies; the CUDA device cannot recall enqueued copies and waits for its streams to
// drain (bounded; see CudaDeviceOptions::close_timeout_ms).
//
// Lifetime: destroy mappings before the backend that opened them (the sim device tolerates the
// reverse; the CUDA device does not). Ops may outlive both.
#ifndef KVCELLAR_GPU_DEVICE_BACKEND_H_
#define KVCELLAR_GPU_DEVICE_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/kv_layout.h"
#include "platform/engine_memory_access.h"
#include "platform/signal_region.h"

namespace kvcellar::gpu {

// The largest batch one op takes. A scheduler step moves at most a few thousand pages; the cap
// bounds the per-op descriptor memory a bad request can make the daemon allocate.
inline constexpr size_t kMaxCopyItems = 65536;
// sizeof(cudaIpcEventHandle_t) and sizeof(cudaIpcMemHandle_t).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// One page object: a device block of one KV group's layers and the host page object (that
// group's KvLayout::GroupObjectBytes(); a slot of PageObjectBytes()) that mirrors it.
struct CopyItem {
  uint32_t device_block = 0;
  uint8_t* host_page = nullptr;
  uint32_t group = 0;  // Always 0 for a model of one group.
};

// What a Gather waits for before it reads engine memory: the engine's signal that the forward
// pass which wrote the blocks is complete.
struct ReadyFence {
  enum class Kind : uint8_t {
    kReady,         // Already complete (the engine synchronized before asking).
    kCudaIpcEvent,  // CUDA: an interprocess event the engine recorded after the forward pass.
    kCounter,       // sim: ready word `slot` of the engine's signal region reaching `counter`.
  };
  Kind kind = Kind::kReady;
  std::string cuda_ipc_event;  // kCudaIpcEvent: the 64-byte cudaIpcEventHandle_t.
  uint32_t slot = 0;           // kCounter: the ready slot.
  uint64_t counter = 0;        // kCounter.

  static ReadyFence Ready() { return {}; }
  static ReadyFence CudaIpcEvent(std::string handle) {
    return {Kind::kCudaIpcEvent, std::move(handle), 0, 0};
  }
  static ReadyFence Counter(uint32_t slot, uint64_t value) {
    return {Kind::kCounter, {}, slot, value};
  }
};

// Where an op reports progress to the engine: a load slot of the engine's signal region
// (core/signal_layout.h) and the op id ("ticket") to store there: a Scatter stores it into each
// layer word as the layer lands, every op ends with the op word (a failed or cancelled one first
// stores the ticket into every layer word, so no waiter blocks). ticket 0 means "no signal".
struct OpSignal {
  uint32_t slot = 0;
  uint64_t ticket = 0;
  bool enabled() const { return ticket != 0; }
};

// Everything the daemon needs to reach one engine rank's KV cache.
struct EngineSpec {
  // The GPU the engine runs on. CUDA: its UUID ("GPU-8e6a..." as nvidia-smi prints it; any case,
  // dashes and prefix optional), which does not depend on CUDA_VISIBLE_DEVICES. sim: any string;
  // checked only when the SimDevice was given a uuid.
  std::string device_uuid;
  core::KvLayout layout;
  // Name of the engine's signal region (a POSIX shm object in the KVCSIG01 format the engine
  // creates: platform::SignalRegion::Create), or empty. Without one, Scatter reports layer
  // progress through DeviceOp::layers_done() only, and sim counter fences are unavailable.
  std::string completion_region;
  // CUDA: the engine's per-layer Load events (docs/api.md "CUDA: IPC events"), one 64-byte
  // cudaIpcEventHandle_t per (load slot, layer), slot-major: (s * layers + l). A Scatter with an
  // enabled OpSignal records event (signal.slot, l) on its stream after layer l's copies, so the
  // engine's stream can wait on exactly that layer. Empty: no load events. The sim device
  // ignores it (its engines use shared-memory counters).
  std::vector<std::string> cuda_load_events;
  // Which shared-memory objects may be mapped for this engine (the sim device's regions and the
  // completion region): the daemon passes the registering peer's (platform/
  // engine_memory_access.h). A CUDA IPC handle carries no owner to check (docs/security.md).
  platform::EngineMemoryAccess memory_access = platform::EngineMemoryAccess::Unchecked();
};

// One asynchronous batched copy. Backends finish it exactly once.
class DeviceOp {
 public:
  enum class Kind : uint8_t { kGather, kScatter };

  DeviceOp(Kind kind, uint32_t num_layers) : kind_(kind), num_layers_(num_layers) {}
  virtual ~DeviceOp() = default;
  DeviceOp(const DeviceOp&) = delete;
  DeviceOp& operator=(const DeviceOp&) = delete;

  Kind kind() const { return kind_; }

  // True once the op has finished, successfully or not. Never blocks.
  bool Poll();
  // Blocks until the op finishes or `timeout` passes; returns Poll().
  bool Wait(absl::Duration timeout);
  // The outcome: OK, CANCELLED, or the device error. UNAVAILABLE("pending") before the op is done.
  absl::Status status() const;
  // Best effort: parts not yet started are skipped and the op finishes CANCELLED (unless it had
  // already finished). Wait for it to finish before reusing its host pages.
  void Cancel() {
    cancel_requested_.store(true, std::memory_order_relaxed);
    OnCancel();
  }

  // Scatter progress: layers 0..layers_done()-1 have landed. A Gather reports 0 until done, then
  // the layer count.
  uint32_t layers_done() const { return layers_done_.load(std::memory_order_acquire); }
  uint32_t num_layers() const { return num_layers_; }

  // --- For backends. ---
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_relaxed); }
  void SetLayersDone(uint32_t n) { layers_done_.store(n, std::memory_order_release); }
  // First call wins; later calls are ignored. Returns whether this call finished the op.
  bool Finish(absl::Status status);

 protected:
  // Lets a backend notice completion it is not told about (CUDA: an event that completed, or a
  // device error). Called by Poll() and periodically by Wait() while the op is pending.
  virtual void Probe() {}
  virtual void OnCancel() {}

 private:
  const Kind kind_;
  const uint32_t num_layers_;
  std::atomic<bool> cancel_requested_{false};
  std::atomic<uint32_t> layers_done_{0};
  std::atomic<bool> done_{false};
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_) = absl::UnavailableError("pending");
};

using OpHandle = std::shared_ptr<DeviceOp>;

// An engine's KV cache opened by a backend. Destroying it closes the mapping (see above).
class EngineMapping {
 public:
  virtual ~EngineMapping() = default;
  virtual const core::KvLayout& layout() const = 0;
  virtual uint64_t page_object_bytes() const = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // "sim" or "cuda".
  virtual absl::string_view name() const = 0;
  // The devices this backend can serve, as canonical UUID strings where known.
  virtual std::vector<std::string> DeviceUuids() const = 0;

  // Validates the layout, finds the device and maps every region (and the completion region) once.
  // INVALID_ARGUMENT names the field; NOT_FOUND for an unknown device or missing object.
  virtual absl::StatusOr<std::unique_ptr<EngineMapping>> OpenEngine(const EngineSpec& spec) = 0;

  // Device -> host: for each item, every layer's K then V block bytes into the page object, once
  // `fence` fires. `signal`, if enabled, gets the op word (or the failure sequence) at the end.
  virtual absl::StatusOr<OpHandle> SubmitGather(EngineMapping& engine,
                                                absl::Span<const CopyItem> items,
                                                const ReadyFence& fence, OpSignal signal) = 0;

  // Host -> device, layer by layer: every item's layer 0, then layer 1, ...; `signal`, if
  // enabled, gets each layer's ticket as it lands, then the op word. Device blocks must be
  // distinct within the batch.
  virtual absl::StatusOr<OpHandle> SubmitScatter(EngineMapping& engine,
                                                 absl::Span<const CopyItem> items,
                                                 OpSignal signal) = 0;

  // Host pool hook: makes [addr, addr + bytes) fast to copy to and from (CUDA: cudaHostRegister,
  // portable and mapped; sim: nothing). Ranges must not overlap; a page object must lie within
  // one range.
  virtual absl::Status RegisterHostMemory(void* addr, size_t bytes) = 0;
  virtual absl::Status UnregisterHostMemory(void* addr) = 0;
};

// Checks a batch against a mapping: INVALID_ARGUMENT naming the item ("items[3].device_block
// (9000) out of range [0, 4096)": its group's blocks in `layout`), a null host page, a group past
// `num_groups`, an oversized batch, or (when `distinct_blocks`) a device block named twice (of
// one group, when the groups have pools of their own). Shared by the backends.
absl::Status ValidateCopyItems(absl::Span<const CopyItem> items, const core::KvLayout& layout,
                               uint32_t num_groups, bool distinct_blocks);

// Maps the engine's signal region (EngineSpec::completion_region) and checks it against the
// layout's layer count. Errors start with "completion_region: " (the server names the
// registration's field from it): NOT_FOUND for a missing object, INVALID_ARGUMENT for a wrong
// header or layer count. Shared by the backends.
absl::StatusOr<platform::SignalRegion> OpenCompletionRegion(
    absl::string_view name, uint32_t num_layers,
    const platform::EngineMemoryAccess& access = platform::EngineMemoryAccess::Unchecked());

// Canonical form of a device UUID: 32 lowercase hex digits, with any "GPU-"/"MIG-" prefix and
// dashes removed. INVALID_ARGUMENT when what remains is not 32 hex digits.
absl::StatusOr<std::string> NormalizeDeviceUuid(absl::string_view uuid);
// nvidia-smi's form of 16 raw UUID bytes: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
std::string FormatGpuUuid(const uint8_t bytes[16]);

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_DEVICE_BACKEND_H_
