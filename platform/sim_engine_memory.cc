#include "platform/sim_engine_memory.h"

#include <unistd.h>

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvcellar::platform {

absl::StatusOr<SimEngineMemory> SimEngineMemory::Create(absl::string_view name, uint64_t bytes,
                                                        uint32_t mode) {
  absl::StatusOr<ShmMapping> shm = ShmMapping::Create(name, bytes, mode);
  if (!shm.ok()) return shm.status();
  return SimEngineMemory(*std::move(shm));
}

std::string UniqueShmName(absl::string_view tag) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrCat("/kvc-", tag, "-", getpid(), "-", counter.fetch_add(1), "-",
                      absl::Hex(rng() & 0xffffffff));
}

absl::StatusOr<core::KvLayout> SimEngineKvCache::Layout(absl::string_view name_prefix,
                                                        const SimKvShape& shape,
                                                        uint64_t* total_bytes) {
  if (shape.num_layers == 0 || shape.num_blocks == 0 || shape.bytes_per_block == 0) {
    return absl::InvalidArgumentError("SimKvShape: layers, blocks and bytes_per_block must be > 0");
  }
  const uint32_t buffers = shape.mla ? 1 : 2;
  const uint64_t bpb = shape.bytes_per_block;
  core::KvLayout layout;
  layout.num_blocks = shape.num_blocks;
  uint64_t total = 0;
  const std::string kv_name = absl::StrCat(name_prefix, "-kv");
  if (shape.arrangement == SimKvShape::Arrangement::kLayerFirst) {
    const uint64_t stride = shape.block_stride == 0 ? bpb : shape.block_stride;
    const uint64_t buffer_bytes = stride * shape.num_blocks;
    const uint64_t layer_bytes = buffer_bytes * buffers;
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      layout.regions.push_back({kv_name, l * layer_bytes, layer_bytes});
      core::LayerLayout ll;
      ll.k = {l, 0, stride, bpb};
      if (!shape.mla) ll.v = core::BufferLayout{l, buffer_bytes, stride, bpb};
      layout.layers.push_back(ll);
    }
    total = layer_bytes * shape.num_layers;
  } else {
    const uint64_t stride = bpb * buffers * shape.num_layers;
    total = stride * shape.num_blocks;
    layout.regions.push_back({kv_name, 0, total});
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      core::LayerLayout ll;
      ll.k = {0, l * buffers * bpb, stride, bpb};
      if (!shape.mla) ll.v = core::BufferLayout{0, l * buffers * bpb + bpb, stride, bpb};
      layout.layers.push_back(ll);
    }
  }
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (total_bytes != nullptr) *total_bytes = total;
  return layout;
}

std::string SimEngineKvCache::CompletionName(absl::string_view name_prefix) {
  return absl::StrCat(name_prefix, "-done");
}

absl::StatusOr<SimEngineKvCache> SimEngineKvCache::Create(absl::string_view name_prefix,
                                                          const SimKvShape& shape,
                                                          uint32_t completion_slots,
                                                          uint32_t mode) {
  uint64_t total = 0;
  absl::StatusOr<core::KvLayout> layout = Layout(name_prefix, shape, &total);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<SimEngineMemory> memory =
      SimEngineMemory::Create(layout->regions.front().handle, total, mode);
  if (!memory.ok()) return memory.status();
  SignalRegion completion;
  if (completion_slots > 0) {
    absl::StatusOr<SignalRegion> c = SignalRegion::Create(
        CompletionName(name_prefix), completion_slots, shape.num_layers, completion_slots, mode);
    if (!c.ok()) return c.status();
    completion = *std::move(c);
  }
  return SimEngineKvCache(*std::move(memory), *std::move(layout), std::move(completion));
}

uint8_t* SimEngineKvCache::Block(uint32_t layer, uint32_t buffer, uint32_t block) const {
  const core::LayerLayout& l = layout_.layers[layer];
  const core::BufferLayout& b = buffer == 0 ? l.k : *l.v;
  const core::MemoryRegion& r = layout_.regions[b.region];
  return memory_.data() + r.offset + b.offset + uint64_t{block} * b.block_stride;
}

}  // namespace kvcellar::platform
