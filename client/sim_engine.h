// SimEngine: one engine rank's KV cache on the sim device, for tests, benchmarks and the
// kvcellar-engine-sim tool: the shm "device memory" (platform::SimEngineKvCache), the KVCSIG01
// completion channel (sim_signals.h), and a deterministic byte pattern to fill and verify blocks.
//
// The pattern: byte i of the part of a page object that belongs to one layer (K bytes, then V
// bytes; MLA: the latent) is a function of (seed, page key, shard, layer, i) only, so any process
// that knows the key and the shard can verify a block another process backed up, whatever block
// index or block arrangement either used.
//
// Threading: thread-compatible; distinct blocks may be filled and verified concurrently.
#ifndef KVCELLAR_CLIENT_SIM_ENGINE_H_
#define KVCELLAR_CLIENT_SIM_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/client_types.h"
#include "client/sim_signals.h"
#include "core/page_key.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::client {

struct SimEngineOptions {
  // Prefix of the shm objects ("<prefix>-kv", "<prefix>-sig"); empty picks a unique one.
  std::string name_prefix = "";
  uint32_t num_layers = 2;
  bool mla = false;
  uint64_t bytes_per_block = 4096;  // Per buffer (K, V or the latent) per layer.
  uint32_t num_blocks = 64;
  platform::SimKvShape::Arrangement arrangement = platform::SimKvShape::Arrangement::kLayerFirst;
  uint32_t load_slots = 4;  // 0 and 0: no completion channel.
  uint32_t ready_slots = 4;
  // Permission bits of the shm objects. The default lets only the engine's user open them: a
  // daemon running as another user needs them shared with its group (e.g. 0660 with the group
  // set) or with everyone. Whichever bits, the daemon maps them for this engine only because the
  // engine's user owns them (docs/security.md).
  uint32_t shm_mode = platform::ShmMapping::kDefaultMode;
};

// Byte `byte` of layer `layer`'s part of the page object of (key, shard).
uint8_t PatternByte(uint64_t seed, const core::PageKey& key, uint32_t shard, uint32_t layer,
                    uint64_t byte);
// Writes bytes [first, first + n) of that sequence to dst.
void FillPattern(uint8_t* dst, uint64_t n, uint64_t seed, const core::PageKey& key, uint32_t shard,
                 uint32_t layer, uint64_t first);

class SimEngine {
 public:
  static absl::StatusOr<std::unique_ptr<SimEngine>> Create(const SimEngineOptions& options);

  const SimEngineOptions& options() const { return options_; }
  const core::KvLayout& layout() const { return kv_.layout(); }
  uint32_t num_layers() const { return options_.num_layers; }
  uint32_t num_blocks() const { return options_.num_blocks; }
  uint32_t buffers() const { return options_.mla ? 1 : 2; }
  // Bytes of one page object (every layer's K and V).
  uint64_t page_bytes() const {
    return uint64_t{options_.num_layers} * buffers() * options_.bytes_per_block;
  }
  // Fills the device, layout and completion fields of a registration (kSim, this cache).
  void Describe(EngineRegistration* reg) const;

  uint8_t* Block(uint32_t layer, uint32_t buffer, uint32_t block) const {
    return kv_.Block(layer, buffer, block);
  }
  // Every buffer of `block` gets the pattern of (seed, key, shard).
  void FillBlock(uint32_t block, uint64_t seed, const core::PageKey& key, uint32_t shard);
  // Every byte of `block` set to `value` (to make stale contents visible).
  void ClearBlock(uint32_t block, uint8_t value);
  // Bytes of `block` that differ from the pattern; the first one described in *first.
  uint64_t CountMismatches(uint32_t block, uint64_t seed, const core::PageKey& key, uint32_t shard,
                           std::string* first = nullptr) const;
  // The same for one layer's buffers only (to check a layer the moment it is signalled).
  uint64_t CountLayerMismatches(uint32_t block, uint32_t layer, uint64_t seed,
                                const core::PageKey& key, uint32_t shard,
                                std::string* first = nullptr) const;

  SimSignalRegion& signals() { return signals_; }
  bool has_signals() const { return signals_.valid(); }
  // A ready token larger than every earlier one (so strictly increasing per slot).
  uint64_t NextReadyToken() { return ++ready_tokens_; }
  void PublishReady(uint32_t slot, uint64_t token) { signals_.PublishReady(slot, token); }

 private:
  SimEngine(SimEngineOptions options, platform::SimEngineKvCache kv, SimSignalRegion signals)
      : options_(std::move(options)), kv_(std::move(kv)), signals_(std::move(signals)) {}

  const SimEngineOptions options_;
  platform::SimEngineKvCache kv_;
  SimSignalRegion signals_;
  std::atomic<uint64_t> ready_tokens_{0};
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_SIM_ENGINE_H_
