// SimDevice: the host-shared-memory DeviceBackend, with the CUDA backend's semantics.
//
// Two uses: production, for engines whose KV lives in host memory (SGLang's HiCache host pool),
// served beside the CUDA device on GPU nodes (server/datapath/device_set.h); and the GPU stand-in
// on machines without one, for integrations and tests.
//
// Engine "device memory" is shared memory that the engine process creates: a POSIX shm object
// (platform/sim_engine_memory.h) or a memfd named "/proc/<pid>/fd/<fd>" (platform/shm_mapping.h);
// the daemon maps each region once per engine, checking that the object is at least as large as
// the layout declares. Copies are memcpy on a small pool of worker threads, so ops complete
// asynchronously just as on a copy stream.
//
// Gather fences are counters (ReadyFence::Counter): a poller thread watches each waiting op's
// ready word in the engine's signal region (core/signal_layout.h) and releases the op to the
// workers only once it is reached, so no engine byte is read early. Scatter progress goes to the
// same region's load slots, layer by layer and in layer order, each store a release after the
// bytes it covers.
//
// Work split: an op becomes tasks of about Options::task_bytes. A Gather's tasks are runs of
// whole page objects (or, for large objects, runs of layers of one object); a Scatter's tasks are
// runs of whole layers (or, for large layers, one layer of a run of items), queued in layer order,
// so the workers finish layers roughly in order and a layer is signalled when its last task ends.
//
// Threading: thread-safe (device_backend.h). Owns copy_threads workers and one fence poller.
// Destroying the device cancels queued ops and joins its threads; EngineMappings may outlive it.
#ifndef KVCELLAR_GPU_SIM_DEVICE_H_
#define KVCELLAR_GPU_SIM_DEVICE_H_

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device_backend.h"

namespace kvcellar::gpu {

class SimDevice final : public DeviceBackend {
 public:
  struct Options {
    // Copy worker threads; 0 picks min(4, hardware threads). Four saturate a socket's memory
    // bandwidth for memcpy on current servers.
    int copy_threads = 0;
    // When set, OpenEngine accepts only this device_uuid (exact match).
    std::string uuid;
    // Bytes a worker copies per task: large enough that queueing costs nothing next to memcpy,
    // small enough to spread a batch over the workers.
    uint64_t task_bytes = uint64_t{1} << 20;
    // How often waiting Gathers' fences are checked. The engine only stores a counter; there is
    // no wake-up to wait on, so the poller wakes this often while any Gather waits (and sleeps
    // on a condition variable otherwise).
    absl::Duration fence_poll_interval = absl::Microseconds(20);
  };

  static absl::StatusOr<std::unique_ptr<SimDevice>> Create(Options options);
  ~SimDevice() override;

  absl::string_view name() const override { return "sim"; }
  std::vector<std::string> DeviceUuids() const override;
  absl::StatusOr<std::unique_ptr<EngineMapping>> OpenEngine(const EngineSpec& spec) override;
  absl::StatusOr<OpHandle> SubmitGather(EngineMapping& engine, absl::Span<const CopyItem> items,
                                        const ReadyFence& fence, OpSignal signal) override;
  absl::StatusOr<OpHandle> SubmitScatter(EngineMapping& engine, absl::Span<const CopyItem> items,
                                         OpSignal signal) override;
  absl::Status RegisterHostMemory(void* addr, size_t bytes) override;
  absl::Status UnregisterHostMemory(void* addr) override;

  // Implementation types, defined in sim_device.cc.
  class Op;
  class Engine;

 private:
  explicit SimDevice(Options options);

  absl::StatusOr<OpHandle> Submit(EngineMapping& engine, absl::Span<const CopyItem> items,
                                  const ReadyFence& fence, OpSignal signal, bool scatter);
  void WorkerLoop();
  void PollerLoop();
  void RunTask(Op& op, size_t task);

  const Options options_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Ops with tasks not yet claimed, oldest first.
  std::deque<std::shared_ptr<Op>> run_queue_ ABSL_GUARDED_BY(mu_);
  // Gathers waiting for their engine's fence.
  std::vector<std::shared_ptr<Op>> fence_waiters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
  std::thread poller_;
};

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_SIM_DEVICE_H_
