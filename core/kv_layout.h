// KvLayout: where an engine's KV-cache blocks live in device memory, described in bytes only.
//
// An engine registers its layout once (RegisterEngine). The daemon never interprets dtypes, heads
// or token counts: a block of a layer is `bytes_per_block` bytes at `offset + block *
// block_stride` inside one memory region. MHA/GQA layers have a K and a V buffer; MLA layers have
// one buffer (the latent), given as `k`.
//
// The same layout also fixes the host page format (DESIGN.md "Host pages are page-first"): one
// contiguous object per (page, shard) holding, for layer 0, 1, ..., that layer's K bytes then its V
// bytes, packed with no padding. PageSegments() lists those pieces in object order; every copy in
// the gpu/ backends is driven by that list, so device and host formats cannot drift apart.
//
// Hybrid models (docs/keys.md "Groups"): each layer belongs to one KV group (full attention,
// sliding window, recurrent state), and a page has one object per group, holding that group's
// layers in layer order. A block index names a block of one group's layers; the engine's block
// pool is shared by all groups (vLLM's hybrid allocator gives a block to one group at a time), so
// buffers of different groups may lie over the same bytes.
//
// In core (pure arithmetic on the description) because both sides use it: the engine's client
// library describes its cache with it, and the daemon's gpu/ backends and server/ validate and
// copy by it.
#ifndef KVCELLAR_CORE_KV_LAYOUT_H_
#define KVCELLAR_CORE_KV_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvcellar::core {

// A model has at most a few hundred layers; 1024 bounds per-engine memory and validation time.
inline constexpr uint32_t kMaxLayers = 1024;
// In a hybrid model's per-(page, group) block lists: this group's object of the page is not moved.
inline constexpr uint32_t kNoBlock = 0xFFFFFFFF;
// Each layer's K and V may each be a separate allocation.
inline constexpr uint32_t kMaxRegions = 2 * kMaxLayers;
// Longest backend handle accepted: a CUDA IPC handle is 64 bytes, a POSIX shm name at most
// NAME_MAX (255) bytes.
inline constexpr size_t kMaxRegionHandleBytes = 255;

// One engine allocation (or a window of one) that KV buffers point into.
struct MemoryRegion {
  // Backend-specific, opaque bytes. CUDA: the 64-byte cudaIpcMemHandle_t of the allocation. sim:
  // the POSIX shared-memory object name, e.g. "/kvc-engine-7-rank0".
  std::string handle;
  // Where the region starts inside that allocation. CUDA: from the base pointer that
  // cudaIpcOpenMemHandle returns (the allocation base, which a PyTorch tensor need not start at).
  // sim: from the start of the shm object.
  uint64_t offset = 0;
  uint64_t size = 0;
};

// One buffer of one layer: block b is bytes [offset + b * block_stride, + bytes_per_block) of the
// region. Blocks never overlap each other (bytes_per_block <= block_stride).
struct BufferLayout {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t bytes_per_block = 0;
};

struct LayerLayout {
  BufferLayout k;                 // MLA: the latent buffer.
  std::optional<BufferLayout> v;  // Absent for MLA.
  uint32_t group = 0;             // The KV group (NamespaceSpec::groups) the layer belongs to.
};

struct KvLayout {
  std::vector<MemoryRegion> regions;
  uint32_t num_blocks = 0;
  std::vector<LayerLayout> layers;
  // Empty: every group indexes one pool of num_blocks blocks (vLLM's hybrid allocator gives a
  // block to one group at a time, so buffers of different groups may share bytes). Otherwise one
  // entry per group: group g has its own pool of group_num_blocks[g] blocks (SGLang's host pools
  // per KV kind), its block b is not group h's block b, buffers of different groups never share
  // a byte, and num_blocks is the largest entry.
  std::vector<uint32_t> group_num_blocks;

  // INVALID_ARGUMENT naming the offending field ("layers[3].v.block_stride ...") when: a count is
  // out of range; a buffer names a missing region, has zero size, overlaps its own next block, or
  // runs past its region (over its group's blocks); layers mix MHA and MLA; groups are not
  // numbered 0..G-1 without gaps; group_num_blocks is set but not one nonzero entry per group
  // with num_blocks the largest; or two buffers of one group (of any groups, when each has its
  // own pool) share a byte. A layout that passes can be copied to and from without any further
  // bounds checks except block indices (each below its group's GroupBlocks).
  absl::Status Validate() const;

  // True when every layer has a single (latent) buffer. Meaningful after Validate().
  bool is_mla() const { return !layers.empty() && !layers.front().v.has_value(); }

  // Number of KV groups: the largest layer group + 1 (1 for a model of one group).
  uint32_t NumGroups() const;

  // Whether each group has its own block pool (group_num_blocks set).
  bool separate_group_pools() const { return !group_num_blocks.empty(); }

  // Valid block indices of group g are [0, GroupBlocks(g)).
  uint32_t GroupBlocks(uint32_t g) const {
    return group_num_blocks.empty() ? num_blocks : group_num_blocks[g];
  }

  // Bytes of group `group`'s page object: the sum of its buffers' bytes_per_block.
  uint64_t GroupObjectBytes(uint32_t group) const;

  // Bytes of the largest page object (of a single-group model: its one object). Every object of
  // a namespace takes an L2 slot of this size.
  uint64_t PageObjectBytes() const;
};

// One contiguous piece of a page object and the device buffer it mirrors.
struct PageSegment {
  uint32_t layer = 0;
  uint32_t buffer = 0;  // 0: K (or the MLA latent); 1: V.
  uint32_t region = 0;
  uint64_t device_offset = 0;  // Of block 0, from the region start.
  uint64_t block_stride = 0;
  uint64_t bytes = 0;          // bytes_per_block.
  uint64_t object_offset = 0;  // Where this piece starts inside its group's page object.
  uint32_t group = 0;          // The layer's group: the object this piece belongs to.
};

// The page object format: segments in layer order (layer 0 K, layer 0 V, layer 1 K, ...); within
// each group's object, each starts where the group's previous one ended. The layout must be valid.
std::vector<PageSegment> PageSegments(const KvLayout& layout);

// Per-layer view of the same format, for readers of page objects (L3 tools, engines): offsets
// inside the layer's group's object.
struct LayerObjectOffsets {
  uint64_t k_offset = 0;
  uint64_t k_bytes = 0;
  uint64_t v_offset = 0;  // Equal to k_offset + k_bytes, with v_bytes 0, for MLA.
  uint64_t v_bytes = 0;
};
std::vector<LayerObjectOffsets> PageObjectOffsets(const KvLayout& layout);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_KV_LAYOUT_H_
