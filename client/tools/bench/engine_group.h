// EngineGroup: one simulated engine instance of kvcellar-bench: TP ranks, each a sim-device KV
// cache (client/sim_engine.h) registered as its own session with the daemon, sharing one block
// pool. Run() serves one request the way an engine's scheduler and model runner would:
//
//   Match (every rank, one step id: the group-consistent answer; pin the hit)
//   -> [L3 hit: wait for the daemon's prefetch into L2]
//   -> Load the hit into engine blocks (every rank), WaitOps, verify every loaded byte
//   -> "prefill" the missed pages: write the deterministic pattern of (seed, page key, shard)
//   -> Backup the new full pages (MHA: every rank its shard; MLA: the shard writer), WaitOps
//   -> Release the pin, free the blocks.
//
// Every loaded byte is compared with the pattern its page key and shard imply, whatever process
// or request backed it up: a mismatch is the worst bug the daemon can have, and is counted.
// A cache failure is a miss (the request recomputes), never a failed request.
//
// Threading: Run is thread-safe (requests run concurrently on distinct blocks).
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_ENGINE_GROUP_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_ENGINE_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kvcellar_client.h"
#include "client/sim_engine.h"
#include "client/tools/bench/block_pool.h"
#include "client/tools/bench/model_shape.h"
#include "client/tools/bench/stats.h"

namespace kvcellar::bench {

struct EngineGroupOptions {
  std::string addr;
  ModelShape shape;
  uint32_t num_blocks = 0;  // Per rank.
  std::string instance_id;
  std::string model_id;
  std::string tenant;
  std::string revision;
  uint64_t kv_seed = 0;  // Seed of the KV byte pattern.
  absl::Duration rpc_timeout = absl::Seconds(2);
  absl::Duration op_timeout = absl::Seconds(30);
  absl::Duration register_wait = absl::Seconds(5);
};

class EngineGroup {
 public:
  // Creates the ranks' sim memory and registers every rank; an error says which step failed
  // (unreachable daemon, registration rejected, shared memory).
  static absl::StatusOr<std::unique_ptr<EngineGroup>> Create(EngineGroupOptions options,
                                                             Stats* stats);
  ~EngineGroup();

  // Serves one request. `tokens` are the tokens whose KV the engine holds after it; the first
  // prompt_tokens of them are the prompt. `step_id` is unique per request (> 0). An error only
  // when the engine itself cannot go on (not enough usable blocks).
  absl::StatusOr<RequestResult> Run(uint64_t step_id, absl::Span<const uint32_t> tokens,
                                    uint64_t prompt_tokens);

  // The daemon's L3 tiers, in lookup order (from rank 0's registration).
  std::vector<std::string> l3_tier_names() const;
  uint64_t quarantined_blocks() const { return blocks_.quarantined(); }
  client::ClientStats client_stats() const { return client_->stats(); }
  // Unregisters every rank.
  void Close();

 private:
  struct Rank {
    std::unique_ptr<client::SimEngine> sim;
    std::unique_ptr<client::Session> session;
    uint32_t shard = 0;
    bool writer = true;
  };

  EngineGroup(EngineGroupOptions options, Stats* stats)
      : options_(std::move(options)), stats_(stats), blocks_(options_.num_blocks) {}
  // Waits until the op is terminal or the op timeout passes, timing each WaitOps.
  client::OpResult Wait(client::Session& session, client::OpResult op);

  // The phases of Run, in order.
  struct Request;
  // Match on every rank (one step id), and the L3 hit prefetched; returns the pages to load and
  // sets the group's pin.
  uint32_t MatchGroup(uint64_t step_id, uint32_t prompt_pages, Request& req, uint64_t* pin_id);
  // Loads the hit on every rank and checks every loaded byte; returns the pages every rank has.
  uint32_t LoadAndVerify(uint32_t hit, uint64_t pin_id, Request& req);
  // Fills the pages after `usable` as a prefill would, and backs them up.
  void PrefillAndBackup(uint32_t usable, Request& req);

  const EngineGroupOptions options_;
  Stats* const stats_;
  core::NamespaceSpec ns_;
  BlockPool blocks_;
  std::unique_ptr<client::Client> client_;
  std::vector<Rank> ranks_;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_ENGINE_GROUP_H_
