// The CUDA DeviceBackend: engine KV caches reached through CUDA IPC, copies on per-engine streams.
//
// This header has no CUDA includes, so the factory can name the backend in every build; in a build
// without CUDA (KVCELLAR_HAVE_CUDA=0) gpu/nocuda/ answers "CUDA support not compiled in".
//
// What it does (cuda_device.cc):
//   - Devices are found by UUID (cudaDeviceProp::uuid), so an engine's CUDA_VISIBLE_DEVICES does
//     not matter. Each region's allocation is opened once with cudaIpcOpenMemHandle and its size
//     checked with cuMemGetAddressRange; closing the mapping closes the handles.
//   - Each engine mapping has its own two non-blocking streams (gather: device -> host, scatter:
//     host -> device), so one engine's fence never delays another's copies.
//   - Gather: cudaStreamWaitEvent on the engine's IPC event (opened once per handle and cached),
//     then the copies. Scatter: per layer, the layer's copies then a one-thread kernel storing the
//     layer's ticket into the engine's signal region (core/signal_layout.h; registered, mapped),
//     or records the engine's per-layer IPC event.
//   - Copies: runs contiguous on both sides are merged. Many small copies between device memory
//     and registered host memory go through a copy kernel (one thread block per run, 16-byte
//     vector accesses when aligned); otherwise cudaMemcpyBatchAsync (CUDA 12.8+; the CUDA 13
//     signature has no failIdx) with a fallback to cudaMemcpyAsync per run.
//   - Op completion: cudaLaunchHostFunc after the op finishes the DeviceOp; Poll/Wait also query
//     the stream, so a device error finishes the op even if the callback never runs.
//     DeviceOp::layers_done() jumps to the layer count at completion: per-layer progress reaches
//     the engine through the signal region or the load events, not the daemon.
//   - The device must outlive its mappings (each refers to the device's table of GPUs).
#ifndef KVCELLAR_GPU_CUDA_CUDA_DEVICE_H_
#define KVCELLAR_GPU_CUDA_CUDA_DEVICE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu/device_backend.h"

namespace kvcellar::gpu {

struct CudaDeviceOptions {
  enum class CopyPath { kAuto, kMemcpy, kKernel };
  // kAuto: the kernel when every host page lies in registered memory and the mean merged run is
  // at most kernel_max_run_bytes; memcpy otherwise. The others force a path. kvcellard takes it
  // from device.cuda_copy_path, kMemcpy (the copy engines) by default: without MPS a kernel of
  // the daemon's time-slices the GPU with the engine's (README, "GPU check").
  CopyPath copy_path = CopyPath::kAuto;
  // Copy engines reach full speed from about 64 KiB per copy; below that the per-copy cost
  // dominates and SM copies win (measured by LMCache and vLLM's offloading connector on H100).
  uint64_t kernel_max_run_bytes = 64 << 10;
  // Thread blocks of the copy kernel: enough to saturate PCIe, few enough to leave most SMs of an
  // H100 (132) to the engine's forward pass.
  uint32_t kernel_max_blocks = 32;
  // How long closing a mapping waits for its streams to drain (an engine that died mid-step may
  // leave a fence that never fires); past it the mapping's handles are leaked, never unmapped
  // under a live copy.
  uint32_t close_timeout_ms = 10000;
};

// UNAVAILABLE when there is no CUDA driver or no device; UNIMPLEMENTED when built without CUDA.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaDevice(const CudaDeviceOptions& options);

// Number of CUDA devices visible to this process; an error when there is no usable driver or the
// build has no CUDA.
absl::StatusOr<int> CudaDeviceCount();

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_CUDA_CUDA_DEVICE_H_
