#include "core/kv_layout.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcellar::core {
namespace {

using int128 = __int128;

struct BufferRef {
  uint32_t layer;
  uint32_t group;
  const char* which;  // "k" or "v"
  const BufferLayout* buf;
  const std::string* handle;  // The allocation: regions sharing a handle share bytes.
  uint64_t begin;             // First byte of block 0, from the allocation start.
  uint64_t end;               // One past the last byte of the last block.
};

std::string Name(const BufferRef& b) { return absl::StrCat("layers[", b.layer, "].", b.which); }

int128 FloorDiv(int128 a, int128 b) {  // b > 0
  int128 q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}

// Whether two buffers with the same block stride share a byte. Block i of X is
// [a + i*s, a + i*s + ba) for i in [0, nx), block j of Y is [c + j*s, c + j*s + bb) for j in
// [0, ny); with d = c - a and k = j - i they meet iff -bb < d + k*s < ba for some k in
// [-(nx-1), ny-1]. The smallest k above the lower bound is the only candidate worth testing,
// clamped to the allowed range.
bool SameStrideCollide(const BufferRef& x, uint32_t nx, const BufferRef& y, uint32_t ny) {
  const int128 s = x.buf->block_stride;
  const int128 d = int128(y.begin) - int128(x.begin);
  const int128 ba = x.buf->bytes_per_block, bb = y.buf->bytes_per_block;
  int128 k = FloorDiv(-bb - d, s) + 1;
  k = std::max<int128>(k, -(int128(nx) - 1));
  return k <= int128(ny) - 1 && d + k * s < ba;
}

absl::Status ValidateBuffer(const KvLayout& l, uint32_t layer, const char* which,
                            const BufferLayout& b) {
  const std::string name = absl::StrCat("layers[", layer, "].", which);
  if (b.region >= l.regions.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".region (", b.region, ") out of range: ", l.regions.size(), " regions"));
  }
  if (b.bytes_per_block == 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".bytes_per_block is 0"));
  }
  if (b.bytes_per_block > b.block_stride) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".bytes_per_block (", b.bytes_per_block, ") exceeds ", name,
                     ".block_stride (", b.block_stride, "): consecutive blocks would overlap"));
  }
  // offset + (blocks - 1) * stride + bytes_per_block, in 128 bits so nothing wraps.
  const uint32_t blocks = l.GroupBlocks(l.layers[layer].group);
  const int128 end = int128(b.offset) + int128(blocks - 1) * b.block_stride + b.bytes_per_block;
  const uint64_t region_size = l.regions[b.region].size;
  if (end > int128(region_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": block ", blocks - 1, " ends past regions[", b.region, "].size (",
                     region_size, "); offset ", b.offset, ", block_stride ", b.block_stride,
                     ", bytes_per_block ", b.bytes_per_block));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KvLayout::Validate() const {
  if (layers.empty() || layers.size() > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: count ", layers.size(), " not in [1, ", kMaxLayers, "]"));
  }
  if (regions.empty() || regions.size() > kMaxRegions) {
    return absl::InvalidArgumentError(
        absl::StrCat("regions: count ", regions.size(), " not in [1, ", kMaxRegions, "]"));
  }
  if (num_blocks == 0) return absl::InvalidArgumentError("num_blocks is 0");
  for (size_t i = 0; i < regions.size(); ++i) {
    const MemoryRegion& r = regions[i];
    if (r.handle.empty() || r.handle.size() > kMaxRegionHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("regions[", i, "].handle: length ",
                                                     r.handle.size(), " not in [1, ",
                                                     kMaxRegionHandleBytes, "]"));
    }
    if (r.size == 0) return absl::InvalidArgumentError(absl::StrCat("regions[", i, "].size is 0"));
    if (r.offset + r.size < r.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("regions[", i, "]: offset + size overflows 64 bits"));
    }
  }
  const bool mla = !layers.front().v.has_value();
  // Groups are numbered 0..G-1, each with at least one layer.
  for (uint32_t i = 0; i < layers.size(); ++i) {
    if (layers[i].group >= kMaxLayers) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "].group (", layers[i].group,
                                                     ") out of range [0, ", kMaxLayers, ")"));
    }
  }
  const uint32_t groups = NumGroups();
  std::vector<bool> seen(groups, false);
  for (const LayerLayout& layer : layers) seen[layer.group] = true;
  for (uint32_t g = 0; g < groups; ++g) {
    if (!seen[g]) {
      return absl::InvalidArgumentError(absl::StrCat("layers: no layer is in group ", g,
                                                     " (groups are numbered 0..", groups - 1,
                                                     " and each has a layer)"));
    }
  }
  if (separate_group_pools()) {
    if (group_num_blocks.size() != groups) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_num_blocks: ", group_num_blocks.size(), " entries for ", groups,
                       " groups (one per group, or none when the groups share one pool)"));
    }
    uint64_t total = 0;
    uint32_t largest = 0;
    for (uint32_t g = 0; g < groups; ++g) {
      if (group_num_blocks[g] == 0) {
        return absl::InvalidArgumentError(absl::StrCat("group_num_blocks[", g, "] is 0"));
      }
      total += group_num_blocks[g];
      largest = std::max(largest, group_num_blocks[g]);
    }
    if (total > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_num_blocks: ", total, " blocks in all, more than 2^32 - 1"));
    }
    if (num_blocks != largest) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_blocks (", num_blocks, ") must be the largest group_num_blocks entry (",
                       largest, ") when each group has its own pool"));
    }
  }
  std::vector<BufferRef> refs;
  refs.reserve(layers.size() * 2);
  for (uint32_t i = 0; i < layers.size(); ++i) {
    const LayerLayout& layer = layers[i];
    if (layer.v.has_value() == mla) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", i, "].v: ", mla ? "present" : "absent", " but layers[0].v is ",
                       mla ? "absent (MLA)" : "present (MHA)", "; a layout is all MHA or all MLA"));
    }
    if (absl::Status s = ValidateBuffer(*this, i, "k", layer.k); !s.ok()) return s;
    if (layer.v) {
      if (absl::Status s = ValidateBuffer(*this, i, "v", *layer.v); !s.ok()) return s;
    }
    auto add = [&](const char* which, const BufferLayout& b) {
      const MemoryRegion& r = regions[b.region];
      const uint64_t begin = r.offset + b.offset;  // Fits: both are inside offset + size.
      refs.push_back(
          {i, layer.group, which, &b, &r.handle, begin,
           begin + uint64_t(GroupBlocks(layer.group) - 1) * b.block_stride + b.bytes_per_block});
    };
    add("k", layer.k);
    if (layer.v) add("v", *layer.v);
  }

  // No two buffers may share a byte: a scatter into one would corrupt the other. Regions with
  // the same handle are windows of one allocation, so buffers are compared by allocation and
  // absolute offset. Sorted by (allocation, start), only pairs whose extents intersect are
  // compared; interleaved layouts (all layers of a block side by side) compare every pair, at
  // most ~2M cheap tests.
  std::sort(refs.begin(), refs.end(), [](const BufferRef& a, const BufferRef& b) {
    if (*a.handle != *b.handle) return *a.handle < *b.handle;
    return a.begin < b.begin;
  });
  for (size_t i = 0; i < refs.size(); ++i) {
    for (size_t j = i + 1; j < refs.size(); ++j) {
      const BufferRef& a = refs[i];
      const BufferRef& b = refs[j];
      if (*b.handle != *a.handle || b.begin >= a.end) break;
      // Groups sharing the engine's block pool: a block is one group's at a time. Groups with
      // pools of their own are used at once, so their buffers may not meet either.
      if (a.group != b.group && !separate_group_pools()) continue;
      const uint32_t na = GroupBlocks(a.group);
      const uint32_t nb = GroupBlocks(b.group);
      bool collide;
      const char* why = "";
      if (na == 1 && nb == 1) {
        collide = true;  // Single blocks whose extents intersect.
      } else if (a.buf->block_stride == b.buf->block_stride) {
        collide = SameStrideCollide(a, na, b, nb);
      } else {
        // Interleaving buffers of different strides is not a layout any engine uses; proving it
        // disjoint is not worth the risk of a wrong proof.
        collide = true;
        why = " (different block strides over the same bytes)";
      }
      if (collide) {
        return absl::InvalidArgumentError(absl::StrCat(Name(b), " overlaps ", Name(a), " (regions[",
                                                       b.buf->region, "] and regions[",
                                                       a.buf->region, "])", why));
      }
    }
  }
  return absl::OkStatus();
}

uint32_t KvLayout::NumGroups() const {
  uint32_t groups = 0;
  for (const LayerLayout& l : layers) groups = std::max(groups, l.group + 1);
  return groups;
}

uint64_t KvLayout::GroupObjectBytes(uint32_t group) const {
  uint64_t total = 0;
  for (const LayerLayout& l : layers) {
    if (l.group != group) continue;
    total += l.k.bytes_per_block;
    if (l.v) total += l.v->bytes_per_block;
  }
  return total;
}

uint64_t KvLayout::PageObjectBytes() const {
  uint64_t largest = 0;
  for (uint32_t g = 0; g < NumGroups(); ++g) largest = std::max(largest, GroupObjectBytes(g));
  return largest;
}

std::vector<PageSegment> PageSegments(const KvLayout& layout) {
  std::vector<PageSegment> segs;
  segs.reserve(layout.layers.size() * 2);
  std::vector<uint64_t> at(layout.NumGroups(), 0);  // The next offset in each group's object.
  for (uint32_t i = 0; i < layout.layers.size(); ++i) {
    const LayerLayout& l = layout.layers[i];
    auto add = [&](uint32_t buffer, const BufferLayout& b) {
      segs.push_back(
          {i, buffer, b.region, b.offset, b.block_stride, b.bytes_per_block, at[l.group], l.group});
      at[l.group] += b.bytes_per_block;
    };
    add(0, l.k);
    if (l.v) add(1, *l.v);
  }
  return segs;
}

std::vector<LayerObjectOffsets> PageObjectOffsets(const KvLayout& layout) {
  std::vector<LayerObjectOffsets> out;
  out.reserve(layout.layers.size());
  std::vector<uint64_t> group_at(layout.NumGroups(), 0);
  for (const LayerLayout& l : layout.layers) {
    uint64_t& at = group_at[l.group];
    LayerObjectOffsets o;
    o.k_offset = at;
    o.k_bytes = l.k.bytes_per_block;
    at += o.k_bytes;
    o.v_offset = at;
    o.v_bytes = l.v ? l.v->bytes_per_block : 0;
    at += o.v_bytes;
    out.push_back(o);
  }
  return out;
}

}  // namespace kvcellar::core
