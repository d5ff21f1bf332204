// The KV shape of the simulated model, and how kvcellar-bench sizes it to the daemon's L2.
//
// MHA/GQA: every layer holds K and V of kv_heads heads of head_dim elements per token, split
// evenly over the TP ranks (one page object per rank: a shard). MLA: every layer holds one latent
// vector of mla_latent elements per token, identical on every rank (one shard, read by all).
//
// Scaling. The benchmark's shape is fixed in tokens (clients x rounds x new tokens), so what makes
// a run meaningful on a given daemon is the bytes per token: AutoScale picks the number of layers
// (and, when the page size is not given, the page size) so that every page the workload computes
// fills `fill` of the daemon's L2 capacity. At fill < 1 the whole conversation history fits and
// the measured hit rate should equal the workload's best case; above 1 the eviction policy decides
// what is lost.
//
// Threading: a value type.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_MODEL_SHAPE_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_MODEL_SHAPE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace kvcellar::bench {

// The host pool's largest slot at the default region size (core/host_pool.h): a page object must
// fit one.
inline constexpr uint64_t kMaxSlotBytes = 64 << 20;

// L2 bytes an object of object_bytes takes: the smallest of the host pool's default slot sizes
// that holds it (core::HostPool::DefaultSlotSizes; a daemon with another pool.region_size may
// differ slightly). object_bytes itself when larger than every slot.
uint64_t SlotBytes(uint64_t object_bytes);
// Auto-scaling grows layers up to this (deep models have 60 to 126 layers), then KV heads.
inline constexpr uint32_t kMaxAutoLayers = 64;

struct ModelShape {
  uint32_t layers = 1;
  uint32_t kv_heads = 1;  // MHA/GQA; a multiple of tp.
  uint32_t head_dim = 128;
  uint32_t mla_latent = 0;  // > 0: MLA with this latent size (e.g. 576 for DeepSeek V3).
  std::string dtype = "bf16";
  uint32_t page_size = 64;
  uint32_t tp = 1;

  bool mla() const { return mla_latent > 0; }
  // Bytes of one element of dtype; 0 for a dtype the bench does not simulate.
  uint32_t DtypeBytes() const;
  // OK, or InvalidArgument naming the flag (--kv-heads, --dtype, ...).
  absl::Status Validate() const;
  uint32_t shards() const { return mla() ? 1 : tp; }
  // Bytes of one buffer (K, V or latent) of one layer of one page on one rank.
  uint64_t BlockBytes() const;
  // Bytes of one page object (one shard: every layer, K then V).
  uint64_t ObjectBytes() const { return uint64_t{layers} * (mla() ? 1 : 2) * BlockBytes(); }
  // L2 bytes one page takes: every shard, each in its slot (SlotBytes).
  uint64_t L2BytesPerPage() const;
  // KV bytes of one token across the TP group (MLA: one copy).
  uint64_t BytesPerToken() const;
  std::string Describe() const;
};

// Doubles shape->layers from 1 (up to kMaxAutoLayers; then the MHA KV heads) while
// distinct_pages(P) pages take at most fill * l2_capacity bytes of L2 and a page object fits
// kMaxSlotBytes, where P is shape->page_size or, when choose_page_size, the smallest power of two
// from 64 to 1024 at which a single layer fits. Powers of two keep page objects on the pool's slot
// sizes, so the footprint is exact. Returns the footprint's fraction of L2 (above fill when even
// the smallest shape does not fit).
template <typename PagesFn>
double AutoScale(uint64_t l2_capacity, double fill, bool choose_page_size, PagesFn distinct_pages,
                 ModelShape* shape) {
  const double budget = fill * static_cast<double>(l2_capacity);
  auto footprint = [&](const ModelShape& s) {
    return static_cast<double>(distinct_pages(s.page_size)) *
           static_cast<double>(s.L2BytesPerPage());
  };
  shape->layers = 1;
  if (choose_page_size) {
    for (shape->page_size = 64; shape->page_size < 1024 && footprint(*shape) > budget;) {
      shape->page_size *= 2;
    }
  }
  for (;;) {
    ModelShape bigger = *shape;
    if (bigger.layers < kMaxAutoLayers || bigger.mla()) {
      bigger.layers *= 2;
    } else {
      bigger.kv_heads *= 2;
    }
    if (bigger.layers > 1024 || bigger.ObjectBytes() > kMaxSlotBytes ||
        footprint(bigger) > budget) {
      break;
    }
    *shape = bigger;
  }
  return l2_capacity == 0 ? 0 : footprint(*shape) / static_cast<double>(l2_capacity);
}

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_MODEL_SHAPE_H_
