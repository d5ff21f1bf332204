// Helpers shared by the sim device tests: deterministic KV patterns and their checks, the
// EngineSpec a sim engine registers, and the op words its signal region ends with.
#ifndef KVCELLAR_TESTS_GPU_SIM_TEST_UTIL_H_
#define KVCELLAR_TESTS_GPU_SIM_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "core/kv_layout.h"
#include "core/signal_layout.h"
#include "gpu/device_backend.h"
#include "gpu/sim_device.h"
#include "gtest/gtest.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::gpu::testing {

// A sim device with one copy thread: copies finish in submission order, as tests expect.
inline std::unique_ptr<SimDevice> OneThreadSimDevice() {
  SimDevice::Options o;
  o.copy_threads = 1;
  absl::StatusOr<std::unique_ptr<SimDevice>> d = SimDevice::Create(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return *std::move(d);
}

// What a daemon passes OpenEngine for `kv`: its layout and, when it has one, its signal region.
inline EngineSpec SpecOf(const platform::SimEngineKvCache& kv, std::string device_uuid = "") {
  EngineSpec spec;
  spec.device_uuid = std::move(device_uuid);
  spec.layout = kv.layout();
  if (kv.completion().valid()) spec.completion_region = kv.completion().name();
  return spec;
}

// The op word of op `id` once it ended well (Done) or not (Failed): core/signal_layout.h.
inline uint64_t Done(uint64_t id) { return core::SignalLayout::OpWord(id, /*failed=*/false); }
inline uint64_t Failed(uint64_t id) { return core::SignalLayout::OpWord(id, /*failed=*/true); }

// The 8 bytes at word `w` of (layer, buffer, block) under `seed`: every block of every buffer
// differs, so a byte copied from or to the wrong place shows.
inline uint64_t PatternWord(uint32_t seed, uint32_t layer, uint32_t buffer, uint32_t block,
                            uint64_t w) {
  uint64_t x = (uint64_t{seed} * 0x9E3779B97F4A7C15ull) ^ (uint64_t{layer} << 44) ^
               (uint64_t{buffer} << 42) ^ (uint64_t{block} << 22) ^ w;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

inline void FillPattern(uint8_t* dst, uint64_t bytes, uint32_t seed, uint32_t layer,
                        uint32_t buffer, uint32_t block) {
  for (uint64_t w = 0; w * 8 < bytes; ++w) {
    uint64_t v = PatternWord(seed, layer, buffer, block, w);
    std::memcpy(dst + w * 8, &v, std::min<uint64_t>(8, bytes - w * 8));
  }
}

inline bool HoldsPattern(const uint8_t* p, uint64_t bytes, uint32_t seed, uint32_t layer,
                         uint32_t buffer, uint32_t block) {
  for (uint64_t w = 0; w * 8 < bytes; ++w) {
    uint64_t v = PatternWord(seed, layer, buffer, block, w);
    if (std::memcmp(p + w * 8, &v, std::min<uint64_t>(8, bytes - w * 8)) != 0) return false;
  }
  return true;
}

// Writes `seed`'s pattern into every block of the engine's KV cache.
inline void FillEngine(const platform::SimEngineKvCache& kv, uint32_t seed) {
  const core::KvLayout& l = kv.layout();
  for (uint32_t layer = 0; layer < l.layers.size(); ++layer) {
    for (uint32_t buf = 0; buf < (l.is_mla() ? 1u : 2u); ++buf) {
      const uint64_t bytes =
          buf == 0 ? l.layers[layer].k.bytes_per_block : l.layers[layer].v->bytes_per_block;
      for (uint32_t b = 0; b < l.num_blocks; ++b) {
        FillPattern(kv.Block(layer, buf, b), bytes, seed, layer, buf, b);
      }
    }
  }
}

// Empty string when the page object holds (seed, block)'s bytes for every layer; otherwise
// where it first differs.
inline std::string CheckPage(const core::KvLayout& l, const uint8_t* page, uint32_t seed,
                             uint32_t block) {
  for (const core::PageSegment& s : core::PageSegments(l)) {
    if (!HoldsPattern(page + s.object_offset, s.bytes, seed, s.layer, s.buffer, block)) {
      return "layer " + std::to_string(s.layer) + " buffer " + std::to_string(s.buffer) +
             " differs from block " + std::to_string(block);
    }
  }
  return "";
}

// Empty when device block `block` holds (seed, source_block)'s bytes for every layer.
inline std::string CheckBlock(const platform::SimEngineKvCache& kv, uint32_t block, uint32_t seed,
                              uint32_t source_block, uint32_t only_layer = ~0u) {
  for (const core::PageSegment& s : core::PageSegments(kv.layout())) {
    if (only_layer != ~0u && s.layer != only_layer) continue;
    if (!HoldsPattern(kv.Block(s.layer, s.buffer, block), s.bytes, seed, s.layer, s.buffer,
                      source_block)) {
      return "block " + std::to_string(block) + " layer " + std::to_string(s.layer) + " buffer " +
             std::to_string(s.buffer) + " is not block " + std::to_string(source_block) + "'s";
    }
  }
  return "";
}

}  // namespace kvcellar::gpu::testing

#endif  // KVCELLAR_TESTS_GPU_SIM_TEST_UTIL_H_
