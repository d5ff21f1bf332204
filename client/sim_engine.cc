#include "client/sim_engine.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/splitmix.h"

namespace kvcellar::client {
namespace {

uint64_t PatternBase(uint64_t seed, const core::PageKey& key, uint32_t shard, uint32_t layer) {
  uint64_t h = core::SplitMix64(seed);
  for (size_t i = 0; i < core::kPageKeyBytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, key.bytes.data() + i, sizeof(w));
    h = core::SplitMix64(h ^ w);
  }
  h = core::SplitMix64(h ^ (uint64_t{shard} << 32 | layer));
  return h;
}

uint8_t WordByte(uint64_t base, uint64_t byte) {
  return static_cast<uint8_t>(core::SplitMix64(base + byte / 8) >> (8 * (byte % 8)));
}

}  // namespace

uint8_t PatternByte(uint64_t seed, const core::PageKey& key, uint32_t shard, uint32_t layer,
                    uint64_t byte) {
  return WordByte(PatternBase(seed, key, shard, layer), byte);
}

void FillPattern(uint8_t* dst, uint64_t n, uint64_t seed, const core::PageKey& key, uint32_t shard,
                 uint32_t layer, uint64_t first) {
  const uint64_t base = PatternBase(seed, key, shard, layer);
  uint64_t i = 0;
  // Unaligned head, whole words, tail: byte b of the sequence is byte b % 8 of word b / 8.
  for (; i < n && (first + i) % 8 != 0; ++i) dst[i] = WordByte(base, first + i);
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = core::SplitMix64(base + (first + i) / 8);
    std::memcpy(dst + i, &w, 8);  // Little-endian host: byte k of w is byte (first+i+k).
  }
  for (; i < n; ++i) dst[i] = WordByte(base, first + i);
}

absl::StatusOr<std::unique_ptr<SimEngine>> SimEngine::Create(const SimEngineOptions& options) {
  SimEngineOptions o = options;
  if (o.name_prefix.empty()) o.name_prefix = platform::UniqueShmName("eng");
  platform::SimKvShape shape;
  shape.num_layers = o.num_layers;
  shape.num_blocks = o.num_blocks;
  shape.bytes_per_block = o.bytes_per_block;
  shape.mla = o.mla;
  shape.arrangement = o.arrangement;
  absl::StatusOr<platform::SimEngineKvCache> kv =
      platform::SimEngineKvCache::Create(o.name_prefix, shape, /*completion_slots=*/0, o.shm_mode);
  if (!kv.ok()) return kv.status();
  SimSignalRegion signals;
  if (o.load_slots > 0 || o.ready_slots > 0) {
    absl::StatusOr<SimSignalRegion> s = SimSignalRegion::Create(
        absl::StrCat(o.name_prefix, "-sig"), o.load_slots, o.num_layers, o.ready_slots, o.shm_mode);
    if (!s.ok()) return s.status();
    signals = *std::move(s);
  }
  return std::unique_ptr<SimEngine>(
      new SimEngine(std::move(o), *std::move(kv), std::move(signals)));
}

void SimEngine::Describe(EngineRegistration* reg) const {
  reg->device_kind = DeviceKind::kSim;
  if (reg->device_name.empty()) reg->device_name = "sim";
  reg->layout = kv_.layout();
  reg->completion = signals_.valid() ? signals_.Channel() : CompletionChannelSpec{};
}

void SimEngine::FillBlock(uint32_t block, uint64_t seed, const core::PageKey& key, uint32_t shard) {
  const uint64_t bpb = options_.bytes_per_block;
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    for (uint32_t b = 0; b < buffers(); ++b) {
      FillPattern(Block(l, b, block), bpb, seed, key, shard, l, b * bpb);
    }
  }
}

void SimEngine::ClearBlock(uint32_t block, uint8_t value) {
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    for (uint32_t b = 0; b < buffers(); ++b) {
      std::memset(Block(l, b, block), value, options_.bytes_per_block);
    }
  }
}

uint64_t SimEngine::CountMismatches(uint32_t block, uint64_t seed, const core::PageKey& key,
                                    uint32_t shard, std::string* first) const {
  uint64_t bad = 0;
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    bad += CountLayerMismatches(block, l, seed, key, shard, bad == 0 ? first : nullptr);
  }
  return bad;
}

uint64_t SimEngine::CountLayerMismatches(uint32_t block, uint32_t layer, uint64_t seed,
                                         const core::PageKey& key, uint32_t shard,
                                         std::string* first) const {
  const uint64_t bpb = options_.bytes_per_block;
  std::string expect(bpb, '\0');
  uint8_t* want = reinterpret_cast<uint8_t*>(expect.data());
  uint64_t bad = 0;
  for (uint32_t b = 0; b < buffers(); ++b) {
    FillPattern(want, bpb, seed, key, shard, layer, b * bpb);
    const uint8_t* got = Block(layer, b, block);
    if (std::memcmp(got, want, bpb) == 0) continue;
    for (uint64_t i = 0; i < bpb; ++i) {
      if (got[i] == want[i]) continue;
      if (bad == 0 && first != nullptr) {
        *first = absl::StrCat("block ", block, " layer ", layer, " buffer ", b, " byte ", i,
                              ": got ", got[i], " want ", want[i]);
      }
      ++bad;
    }
  }
  return bad;
}

}  // namespace kvcellar::client
