#include "gpu/sim_device.h"

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "platform/bus_fault_guard.h"
#include "platform/log.h"
#include "platform/process_memory.h"
#include "platform/shm_mapping.h"
#include "platform/signal_region.h"

namespace kvcellar::gpu {

// The daemon's view of one engine: its mapped regions and its signal region. Shared by the
// mapping handle and every op of the engine; Close() unmaps once no op is active.
class SimDevice::Engine {
 public:
  core::KvLayout layout;
  std::vector<core::PageSegment> segs;
  // Per segment: the address of block 0 (region base + device_offset). For an engine registered
  // by its process memory, the address in the engine's address space, never dereferenced here.
  std::vector<uint8_t*> seg_base;
  uint64_t object_bytes = 0;  // The largest group's object.
  uint32_t groups = 1;        // KV groups of the layout.
  std::vector<platform::ShmMapping> shms;
  // Set for an engine registered by its own process memory ("/proc/<pid>/mem"): copies go
  // through process_vm_readv / process_vm_writev instead of memcpy.
  std::optional<platform::ProcessMemory> process;
  platform::SignalRegion completion;  // !valid() when the engine registered none.
  // Set first thing in Close(): queued tasks of this engine skip their copies.
  std::atomic<bool> closing{false};
  // A copy took a SIGBUS on this engine's memory (it truncated or shrank a registered object):
  // every later op of the engine fails at submission.
  std::atomic<bool> faulted{false};

  // Counts an op as active; false once the engine is closed.
  bool BeginOp() {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    ++active_ops_;
    return true;
  }
  void EndOp() {
    absl::MutexLock lock(&mu_);
    --active_ops_;
  }
  // Cancels what has not started, waits for running copies and signals, then unmaps.
  void Close() {
    closing.store(true, std::memory_order_release);
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ops_ == 0; };
      mu_.Await(absl::Condition(&idle));
    }
    completion = platform::SignalRegion();
    shms.clear();
    process.reset();
    seg_base.clear();
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int active_ops_ ABSL_GUARDED_BY(mu_) = 0;
};

namespace {

// A worker's unit: items [item_begin, item_end) x segments [seg_begin, seg_end).
struct Task {
  uint32_t item_begin;
  uint32_t item_end;
  uint32_t seg_begin;
  uint32_t seg_end;
};

class SimEngineMapping final : public EngineMapping {
 public:
  explicit SimEngineMapping(std::shared_ptr<SimDevice::Engine> engine)
      : engine_(std::move(engine)) {}
  ~SimEngineMapping() override { engine_->Close(); }

  const core::KvLayout& layout() const override { return engine_->layout; }
  uint64_t page_object_bytes() const override { return engine_->object_bytes; }
  const std::shared_ptr<SimDevice::Engine>& engine() const { return engine_; }

 private:
  std::shared_ptr<SimDevice::Engine> engine_;
};

}  // namespace

class SimDevice::Op final : public DeviceOp {
 public:
  Op(Kind kind, std::shared_ptr<Engine> engine, absl::Span<const CopyItem> items, OpSignal signal)
      : DeviceOp(kind, static_cast<uint32_t>(engine->layout.layers.size())),
        engine(std::move(engine)),
        items(items.begin(), items.end()),
        signal(signal) {}

  const std::shared_ptr<Engine> engine;
  const std::vector<CopyItem> items;
  const OpSignal signal;
  bool wait_fence = false;
  uint32_t fence_slot = 0;
  uint64_t fence_counter = 0;
  std::vector<Task> tasks;
  size_t next_task = 0;  // Guarded by SimDevice::mu_.
  std::atomic<size_t> tasks_left{0};
  // A task skipped its copies (cancel or close): the op finishes CANCELLED and stops signalling
  // layers.
  std::atomic<bool> skipped{false};
  // A task's copy faulted on the engine's memory (with skipped set): the op finishes failed.
  std::atomic<bool> faulted{false};

  // Scatter only: tasks still to finish per layer, and in-order publication of landed layers.
  std::unique_ptr<std::atomic<uint32_t>[]> layer_pending;
  absl::Mutex publish_mu;
  std::vector<bool> layer_landed ABSL_GUARDED_BY(publish_mu);
  uint32_t next_publish ABSL_GUARDED_BY(publish_mu) = 0;

  void PlanGather(uint64_t task_bytes) {
    const uint32_t n = static_cast<uint32_t>(items.size());
    const uint32_t nsegs = static_cast<uint32_t>(engine->segs.size());
    const uint64_t object = engine->object_bytes;
    if (object <= task_bytes) {
      const uint32_t per_task = static_cast<uint32_t>(std::min<uint64_t>(task_bytes / object, n));
      for (uint32_t i = 0; i < n; i += per_task) {
        tasks.push_back({i, std::min(n, i + per_task), 0, nsegs});
      }
      return;
    }
    // Large objects: each item in runs of segments of about task_bytes.
    std::vector<std::pair<uint32_t, uint32_t>> groups;
    for (uint32_t s = 0; s < nsegs;) {
      const uint32_t begin = s;
      uint64_t bytes = 0;
      while (s < nsegs && (bytes == 0 || bytes + engine->segs[s].bytes <= task_bytes)) {
        bytes += engine->segs[s++].bytes;
      }
      groups.push_back({begin, s});
    }
    for (uint32_t i = 0; i < n; ++i) {
      for (const auto& [b, e] : groups) tasks.push_back({i, i + 1, b, e});
    }
  }

  void PlanScatter(uint64_t task_bytes) {
    const uint32_t n = static_cast<uint32_t>(items.size());
    const uint32_t nsegs = static_cast<uint32_t>(engine->segs.size());
    const std::vector<core::PageSegment>& segs = engine->segs;
    layer_pending = std::make_unique<std::atomic<uint32_t>[]>(num_layers());
    {
      absl::MutexLock lock(&publish_mu);
      layer_landed.assign(num_layers(), false);
    }
    // Whole layers per task while they are small; one layer over a run of items when large.
    for (uint32_t s = 0; s < nsegs;) {
      const uint32_t begin = s;
      uint64_t per_item = 0;
      do {
        const uint32_t layer = segs[s].layer;
        while (s < nsegs && segs[s].layer == layer) per_item += segs[s++].bytes;
      } while (s < nsegs && per_item * n < task_bytes);
      const uint32_t per_task =
          static_cast<uint32_t>(std::clamp<uint64_t>(task_bytes / per_item, 1, n));
      uint32_t count = 0;
      for (uint32_t i = 0; i < n; i += per_task, ++count) {
        tasks.push_back({i, std::min(n, i + per_task), begin, s});
      }
      for (uint32_t l = segs[begin].layer; l <= segs[s - 1].layer; ++l) {
        layer_pending[l].store(count, std::memory_order_relaxed);
      }
    }
  }
};

namespace {

constexpr char kEngineMemoryGone[] =
    "engine memory fault: a registered shared-memory object of the engine was truncated or "
    "shrunk under the daemon's mapping (SIGBUS on copy); the engine must register again";

void FinishOp(SimDevice::Op& op) {
  const bool ok = !op.skipped.load(std::memory_order_acquire);
  SimDevice::Engine& engine = *op.engine;
  if (op.signal.enabled()) {
    // A failed op releases every layer waiter; a successful Scatter signalled its layers as they
    // landed, and a Gather has none to signal.
    engine.completion.EndOp(op.signal.slot, op.signal.ticket, /*failed=*/!ok,
                            ok ? op.num_layers() : 0);
  }
  if (ok) {
    op.Finish(absl::OkStatus());
  } else if (op.faulted.load(std::memory_order_acquire)) {
    op.Finish(absl::FailedPreconditionError(kEngineMemoryGone));
  } else {
    op.Finish(absl::CancelledError(engine.closing.load(std::memory_order_acquire)
                                       ? "engine mapping closed"
                                       : "cancelled"));
  }
  // Last: once no op is active the mapping may unmap the regions and the completion region.
  engine.EndOp();
}

// Publishes every landed layer in order, stopping at the first missing one.
void LayerLanded(SimDevice::Op& op, uint32_t layer) {
  absl::MutexLock lock(&op.publish_mu);
  op.layer_landed[layer] = true;
  while (op.next_publish < op.num_layers() && op.layer_landed[op.next_publish] &&
         !op.skipped.load(std::memory_order_acquire)) {
    if (op.signal.enabled()) {
      op.engine->completion.SignalLayer(op.signal.slot, op.next_publish, op.signal.ticket);
    }
    ++op.next_publish;
    op.SetLayersDone(op.next_publish);
  }
}

// Runs at most this long get their next item's source prefetched. A page's small per-layer runs
// come from as many places as the model has buffers (2 x layers), more streams than the hardware
// prefetchers follow; prefetching larger runs only competes with the copy itself.
constexpr uint64_t kPrefetchMaxRun = 2048;
constexpr uint64_t kCacheLine = 64;

inline void Prefetch(const uint8_t* p, uint64_t bytes) {
  for (uint64_t off = 0; off < bytes; off += kCacheLine) __builtin_prefetch(p + off);
}

// Calls run(item, segment, engine address, bytes) for each run of a task's copies, in order: a
// segment of the item's block together with the segments that lie right behind it in the engine's
// memory (layouts that keep a block's layers side by side copy as one run). Engine addresses are
// integers here: for a process-memory engine nothing in this process points into them. Stops at
// the first run for which `run` returns false, and returns false then.
template <typename Run>
inline bool ForEachRun(const SimDevice::Engine& e, const SimDevice::Op& op, const Task& t,
                       Run&& run) {
  const core::PageSegment* segs = e.segs.data();
  for (uint32_t i = t.item_begin; i < t.item_end; ++i) {
    const uint64_t block = op.items[i].device_block;
    const uint32_t group = op.items[i].group;
    for (uint32_t s = t.seg_begin; s < t.seg_end;) {
      if (segs[s].group != group) {  // Another group's layer: not in this item's object.
        ++s;
        continue;
      }
      const uintptr_t dev =
          reinterpret_cast<uintptr_t>(e.seg_base[s]) + block * segs[s].block_stride;
      uint64_t len = segs[s].bytes;
      uint32_t next = s + 1;
      while (next < t.seg_end && segs[next].group == group &&
             reinterpret_cast<uintptr_t>(e.seg_base[next]) + block * segs[next].block_stride ==
                 dev + len) {
        len += segs[next++].bytes;
      }
      if (!run(i, s, dev, len)) return false;
      s = next;
    }
  }
  return true;
}

// The item after `i` in the task (or `i` itself, the last): whose source the copy prefetches.
inline uint32_t NextItem(const Task& t, uint32_t i) { return i + 1 < t.item_end ? i + 1 : i; }

void CopyGather(const SimDevice::Engine& e, const SimDevice::Op& op, const Task& t) {
  const core::PageSegment* segs = e.segs.data();
  ForEachRun(e, op, t, [&](uint32_t i, uint32_t s, uintptr_t dev, uint64_t len) {
    if (len <= kPrefetchMaxRun) {
      Prefetch(e.seg_base[s] + op.items[NextItem(t, i)].device_block * segs[s].block_stride, len);
    }
    std::memcpy(op.items[i].host_page + segs[s].object_offset,
                reinterpret_cast<const uint8_t*>(dev), len);
    return true;
  });
}

void CopyScatter(const SimDevice::Engine& e, const SimDevice::Op& op, const Task& t) {
  const core::PageSegment* segs = e.segs.data();
  ForEachRun(e, op, t, [&](uint32_t i, uint32_t s, uintptr_t dev, uint64_t len) {
    if (len <= kPrefetchMaxRun) {
      Prefetch(op.items[NextItem(t, i)].host_page + segs[s].object_offset, len);
    }
    std::memcpy(reinterpret_cast<uint8_t*>(dev), op.items[i].host_page + segs[s].object_offset,
                len);
    return true;
  });
}

// One task's copies for an engine registered by its process memory: the same runs as
// CopyGather / CopyScatter, handed to the kernel in batches (one process_vm_readv or
// process_vm_writev per batch). False (errno set) when a run could not be copied.
bool CopyProcessMemory(const SimDevice::Engine& e, const SimDevice::Op& op, const Task& t,
                       bool scatter) {
  constexpr size_t kBatch = 1024;
  const core::PageSegment* segs = e.segs.data();
  iovec local[kBatch];
  iovec remote[kBatch];
  size_t n = 0;
  auto flush = [&]() {
    const bool ok = n == 0 || (scatter ? e.process->Write({local, n}, {remote, n})
                                       : e.process->Read({local, n}, {remote, n}));
    n = 0;
    return ok;
  };
  return ForEachRun(e, op, t,
                    [&](uint32_t i, uint32_t s, uintptr_t dev, uint64_t len) {
                      local[n] = {op.items[i].host_page + segs[s].object_offset, len};
                      remote[n] = {reinterpret_cast<void*>(dev), len};
                      return ++n < kBatch || flush();
                    }) &&
         flush();
}

// One task's copies, run under RunCatchingBusFaults: raw pointers and loops only, no locks.
struct CopyArgs {
  const SimDevice::Engine* engine;
  const SimDevice::Op* op;
  const Task* task;
  bool scatter;
};

void RunCopy(void* p) {
  const CopyArgs& a = *static_cast<const CopyArgs*>(p);
  if (a.scatter) {
    CopyScatter(*a.engine, *a.op, *a.task);
  } else {
    CopyGather(*a.engine, *a.op, *a.task);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SimDevice>> SimDevice::Create(Options options) {
  if (options.copy_threads < 0) {
    return absl::InvalidArgumentError("copy_threads is negative");
  }
  if (options.copy_threads == 0) {
    options.copy_threads =
        static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 4));
  }
  if (options.task_bytes == 0) return absl::InvalidArgumentError("task_bytes is 0");
  platform::InstallBusFaultHandler();
  return std::unique_ptr<SimDevice>(new SimDevice(std::move(options)));
}

SimDevice::SimDevice(Options options) : options_(std::move(options)) {
  for (int i = 0; i < options_.copy_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  poller_ = std::thread([this] { PollerLoop(); });
  KVLOG(Info, "device backend started",
        {{"backend", "sim"}, {"copy_threads", options_.copy_threads}});
}

SimDevice::~SimDevice() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (auto& op : run_queue_) op->Cancel();
    for (auto& op : fence_waiters_) op->Cancel();
  }
  for (std::thread& t : workers_) t.join();
  poller_.join();
}

std::vector<std::string> SimDevice::DeviceUuids() const {
  return {options_.uuid.empty() ? std::string("sim") : options_.uuid};
}

absl::StatusOr<std::unique_ptr<EngineMapping>> SimDevice::OpenEngine(const EngineSpec& spec) {
  if (!options_.uuid.empty() && spec.device_uuid != options_.uuid) {
    return absl::NotFoundError(absl::StrCat("device_uuid \"", spec.device_uuid,
                                            "\": this sim device is \"", options_.uuid, "\""));
  }
  const core::KvLayout& layout = spec.layout;
  if (absl::Status s = layout.Validate(); !s.ok()) return s;

  // An engine's regions are either shared objects, each mapped once as far as the furthest region
  // in it reaches, or all its own process memory ("/proc/<pid>/mem", offsets are addresses).
  absl::flat_hash_map<std::string, std::pair<uint64_t, size_t>> extent;  // name -> (bytes, first)
  std::vector<platform::ProcessMemory::Range> process_ranges;
  for (size_t i = 0; i < layout.regions.size(); ++i) {
    const core::MemoryRegion& r = layout.regions[i];
    const bool process = platform::ParseProcessMemoryName(r.handle).has_value();
    if (i > 0 && process != !process_ranges.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("regions[", i,
                       "].handle: an engine registers either shared-memory objects or its own "
                       "process memory (/proc/<pid>/mem), not both"));
    }
    if (process) {
      if (i > 0 && r.handle != layout.regions[0].handle) {
        return absl::InvalidArgumentError(absl::StrCat("regions[", i, "].handle: ", r.handle,
                                                       " is not regions[0]'s process (",
                                                       layout.regions[0].handle, ")"));
      }
      process_ranges.push_back({r.offset, r.size});
      continue;
    }
    if (absl::Status s = platform::ShmMapping::CheckName(r.handle); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("regions[", i, "].handle: ", s.message()));
    }
    auto [it, inserted] = extent.try_emplace(r.handle, r.offset + r.size, i);
    if (!inserted) it->second.first = std::max(it->second.first, r.offset + r.size);
  }
  auto engine = std::make_shared<Engine>();
  engine->layout = layout;
  engine->segs = core::PageSegments(layout);
  engine->object_bytes = layout.PageObjectBytes();
  engine->groups = layout.NumGroups();
  absl::flat_hash_map<std::string, uint8_t*> base;
  if (!process_ranges.empty()) {
    // Errors about the process as a whole are regions[0]'s, whose handle names it.
    absl::StatusOr<platform::ProcessMemory> m = platform::ProcessMemory::Open(
        layout.regions[0].handle, spec.memory_access, process_ranges, "regions", "regions[0]");
    if (!m.ok()) return m.status();
    engine->process = *std::move(m);
  }
  for (const auto& [name, e] : extent) {
    absl::StatusOr<platform::ShmMapping> m =
        platform::ShmMapping::Open(name, e.first, spec.memory_access);
    if (!m.ok()) {
      return platform::WithPrefix(m.status(), absl::StrCat("regions[", e.second, "]: "));
    }
    base[name] = m->data();
    engine->shms.push_back(*std::move(m));
  }
  for (const core::PageSegment& s : engine->segs) {
    const core::MemoryRegion& r = layout.regions[s.region];
    engine->seg_base.push_back(engine->process ? reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(
                                                     r.offset + s.device_offset))
                                               : base[r.handle] + r.offset + s.device_offset);
  }

  if (!spec.completion_region.empty()) {
    absl::StatusOr<platform::SignalRegion> c = OpenCompletionRegion(
        spec.completion_region, static_cast<uint32_t>(layout.layers.size()), spec.memory_access);
    if (!c.ok()) return c.status();
    engine->completion = *std::move(c);
  }
  KVLOG(Info, "engine mapped",
        {{"backend", "sim"},
         {"regions", layout.regions.size()},
         {"layers", layout.layers.size()},
         {"blocks", layout.num_blocks},
         {"object_bytes", engine->object_bytes},
         {"completion_region", spec.completion_region}});
  return std::make_unique<SimEngineMapping>(std::move(engine));
}

absl::StatusOr<OpHandle> SimDevice::SubmitGather(EngineMapping& engine,
                                                 absl::Span<const CopyItem> items,
                                                 const ReadyFence& fence, OpSignal signal) {
  return Submit(engine, items, fence, signal, /*scatter=*/false);
}

absl::StatusOr<OpHandle> SimDevice::SubmitScatter(EngineMapping& engine,
                                                  absl::Span<const CopyItem> items,
                                                  OpSignal signal) {
  return Submit(engine, items, ReadyFence::Ready(), signal, /*scatter=*/true);
}

absl::StatusOr<OpHandle> SimDevice::Submit(EngineMapping& mapping, absl::Span<const CopyItem> items,
                                           const ReadyFence& fence, OpSignal signal, bool scatter) {
  auto* sim = dynamic_cast<SimEngineMapping*>(&mapping);
  if (sim == nullptr) {
    return absl::InvalidArgumentError("engine: not a mapping of the sim device");
  }
  const std::shared_ptr<Engine>& engine = sim->engine();
  if (absl::Status s = ValidateCopyItems(items, engine->layout, engine->groups, scatter); !s.ok()) {
    return s;
  }
  const bool has_region = engine->completion.valid();
  switch (fence.kind) {
    case ReadyFence::Kind::kReady:
      break;
    case ReadyFence::Kind::kCudaIpcEvent:
      return absl::InvalidArgumentError(
          "fence.kind: the sim device waits on counter fences, not CUDA IPC events");
    case ReadyFence::Kind::kCounter:
      if (!has_region) {
        return absl::InvalidArgumentError(
            "fence.kind: a counter fence needs the engine's completion_region, and it registered "
            "none");
      }
      if (fence.slot >= engine->completion.num_ready_slots()) {
        return absl::InvalidArgumentError(absl::StrCat("fence.slot (", fence.slot,
                                                       ") out of range [0, ",
                                                       engine->completion.num_ready_slots(), ")"));
      }
      break;
  }
  if (signal.enabled()) {
    if (!has_region) {
      return absl::InvalidArgumentError(
          "signal: the engine registered no completion_region to signal");
    }
    if (signal.slot >= engine->completion.num_load_slots()) {
      return absl::InvalidArgumentError(absl::StrCat("signal.slot (", signal.slot,
                                                     ") out of range [0, ",
                                                     engine->completion.num_load_slots(), ")"));
    }
  }

  auto op = std::make_shared<Op>(scatter ? DeviceOp::Kind::kScatter : DeviceOp::Kind::kGather,
                                 engine, items, signal);
  if (!items.empty()) {
    if (scatter) {
      op->PlanScatter(options_.task_bytes);
    } else {
      op->PlanGather(options_.task_bytes);
    }
  }
  op->tasks_left.store(op->tasks.size(), std::memory_order_relaxed);
  if (fence.kind == ReadyFence::Kind::kCounter) {
    op->wait_fence = true;
    op->fence_slot = fence.slot;
    op->fence_counter = fence.counter;
  }
  if (engine->faulted.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError(kEngineMemoryGone);
  }
  if (!engine->BeginOp()) {
    return absl::FailedPreconditionError("engine: mapping is closed");
  }
  if (op->tasks.empty()) {
    // Nothing to copy: every layer has trivially landed.
    if (scatter && signal.enabled()) {
      for (uint32_t l = 0; l < op->num_layers(); ++l) {
        engine->completion.SignalLayer(signal.slot, l, signal.ticket);
      }
    }
    FinishOp(*op);
    return op;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stop_) {
      engine->EndOp();
      return absl::UnavailableError("sim device is shutting down");
    }
    if (op->wait_fence && engine->completion.ready_word(op->fence_slot) < op->fence_counter) {
      fence_waiters_.push_back(op);
    } else {
      run_queue_.push_back(op);
    }
  }
  return op;
}

void SimDevice::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Op> op;
    size_t task;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !run_queue_.empty();
      };
      mu_.Await(absl::Condition(&has_work));
      if (run_queue_.empty()) return;  // Stopping, and everything queued has been claimed.
      op = run_queue_.front();
      task = op->next_task++;
      if (op->next_task == op->tasks.size()) run_queue_.pop_front();
    }
    RunTask(*op, task);
  }
}

void SimDevice::RunTask(Op& op, size_t task) {
  const Task& t = op.tasks[task];
  Engine& engine = *op.engine;
  const bool copy = !op.cancel_requested() && !engine.closing.load(std::memory_order_acquire) &&
                    !op.skipped.load(std::memory_order_relaxed) &&
                    !engine.faulted.load(std::memory_order_acquire);
  const bool scatter = op.kind() == DeviceOp::Kind::kScatter;
  CopyArgs args{&engine, &op, &t, scatter};
  int process_error = 0;
  const bool copied = !copy || (engine.process ? CopyProcessMemory(engine, op, t, scatter) ||
                                                     ((process_error = errno), false)
                                               : platform::RunCatchingBusFaults(&RunCopy, &args));
  if (!copied) {
    // Only this engine's op fails; the daemon and every other engine carry on.
    if (!engine.faulted.exchange(true, std::memory_order_acq_rel)) {
      KVLOG(Error, "engine memory fault",
            {{"regions", engine.layout.regions.size()},
             {"op_kind", scatter ? "scatter" : "gather"},
             {"process_memory_error", process_error == 0 ? "" : std::strerror(process_error)}});
    }
    op.faulted.store(true, std::memory_order_release);
    op.skipped.store(true, std::memory_order_release);
  } else if (!copy) {
    if (engine.faulted.load(std::memory_order_acquire)) {
      op.faulted.store(true, std::memory_order_release);
    }
    op.skipped.store(true, std::memory_order_release);
  }
  if (scatter) {
    // The acq_rel decrements chain every task's copies of a layer to whichever task publishes it.
    const uint32_t first = engine.segs[t.seg_begin].layer;
    const uint32_t last = engine.segs[t.seg_end - 1].layer;
    for (uint32_t l = first; l <= last; ++l) {
      if (op.layer_pending[l].fetch_sub(1, std::memory_order_acq_rel) == 1) LayerLanded(op, l);
    }
  }
  if (op.tasks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) FinishOp(op);
}

void SimDevice::PollerLoop() {
  std::vector<std::shared_ptr<Op>> dead;
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (fence_waiters_.empty()) {
      if (stop_) return;
      auto has_waiters = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !fence_waiters_.empty();
      };
      mu_.Await(absl::Condition(&has_waiters));
      continue;
    }
    auto keep = fence_waiters_.begin();
    for (auto it = fence_waiters_.begin(); it != fence_waiters_.end(); ++it) {
      Op& op = **it;
      if (stop_ || op.cancel_requested() || op.engine->closing.load(std::memory_order_acquire)) {
        dead.push_back(std::move(*it));
      } else if (op.engine->completion.ready_word(op.fence_slot) >= op.fence_counter) {
        // The acquire load above orders the engine's writes before our (later) copies.
        run_queue_.push_back(std::move(*it));
      } else {
        *keep++ = std::move(*it);
      }
    }
    fence_waiters_.erase(keep, fence_waiters_.end());
    if (!dead.empty()) {
      mu_.Unlock();
      for (auto& op : dead) {
        op->skipped.store(true, std::memory_order_release);
        FinishOp(*op);
      }
      dead.clear();
      mu_.Lock();
    }
    if (!fence_waiters_.empty()) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.fence_poll_interval);
    }
  }
}

absl::Status SimDevice::RegisterHostMemory(void* addr, size_t bytes) {
  if (addr == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostMemory: empty range");
  }
  return absl::OkStatus();  // Host memory is already as fast as it gets for memcpy.
}

absl::Status SimDevice::UnregisterHostMemory(void* addr) { return absl::OkStatus(); }

}  // namespace kvcellar::gpu
