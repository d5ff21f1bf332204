// Engine side of the sim device: "device memory" an engine process creates in POSIX shared memory.
//
// On a GPU an engine allocates its KV cache with cudaMalloc and registers IPC handles; on the sim
// device it creates shm objects (SimEngineMemory) and registers their names. The client library,
// fake engines in integration tests, the tests and the benchmarks use this file; the daemon never
// does (it maps by name, gpu/sim_device.h). In platform/ because the engine side (client/) and the
// daemon's tests both need it, and it is OS calls (shm objects) around a core KvLayout.
//
// SimEngineKvCache builds a whole engine rank in one call: KV memory in one of the arrangements
// real engines use, the matching KvLayout, and optionally a signal region (load and ready slots,
// platform/signal_region.h).
#ifndef KVCELLAR_PLATFORM_SIM_ENGINE_MEMORY_H_
#define KVCELLAR_PLATFORM_SIM_ENGINE_MEMORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/kv_layout.h"
#include "platform/shm_mapping.h"
#include "platform/signal_region.h"

namespace kvcellar::platform {

// One sim allocation. Owns its shm name: destruction unmaps and unlinks it (a daemon that mapped
// it keeps its mapping until it closes the engine).
class SimEngineMemory {
 public:
  // `mode`: the object's permission bits (ShmMapping::Create).
  static absl::StatusOr<SimEngineMemory> Create(absl::string_view name, uint64_t bytes,
                                                uint32_t mode = ShmMapping::kDefaultMode);

  uint8_t* data() const { return shm_.data(); }
  uint64_t size() const { return shm_.size(); }
  const std::string& name() const { return shm_.name(); }
  // The KvLayout region for bytes [offset, offset + size) of this allocation.
  core::MemoryRegion Region(uint64_t offset, uint64_t size) const { return {name(), offset, size}; }

 private:
  explicit SimEngineMemory(ShmMapping shm) : shm_(std::move(shm)) {}
  ShmMapping shm_;
};

// A shm name no other live process or test uses: "/kvc-<tag>-<pid>-<counter>-<random>".
std::string UniqueShmName(absl::string_view tag);

struct SimKvShape {
  enum class Arrangement {
    // One region per layer, in one allocation: the layer's K blocks, then its V blocks (vLLM's
    // per-layer [2, num_blocks, ...] tensors).
    kLayerFirst,
    // One region: block after block, each holding every layer's K and V side by side
    // (TensorRT-LLM's block-major pool). Copies of a block merge into one run.
    kBlockFirst,
  };
  uint32_t num_layers = 1;
  uint32_t num_blocks = 1;
  uint64_t bytes_per_block = 0;  // Per buffer (K, V, or the MLA latent).
  bool mla = false;
  Arrangement arrangement = Arrangement::kLayerFirst;
  // kLayerFirst only: distance between blocks; 0 means bytes_per_block (packed).
  uint64_t block_stride = 0;
};

class SimEngineKvCache {
 public:
  // Creates "<prefix>-kv" (and "<prefix>-done", a signal region of `completion_slots` load
  // slots and as many ready slots, when completion_slots > 0), both with permission bits `mode`.
  static absl::StatusOr<SimEngineKvCache> Create(absl::string_view name_prefix,
                                                 const SimKvShape& shape, uint32_t completion_slots,
                                                 uint32_t mode = ShmMapping::kDefaultMode);
  // The layout Create(name_prefix, shape, ...) registers, and the bytes of its "<prefix>-kv"
  // object; lets another process describe the cache without opening it.
  static absl::StatusOr<core::KvLayout> Layout(absl::string_view name_prefix,
                                               const SimKvShape& shape,
                                               uint64_t* total_bytes = nullptr);
  static std::string CompletionName(absl::string_view name_prefix);

  const core::KvLayout& layout() const { return layout_; }
  // Engine memory of block `block` of `layer`'s buffer (0: K or latent, 1: V).
  uint8_t* Block(uint32_t layer, uint32_t buffer, uint32_t block) const;
  SimEngineMemory& memory() { return memory_; }
  SignalRegion& completion() { return completion_; }
  const SignalRegion& completion() const { return completion_; }

 private:
  SimEngineKvCache(SimEngineMemory memory, core::KvLayout layout, SignalRegion completion)
      : memory_(std::move(memory)),
        layout_(std::move(layout)),
        completion_(std::move(completion)) {}

  SimEngineMemory memory_;
  core::KvLayout layout_;
  SignalRegion completion_;
};

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_SIM_ENGINE_MEMORY_H_
