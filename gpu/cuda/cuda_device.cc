#include "gpu/cuda/cuda_device.h"

#include <cuda.h>  // Types of the driver entry point used below; no libcuda link needed.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/signal_layout.h"
#include "gpu/cuda/copy_kernels.h"
#include "platform/log.h"
#include "platform/signal_region.h"

namespace kvcellar::gpu {
namespace {

using cuda::CopyRun;

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes);

// An engine records its forward-pass event into one of a few IPC events; the cap bounds what a
// misbehaving engine can make the daemon hold.
constexpr size_t kMaxCachedFenceEvents = 64;
// Poll step while draining a mapping's streams at close.
constexpr absl::Duration kDrainPollStep = absl::Microseconds(200);

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorMapBufferObjectFailed:
    case cudaErrorDeviceUninitialized:
      return absl::InvalidArgumentError(msg);
    case cudaErrorMemoryAllocation:
    case cudaErrorTooManyPeers:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Makes `device` current for the scope (the runtime's current device is per thread, and RPC
// threads serve engines on every GPU).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) status_ = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~ScopedDevice() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  const int device_;
  int previous_ = -1;
  absl::Status status_;
};

struct DeviceInfo {
  int index = 0;
  std::string uuid;     // Canonical: 32 lowercase hex digits.
  std::string display;  // "GPU-xxxxxxxx-...".
  std::string name;
  // Registered host memory has the same address on the device (UVA): true on every x86-64
  // server GPU of the last decade, checked anyway.
  bool host_ptr_is_device_ptr = false;
};

// A copy stream that is destroyed explicitly, never by a destructor: ops keep a reference to
// probe it, and the last reference may be dropped inside a CUDA host callback, where no CUDA call
// is allowed.
class Stream {
 public:
  static absl::StatusOr<std::shared_ptr<Stream>> Create(int device) {
    auto s = std::shared_ptr<Stream>(new Stream(device));
    absl::MutexLock lock(&s->mu_);
    if (absl::Status st = CudaStatus(cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking),
                                     "cudaStreamCreateWithFlags");
        !st.ok()) {
      s->destroyed_ = true;
      return st;
    }
    return s;
  }
  cudaStream_t get() const { return stream_; }
  // cudaStreamQuery; cudaSuccess once destroyed (everything on it had finished by then).
  cudaError_t Query() {
    absl::MutexLock lock(&mu_);
    if (destroyed_) return cudaSuccess;
    ScopedDevice sd(device_);
    return cudaStreamQuery(stream_);
  }
  // Only after the stream drained.
  void Destroy() {
    absl::MutexLock lock(&mu_);
    if (destroyed_) return;
    cudaStreamDestroy(stream_);
    destroyed_ = true;
  }

 private:
  explicit Stream(int device) : device_(device) {}
  const int device_;
  absl::Mutex mu_;
  cudaStream_t stream_ = nullptr;  // Set once in Create.
  bool destroyed_ ABSL_GUARDED_BY(mu_) = false;
};

// Host ranges registered by the host pool, and their device-side addresses per device.
class HostRanges {
 public:
  absl::Status Add(uint8_t* base, size_t bytes, std::vector<uint8_t*> device_base) {
    absl::WriterMutexLock lock(&mu_);
    if (Overlaps(base, bytes)) {
      return absl::InvalidArgumentError("RegisterHostMemory: range overlaps a registered one");
    }
    ranges_[reinterpret_cast<uintptr_t>(base)] = Range{bytes, std::move(device_base)};
    return absl::OkStatus();
  }
  bool Overlapping(uint8_t* base, size_t bytes) {
    absl::ReaderMutexLock lock(&mu_);
    return Overlaps(base, bytes);
  }
  bool Remove(void* base) {
    absl::WriterMutexLock lock(&mu_);
    return ranges_.erase(reinterpret_cast<uintptr_t>(base)) == 1;
  }
  // Device-side address of [p, p + bytes) on device `d`; nullptr unless one registered range
  // holds all of it.
  uint8_t* DeviceAddress(const uint8_t* p, size_t bytes, int d) {
    absl::ReaderMutexLock lock(&mu_);
    return Find(p, bytes, d);
  }
  // Same for a batch, under one lock; false when any page is outside registered memory.
  bool DeviceAddresses(absl::Span<const CopyItem> items, uint64_t bytes, int d,
                       std::vector<uint8_t*>& out) {
    absl::ReaderMutexLock lock(&mu_);
    out.resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      out[i] = Find(items[i].host_page, bytes, d);
      if (out[i] == nullptr) return false;
    }
    return true;
  }

 private:
  struct Range {
    size_t bytes;
    std::vector<uint8_t*> device_base;
  };
  bool Overlaps(uint8_t* base, size_t bytes) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const uintptr_t b = reinterpret_cast<uintptr_t>(base);
    auto it = ranges_.lower_bound(b);
    if (it != ranges_.end() && it->first < b + bytes) return true;
    if (it != ranges_.begin() && std::prev(it)->first + std::prev(it)->second.bytes > b) {
      return true;
    }
    return false;
  }
  uint8_t* Find(const uint8_t* p, size_t bytes, int d) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return nullptr;
    --it;
    if (a + bytes > it->first + it->second.bytes) return nullptr;
    return it->second.device_base[d] + (a - it->first);
  }

  absl::Mutex mu_;
  std::map<uintptr_t, Range> ranges_ ABSL_GUARDED_BY(mu_);
};

class CudaOp final : public DeviceOp {
 public:
  CudaOp(Kind kind, uint32_t num_layers, std::shared_ptr<Stream> stream)
      : DeviceOp(kind, num_layers), stream_(std::move(stream)) {}

  // Called once the stream has passed the op (host callback or probe).
  void FinishFromDevice() {
    absl::Status s;
    {
      absl::MutexLock lock(&mu_);
      s = enqueue_error_;
    }
    Finish(std::move(s));
  }
  void SetEnqueueError(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (enqueue_error_.ok()) enqueue_error_ = std::move(s);
  }

 protected:
  // Finishes the op when its stream has drained (the host callback may not have run yet) or
  // failed (a sticky device error: the callback would never run).
  void Probe() override {
    const cudaError_t e = stream_->Query();
    if (e == cudaSuccess) {
      FinishFromDevice();
    } else if (e != cudaErrorNotReady) {
      Finish(CudaStatus(e, "copy stream"));
    }
  }

 private:
  const std::shared_ptr<Stream> stream_;
  absl::Mutex mu_;
  absl::Status enqueue_error_ ABSL_GUARDED_BY(mu_);
};

void CUDART_CB OnOpDone(void* arg) {
  // No CUDA call here (host callbacks may not make any); dropping the op's last reference is fine:
  // neither CudaOp nor Stream calls CUDA on destruction.
  std::unique_ptr<std::shared_ptr<CudaOp>> op(static_cast<std::shared_ptr<CudaOp>*>(arg));
  (*op)->FinishFromDevice();
}

class CudaEngine final : public EngineMapping {
 public:
  CudaEngine(const DeviceInfo& dev, const CudaDeviceOptions& options)
      : dev(dev), options(options) {}
  ~CudaEngine() override { Close(); }

  const core::KvLayout& layout() const override { return layout_; }
  uint64_t page_object_bytes() const override { return object_bytes; }

  const DeviceInfo& dev;  // Owned by the device, which outlives its mappings.
  const CudaDeviceOptions options;
  core::KvLayout layout_;
  std::vector<core::PageSegment> segs;
  std::vector<uint8_t*> seg_base;     // Device address of block 0 of each segment.
  std::vector<uint32_t> layer_first;  // First segment of each layer, plus segs.size().
  uint64_t object_bytes = 0;
  double mean_run_bytes = 0;    // Of one object after merging contiguous segments.
  std::vector<void*> ipc_ptrs;  // Opened allocations, closed at Close().
  std::shared_ptr<Stream> gather_stream;
  std::shared_ptr<Stream> scatter_stream;
  platform::SignalRegion completion;
  uint8_t* completion_dev = nullptr;  // Device-side address of completion.base().
  bool completion_registered = false;

  absl::Mutex mu;  // Serializes enqueueing on this engine's streams and the scratch below.
  bool closed ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_map<std::string, cudaEvent_t> fence_events ABSL_GUARDED_BY(mu);
  // The engine's per-layer Load events, opened once at mapping: (slot * layers + layer).
  std::vector<cudaEvent_t> load_events;
  // Scratch reused by every op, so that a batch allocates nothing once warm.
  std::vector<CopyRun> runs ABSL_GUARDED_BY(mu);
  std::vector<void*> dsts ABSL_GUARDED_BY(mu);
  std::vector<const void*> srcs ABSL_GUARDED_BY(mu);
  std::vector<size_t> sizes ABSL_GUARDED_BY(mu);
  std::vector<uint8_t*> host_dev ABSL_GUARDED_BY(mu);

  uint64_t* CompletionWord(uint64_t offset) const {
    return reinterpret_cast<uint64_t*>(completion_dev + offset);
  }

  void Close() {
    absl::MutexLock lock(&mu);
    if (closed) return;
    closed = true;
    ScopedDevice sd(dev.index);
    // Copies may still read or write engine memory and the completion region: let them finish.
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options.close_timeout_ms);
    for (Stream* s : {gather_stream.get(), scatter_stream.get()}) {
      if (s == nullptr) continue;
      while (s->Query() == cudaErrorNotReady) {
        if (absl::Now() >= deadline) {
          // Most likely a fence the engine recorded but never reached (it died mid-step).
          // Unmapping under a copy that may still run would be worse than the leak.
          KVLOG(Error, "engine close: copies still pending at the deadline; leaking its mappings",
                {{"device", dev.display}, {"timeout_ms", options.close_timeout_ms}});
          return;
        }
        absl::SleepFor(kDrainPollStep);
      }
    }
    for (auto& [handle, ev] : fence_events) cudaEventDestroy(ev);
    fence_events.clear();
    for (cudaEvent_t ev : load_events) cudaEventDestroy(ev);
    load_events.clear();
    for (void* p : ipc_ptrs) cudaIpcCloseMemHandle(p);
    ipc_ptrs.clear();
    if (completion_registered) cudaHostUnregister(completion.base());
    completion_registered = false;
    completion = platform::SignalRegion();
    if (gather_stream) gather_stream->Destroy();
    if (scatter_stream) scatter_stream->Destroy();
  }
};

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

class CudaDevice final : public DeviceBackend {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceBackend>> Create(const CudaDeviceOptions& options) {
    int n = 0;
    if (absl::Status s = CudaStatus(cudaGetDeviceCount(&n), "cudaGetDeviceCount"); !s.ok()) {
      return absl::UnavailableError(s.message());
    }
    if (n == 0) return absl::UnavailableError("no CUDA device visible");
    auto dev = std::unique_ptr<CudaDevice>(new CudaDevice(options));
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp prop;
      if (absl::Status s = CudaStatus(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties");
          !s.ok()) {
        return s;
      }
      DeviceInfo info;
      info.index = i;
      info.display = FormatGpuUuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes));
      info.uuid = *NormalizeDeviceUuid(info.display);
      info.name = prop.name;
      int attr = 0;
      if (cudaDeviceGetAttribute(&attr, cudaDevAttrCanUseHostPointerForRegisteredMem, i) ==
          cudaSuccess) {
        info.host_ptr_is_device_ptr = attr != 0;
      }
      KVLOG(Info, "cuda device", {{"index", i}, {"uuid", info.display}, {"name", info.name}});
      dev->devices_.push_back(std::move(info));
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      dev->mem_get_address_range_ = reinterpret_cast<MemGetAddressRangeFn>(fn);
    }
    return std::unique_ptr<DeviceBackend>(std::move(dev));
  }

  absl::string_view name() const override { return "cuda"; }

  std::vector<std::string> DeviceUuids() const override {
    std::vector<std::string> out;
    for (const DeviceInfo& d : devices_) out.push_back(d.display);
    return out;
  }

  absl::StatusOr<std::unique_ptr<EngineMapping>> OpenEngine(const EngineSpec& spec) override;
  // The device with this UUID (any spelling NormalizeDeviceUuid takes); NotFound when not here.
  absl::StatusOr<const DeviceInfo*> FindDevice(const std::string& device_uuid) const;

  absl::StatusOr<OpHandle> SubmitGather(EngineMapping& engine, absl::Span<const CopyItem> items,
                                        const ReadyFence& fence, OpSignal signal) override {
    return Submit(engine, items, fence, signal, /*scatter=*/false);
  }
  absl::StatusOr<OpHandle> SubmitScatter(EngineMapping& engine, absl::Span<const CopyItem> items,
                                         OpSignal signal) override {
    return Submit(engine, items, ReadyFence::Ready(), signal, /*scatter=*/true);
  }

  absl::Status RegisterHostMemory(void* addr, size_t bytes) override;
  absl::Status UnregisterHostMemory(void* addr) override;

 private:
  explicit CudaDevice(const CudaDeviceOptions& options) : options_(options) {}

  absl::StatusOr<OpHandle> Submit(EngineMapping& mapping, absl::Span<const CopyItem> items,
                                  const ReadyFence& fence, OpSignal signal, bool scatter);
  absl::Status FenceEvent(CudaEngine& e, const std::string& handle, cudaEvent_t* ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu);
  absl::Status IssueRuns(CudaEngine& e, cudaStream_t stream, bool kernel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu);
  // The phases of Submit once the stream is chosen: a Gather's copies then its op word; a
  // Scatter's copies layer by layer, each followed by its layer's event or word, then the op word;
  // after an enqueue error, every signal the engine may wait on, so that no wait hangs.
  absl::Status EnqueueGather(CudaEngine& e, absl::Span<const CopyItem> items, bool kernel,
                             OpSignal signal, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu);
  absl::Status EnqueueScatter(CudaEngine& e, absl::Span<const CopyItem> items, bool kernel,
                              OpSignal signal, bool layer_events, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu);
  void EnqueueFailureSignals(CudaEngine& e, OpSignal signal, bool layer_events,
                             cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu);

  const CudaDeviceOptions options_;
  std::vector<DeviceInfo> devices_;
  HostRanges host_;
  MemGetAddressRangeFn mem_get_address_range_ = nullptr;
  // cleared the first time the driver refuses cudaMemcpyBatchAsync.
  std::atomic<bool> batch_api_ok_{CUDART_VERSION >= 12080};
};

// ---- OpenEngine, in phases ---------------------------------------------------------------------

// Every region names its allocation with a whole cudaIpcMemHandle_t.
absl::Status CheckRegionHandles(const core::KvLayout& layout) {
  for (size_t i = 0; i < layout.regions.size(); ++i) {
    if (layout.regions[i].handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("regions[", i, "].handle: ", layout.regions[i].handle.size(),
                       " bytes; a cudaIpcMemHandle_t has ", kCudaIpcHandleBytes));
    }
  }
  return absl::OkStatus();
}

// Opens each region's allocation once (regions may share one), checks that it lives on the
// engine's device and that the region fits in it, and places every segment at its device address.
absl::Status MapRegions(CudaEngine& e, MemGetAddressRangeFn mem_get_address_range) {
  const core::KvLayout& layout = e.layout_;
  absl::flat_hash_map<std::string, uint8_t*> base;  // Handle -> opened allocation base.
  for (size_t i = 0; i < layout.regions.size(); ++i) {
    const core::MemoryRegion& r = layout.regions[i];
    auto it = base.find(r.handle);
    if (it == base.end()) {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, r.handle.data(), sizeof(h));
      void* p = nullptr;
      if (absl::Status s = CudaStatus(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                                      "cudaIpcOpenMemHandle");
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("regions[", i, "].handle: ", s.message()));
      }
      e.ipc_ptrs.push_back(p);
      cudaPointerAttributes attr;
      if (cudaPointerGetAttributes(&attr, p) == cudaSuccess && attr.device != e.dev.index) {
        return absl::InvalidArgumentError(
            absl::StrCat("regions[", i, "]: the allocation lives on CUDA device ", attr.device,
                         ", not on ", e.dev.display, " (device_uuid)"));
      }
      it = base.emplace(r.handle, static_cast<uint8_t*>(p)).first;
    }
    if (mem_get_address_range != nullptr) {
      CUdeviceptr alloc_base = 0;
      size_t alloc_size = 0;
      if (mem_get_address_range(&alloc_base, &alloc_size,
                                reinterpret_cast<CUdeviceptr>(it->second)) == CUDA_SUCCESS) {
        const uint64_t end =
            reinterpret_cast<CUdeviceptr>(it->second) - alloc_base + r.offset + r.size;
        if (end > alloc_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("regions[", i, "]: offset + size (", r.offset + r.size,
                           ") past the allocation's ", alloc_size, " bytes"));
        }
      }
    }
  }
  for (const core::PageSegment& s : e.segs) {
    const core::MemoryRegion& r = layout.regions[s.region];
    e.seg_base.push_back(base[r.handle] + r.offset + s.device_offset);
  }
  return absl::OkStatus();
}

// Where each layer's segments start, and the mean run of an object once contiguous segments are
// merged (what the copy path is chosen by).
void PlanLayersAndRuns(CudaEngine& e) {
  for (uint32_t i = 0; i < e.segs.size(); ++i) {
    if (i == 0 || e.segs[i].layer != e.segs[i - 1].layer) e.layer_first.push_back(i);
  }
  e.layer_first.push_back(static_cast<uint32_t>(e.segs.size()));
  uint32_t runs = 0;
  for (uint32_t s = 0; s < e.segs.size(); ++s) {
    if (s == 0 || e.seg_base[s] != e.seg_base[s - 1] + e.segs[s - 1].bytes) ++runs;
  }
  e.mean_run_bytes = static_cast<double>(e.object_bytes) / runs;
}

absl::Status CreateStreams(CudaEngine& e) {
  absl::StatusOr<std::shared_ptr<Stream>> gs = Stream::Create(e.dev.index);
  if (!gs.ok()) return gs.status();
  e.gather_stream = *std::move(gs);
  absl::StatusOr<std::shared_ptr<Stream>> ss = Stream::Create(e.dev.index);
  if (!ss.ok()) return ss.status();
  e.scatter_stream = *std::move(ss);
  return absl::OkStatus();
}

// Maps the engine's completion region, registered with CUDA so that kernels store into it.
absl::Status AttachCompletion(CudaEngine& e, const std::string& completion_region,
                              const platform::EngineMemoryAccess& access) {
  absl::StatusOr<platform::SignalRegion> c = OpenCompletionRegion(
      completion_region, static_cast<uint32_t>(e.layout_.layers.size()), access);
  if (!c.ok()) return c.status();
  e.completion = *std::move(c);
  // Whole pages: the mapping has them, and older drivers wanted page-aligned sizes.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t registered = (e.completion.size() + page - 1) / page * page;
  if (absl::Status s =
          CudaStatus(cudaHostRegister(e.completion.base(), registered,
                                      cudaHostRegisterPortable | cudaHostRegisterMapped),
                     "completion_region: cudaHostRegister");
      !s.ok()) {
    return s;
  }
  e.completion_registered = true;
  if (e.dev.host_ptr_is_device_ptr) {
    e.completion_dev = e.completion.base();
    return absl::OkStatus();
  }
  void* p = nullptr;
  if (absl::Status s = CudaStatus(cudaHostGetDevicePointer(&p, e.completion.base(), 0),
                                  "completion_region: cudaHostGetDevicePointer");
      !s.ok()) {
    return s;
  }
  e.completion_dev = static_cast<uint8_t*>(p);
  return absl::OkStatus();
}

// Opens the engine's per-layer Load events: whole slots of one event per layer.
absl::Status OpenLoadEvents(CudaEngine& e, const std::vector<std::string>& handles) {
  const size_t layers = e.layout_.layers.size();
  if (layers == 0 || handles.size() % layers != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_load_events: ", handles.size(),
                     " handles is not a whole number of slots of ", layers, " layers"));
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    const std::string& handle = handles[i];
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_load_events[", i, "]: ",
                                                     handle.size(), " bytes; 64 required"));
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t ev;
    if (absl::Status s = CudaStatus(cudaIpcOpenEventHandle(&ev, h), "cudaIpcOpenEventHandle");
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("cuda_load_events[", i, "]: ", s.message()));
    }
    e.load_events.push_back(ev);
  }
  return absl::OkStatus();
}

absl::StatusOr<const DeviceInfo*> CudaDevice::FindDevice(const std::string& device_uuid) const {
  absl::StatusOr<std::string> uuid = NormalizeDeviceUuid(device_uuid);
  if (!uuid.ok()) return uuid.status();
  const DeviceInfo* dev = nullptr;
  for (const DeviceInfo& d : devices_) {
    if (d.uuid == *uuid) dev = &d;
  }
  if (dev == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("device_uuid \"", device_uuid, "\": no such CUDA device here"));
  }
  return dev;
}

absl::StatusOr<std::unique_ptr<EngineMapping>> CudaDevice::OpenEngine(const EngineSpec& spec) {
  absl::StatusOr<const DeviceInfo*> found = FindDevice(spec.device_uuid);
  if (!found.ok()) return found.status();
  const DeviceInfo* dev = *found;
  const core::KvLayout& layout = spec.layout;
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (absl::Status s = CheckRegionHandles(layout); !s.ok()) return s;
  if (layout.NumGroups() > 1) {
    // The copy kernels pack one object per block over every layer; per-group objects are served
    // for host-memory engines (docs/api.md "Groups").
    return absl::FailedPreconditionError(
        "layers: KV groups (a hybrid model) are not served for CUDA engines in this revision");
  }
  ScopedDevice sd(dev->index);
  if (!sd.status().ok()) return sd.status();
  if (absl::Status s = CudaStatus(cuda::LoadKernels(), "loading the copy kernels"); !s.ok()) {
    return s;
  }

  auto e = std::make_unique<CudaEngine>(*dev, options_);  // Cleans up after itself on failure.
  e->layout_ = layout;
  e->segs = core::PageSegments(layout);
  e->object_bytes = layout.PageObjectBytes();
  if (absl::Status s = MapRegions(*e, mem_get_address_range_); !s.ok()) return s;
  PlanLayersAndRuns(*e);
  if (absl::Status s = CreateStreams(*e); !s.ok()) return s;
  if (!spec.completion_region.empty()) {
    if (absl::Status s = AttachCompletion(*e, spec.completion_region, spec.memory_access);
        !s.ok()) {
      return s;
    }
  }
  if (!spec.cuda_load_events.empty()) {
    if (absl::Status s = OpenLoadEvents(*e, spec.cuda_load_events); !s.ok()) return s;
  }
  KVLOG(Info, "engine mapped",
        {{"backend", "cuda"},
         {"device", dev->display},
         {"regions", layout.regions.size()},
         {"layers", layout.layers.size()},
         {"blocks", layout.num_blocks},
         {"object_bytes", e->object_bytes},
         {"mean_run_bytes", static_cast<uint64_t>(e->mean_run_bytes)}});
  return std::unique_ptr<EngineMapping>(std::move(e));
}

absl::Status CudaDevice::FenceEvent(CudaEngine& e, const std::string& handle, cudaEvent_t* ev) {
  auto it = e.fence_events.find(handle);
  if (it != e.fence_events.end()) {
    *ev = it->second;
    return absl::OkStatus();
  }
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  if (absl::Status s = CudaStatus(cudaIpcOpenEventHandle(ev, h), "cudaIpcOpenEventHandle");
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fence.cuda_ipc_event: ", s.message()));
  }
  if (e.fence_events.size() >= kMaxCachedFenceEvents) {
    // Destroying an event a stream still waits on is safe: CUDA releases it once complete.
    for (auto& [k, old] : e.fence_events) cudaEventDestroy(old);
    e.fence_events.clear();
  }
  e.fence_events.emplace(handle, *ev);
  return absl::OkStatus();
}

absl::Status CudaDevice::IssueRuns(CudaEngine& e, cudaStream_t stream, bool kernel) {
  std::vector<CopyRun>& runs = e.runs;
  if (runs.empty()) return absl::OkStatus();
  if (kernel) {
    for (size_t i = 0; i < runs.size(); i += cuda::kMaxRunsPerLaunch) {
      const uint32_t n =
          static_cast<uint32_t>(std::min<size_t>(cuda::kMaxRunsPerLaunch, runs.size() - i));
      if (absl::Status s = CudaStatus(
              cuda::LaunchCopyRuns(runs.data() + i, n, options_.kernel_max_blocks, stream),
              "copy kernel");
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
#if CUDART_VERSION >= 12080
  if (batch_api_ok_.load(std::memory_order_relaxed)) {
    e.dsts.clear();
    e.srcs.clear();
    e.sizes.clear();
    for (const CopyRun& r : runs) {
      e.dsts.push_back(r.dst);
      e.srcs.push_back(r.src);
      e.sizes.push_back(r.bytes);
    }
    cudaMemcpyAttributes attr;
    std::memset(&attr, 0, sizeof(attr));
    // Sources are read in stream order: after the fence wait before them on the stream.
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaMemcpyBatchAsync(e.dsts.data(), e.srcs.data(), e.sizes.data(),
                                                 runs.size(), &attr, &attr_index, 1, stream);
#else
    size_t fail_index = 0;
    const cudaError_t err =
        cudaMemcpyBatchAsync(e.dsts.data(), const_cast<void**>(e.srcs.data()), e.sizes.data(),
                             runs.size(), &attr, &attr_index, 1, &fail_index, stream);
#endif
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotSupported && err != cudaErrorInvalidValue &&
        err != cudaErrorCallRequiresNewerDriver) {
      return CudaStatus(err, "cudaMemcpyBatchAsync");
    }
    cudaGetLastError();  // Not sticky: clear it and use the per-run path from now on.
    batch_api_ok_.store(false, std::memory_order_relaxed);
    KVLOG(Warn, "cudaMemcpyBatchAsync refused; using cudaMemcpyAsync per run",
          {{"error", cudaGetErrorName(err)}});
  }
#endif
  for (const CopyRun& r : runs) {
    if (absl::Status s = CudaStatus(
            cudaMemcpyAsync(r.dst, r.src, r.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// The request's own checks, before anything is enqueued: the items, the fence's kind, and the
// signal's slot. `layer_events` says how a Scatter signals its layers: the engine's IPC events
// when it registered them, else words stored into its signal region.
absl::Status CheckSubmit(const CudaEngine& e, absl::Span<const CopyItem> items,
                         const ReadyFence& fence, OpSignal signal, bool scatter,
                         bool layer_events) {
  if (absl::Status s = ValidateCopyItems(items, e.layout_, /*num_groups=*/1, scatter); !s.ok())
    return s;
  switch (fence.kind) {
    case ReadyFence::Kind::kReady:
      break;
    case ReadyFence::Kind::kCounter:
      return absl::InvalidArgumentError(
          "fence.kind: the CUDA device waits on CUDA IPC events, not counter fences");
    case ReadyFence::Kind::kCudaIpcEvent:
      if (fence.cuda_ipc_event.size() != kCudaIpcHandleBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("fence.cuda_ipc_event: ", fence.cuda_ipc_event.size(),
                         " bytes; a cudaIpcEventHandle_t has 64"));
      }
      break;
  }
  const uint32_t num_layers = static_cast<uint32_t>(e.layout_.layers.size());
  if (layer_events) {
    const size_t slots = e.load_events.size() / num_layers;
    if (signal.slot >= slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("signal.slot (", signal.slot, ") out of range [0, ", slots, ")"));
    }
  } else if (signal.enabled()) {
    if (!e.completion.valid()) {
      return absl::InvalidArgumentError(
          "signal: the engine registered no completion_region to signal");
    }
    if (signal.slot >= e.completion.num_load_slots()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "signal.slot (", signal.slot, ") out of range [0, ", e.completion.num_load_slots(), ")"));
    }
  }
  return absl::OkStatus();
}

// Appends the segments [first, last) of `item` (its host page at `host`) to e.runs, merging runs
// contiguous on both sides.
void AppendRuns(CudaEngine& e, const CopyItem& item, uint8_t* host, uint32_t first, uint32_t last,
                bool scatter) {
  const uint64_t block = item.device_block;
  for (uint32_t s = first; s < last;) {
    uint8_t* dev = e.seg_base[s] + block * e.segs[s].block_stride;
    uint64_t len = e.segs[s].bytes;
    uint32_t next = s + 1;
    while (next < last && e.seg_base[next] + block * e.segs[next].block_stride == dev + len) {
      len += e.segs[next++].bytes;
    }
    uint8_t* h = host + e.segs[s].object_offset;
    if (scatter) {
      e.runs.push_back({h, dev, len});
    } else {
      e.runs.push_back({dev, h, len});
    }
    s = next;
  }
}

absl::StatusOr<OpHandle> CudaDevice::Submit(EngineMapping& mapping,
                                            absl::Span<const CopyItem> items,
                                            const ReadyFence& fence, OpSignal signal,
                                            bool scatter) {
  auto* ep = dynamic_cast<CudaEngine*>(&mapping);
  if (ep == nullptr) return absl::InvalidArgumentError("engine: not a mapping of the CUDA device");
  CudaEngine& e = *ep;
  const uint32_t num_layers = static_cast<uint32_t>(e.layout_.layers.size());
  const bool layer_events = signal.enabled() && scatter && !e.load_events.empty();
  if (absl::Status s = CheckSubmit(e, items, fence, signal, scatter, layer_events); !s.ok()) {
    return s;
  }
  const int d = e.dev.index;
  ScopedDevice sd(d);
  if (!sd.status().ok()) return sd.status();

  absl::MutexLock lock(&e.mu);
  if (e.closed) return absl::FailedPreconditionError("engine: mapping is closed");
  std::shared_ptr<Stream>& stream_ref = scatter ? e.scatter_stream : e.gather_stream;
  const cudaStream_t stream = stream_ref->get();
  auto op = std::make_shared<CudaOp>(scatter ? DeviceOp::Kind::kScatter : DeviceOp::Kind::kGather,
                                     num_layers, stream_ref);

  // The kernel reaches host pages through their device-side addresses: every page must lie in
  // registered memory. Copy engines do better with large runs, the kernel with many small ones.
  bool kernel = false;
  if (options_.copy_path != CudaDeviceOptions::CopyPath::kMemcpy &&
      host_.DeviceAddresses(items, e.object_bytes, d, e.host_dev)) {
    kernel = options_.copy_path == CudaDeviceOptions::CopyPath::kKernel ||
             e.mean_run_bytes <= static_cast<double>(options_.kernel_max_run_bytes);
  }
  if (fence.kind == ReadyFence::Kind::kCudaIpcEvent) {
    cudaEvent_t ev;
    if (absl::Status s = FenceEvent(e, fence.cuda_ipc_event, &ev); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaStreamWaitEvent(stream, ev, 0), "cudaStreamWaitEvent");
        !s.ok()) {
      return s;  // Nothing enqueued.
    }
  }
  // From here on work is on the stream: errors are the op's, reported once the stream passes it.
  const absl::Status st = scatter ? EnqueueScatter(e, items, kernel, signal, layer_events, stream)
                                  : EnqueueGather(e, items, kernel, signal, stream);
  if (!st.ok()) {
    op->SetEnqueueError(st);
    EnqueueFailureSignals(e, signal, layer_events, stream);
  }
  auto* arg = new std::shared_ptr<CudaOp>(op);
  if (cudaLaunchHostFunc(stream, OnOpDone, arg) != cudaSuccess) {
    delete arg;  // Probe() finishes the op once the stream drains or reports the error.
  }
  return OpHandle(std::move(op));
}

absl::Status CudaDevice::EnqueueGather(CudaEngine& e, absl::Span<const CopyItem> items,
                                       bool kernel, OpSignal signal, cudaStream_t stream) {
  e.runs.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    AppendRuns(e, items[i], kernel ? e.host_dev[i] : items[i].host_page, 0,
               static_cast<uint32_t>(e.segs.size()), /*scatter=*/false);
  }
  absl::Status st = IssueRuns(e, stream, kernel);
  if (st.ok() && signal.enabled()) {
    st = CudaStatus(cuda::LaunchStoreTicket(
                        e.CompletionWord(e.completion.OpWordOffset(signal.slot)),
                        core::SignalLayout::OpWord(signal.ticket, /*failed=*/false), stream),
                    "ticket kernel");
  }
  return st;
}

absl::Status CudaDevice::EnqueueScatter(CudaEngine& e, absl::Span<const CopyItem> items,
                                        bool kernel, OpSignal signal, bool layer_events,
                                        cudaStream_t stream) {
  const uint32_t num_layers = static_cast<uint32_t>(e.layout_.layers.size());
  const uint32_t slot = signal.slot;
  absl::Status st;
  for (uint32_t l = 0; l < num_layers && st.ok(); ++l) {
    e.runs.clear();
    for (size_t i = 0; i < items.size(); ++i) {
      AppendRuns(e, items[i], kernel ? e.host_dev[i] : items[i].host_page, e.layer_first[l],
                 e.layer_first[l + 1], /*scatter=*/true);
    }
    st = IssueRuns(e, stream, kernel);
    if (st.ok() && layer_events) {
      // Recorded before the Load reply: the engine's cudaStreamWaitEvent after the reply binds
      // to this record (docs/api.md).
      st = CudaStatus(cudaEventRecord(e.load_events[slot * num_layers + l], stream),
                      "cudaEventRecord(load event)");
    } else if (st.ok() && signal.enabled()) {
      st = CudaStatus(
          cuda::LaunchStoreTicket(e.CompletionWord(e.completion.LayerWordOffset(slot, l)),
                                  signal.ticket, stream),
          "ticket kernel");
    }
  }
  if (st.ok() && signal.enabled() && !layer_events) {
    st = CudaStatus(cuda::LaunchStoreTicket(
                        e.CompletionWord(e.completion.OpWordOffset(slot)),
                        core::SignalLayout::OpWord(signal.ticket, /*failed=*/false), stream),
                    "ticket kernel");
  }
  return st;
}

void CudaDevice::EnqueueFailureSignals(CudaEngine& e, OpSignal signal, bool layer_events,
                                       cudaStream_t stream) {
  const uint32_t num_layers = static_cast<uint32_t>(e.layout_.layers.size());
  const uint32_t slot = signal.slot;
  if (layer_events) {
    // Every layer's event, so that no engine wait refers to an older Load; the op's FAILED
    // state (WaitOps) tells the engine the blocks are not to be used.
    for (uint32_t l = 0; l < num_layers; ++l) {
      cudaEventRecord(e.load_events[slot * num_layers + l], stream);
    }
  } else if (signal.enabled()) {
    cuda::LaunchStoreFailure(e.CompletionWord(e.completion.LayerWordOffset(slot, 0)), num_layers,
                             signal.ticket, e.CompletionWord(e.completion.OpWordOffset(slot)),
                             core::SignalLayout::OpWord(signal.ticket, /*failed=*/true), stream);
  }
}

absl::Status CudaDevice::RegisterHostMemory(void* addr, size_t bytes) {
  if (addr == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostMemory: empty range");
  }
  uint8_t* base = static_cast<uint8_t*>(addr);
  if (host_.Overlapping(base, bytes)) {
    return absl::InvalidArgumentError("RegisterHostMemory: range overlaps a registered one");
  }
  ScopedDevice sd0(devices_.front().index);
  if (!sd0.status().ok()) return sd0.status();
  // Portable: pinned for every device's context; mapped: kernels can address it.
  if (absl::Status s = CudaStatus(
          cudaHostRegister(addr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister");
      !s.ok()) {
    return s;
  }
  std::vector<uint8_t*> device_base;
  for (const DeviceInfo& d : devices_) {
    if (d.host_ptr_is_device_ptr) {
      device_base.push_back(base);
      continue;
    }
    ScopedDevice sd(d.index);
    void* p = nullptr;
    if (absl::Status s =
            CudaStatus(cudaHostGetDevicePointer(&p, addr, 0), "cudaHostGetDevicePointer");
        !s.ok()) {
      cudaHostUnregister(addr);
      return s;
    }
    device_base.push_back(static_cast<uint8_t*>(p));
  }
  if (absl::Status s = host_.Add(base, bytes, std::move(device_base)); !s.ok()) {
    cudaHostUnregister(addr);
    return s;
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::UnregisterHostMemory(void* addr) {
  if (!host_.Remove(addr)) {
    return absl::NotFoundError("UnregisterHostMemory: address was not registered");
  }
  ScopedDevice sd(devices_.front().index);
  return CudaStatus(cudaHostUnregister(addr), "cudaHostUnregister");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaDevice(const CudaDeviceOptions& options) {
  return CudaDevice::Create(options);
}

absl::StatusOr<int> CudaDeviceCount() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice) return 0;
  if (err != cudaSuccess) {
    return absl::UnavailableError(CudaStatus(err, "cudaGetDeviceCount").message());
  }
  return n;
}

}  // namespace kvcellar::gpu
