// What kvcellar-bench runs: numbered requests, each a token sequence whose KV the engine holds
// after it, served in chains (a chain's next request starts only after its previous one finished;
// chains are served first come, first served).
//
// The multi-turn conversation workload (the default): the shape SGLang HiCache is benchmarked
// with (clients that each hold a conversation of several rounds; every round sends the whole
// history plus new tokens and gets output tokens back). Client c's conversation: an optional
// system prompt shared by every client, then per round r the round's new tokens followed by its
// output tokens. Round r's prompt is everything before round r's output; after the round the
// engine holds KV for the prompt and every output token but the last (the last sampled token has
// not been fed back yet), which is what it backs up. A client is a chain of its rounds: all
// clients start with round 0, and a client joins the back of the queue again when its round
// finishes. So a client's round r+1 never starts before its round r has been backed up, and the
// best case (an unbounded cache) hits every full page of the previous round's KV.
//
// A traffic shape of core/eviction_shapes.h (WorkloadSpec::shape): the trace the offline
// simulator replays, request by request in the trace's order (each request its own chain). A
// trace names pages; page id p is page_size tokens of its own (so a page has the same key
// wherever it appears), and a request's tokens past its full pages are its own. The engine backs
// up the request's full pages, as the simulator inserts its misses, and the best case is the
// longest prefix of pages an earlier request backed up.
//
// Token ids are a pure function of the seed and the request: seeded, synthetic, distinct per
// client, page or request.
//
// Threading: immutable after construction; any thread may call it.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/eviction_shapes.h"

namespace kvcellar::bench {

struct WorkloadSpec {
  uint32_t clients = 80;
  uint32_t rounds = 10;
  uint32_t new_tokens = 2048;  // Per round.
  uint32_t output_tokens = 1;  // Per round, >= 1.
  uint32_t system_prompt_tokens = 0;
  uint32_t page_size = 64;
  uint64_t seed = 1;
  // Empty: the multi-turn workload above. Otherwise the id of a shape of core/eviction_shapes.h
  // (its page size then fixes page_size), generated at shape_scale.
  std::string shape;
  double shape_scale = 1;
};

class Workload {
 public:
  // InvalidArgument naming --shape when spec.shape is no shape's id.
  static absl::StatusOr<Workload> Create(const WorkloadSpec& spec);
  const WorkloadSpec& spec() const { return spec_; }
  // The shape when the workload is one; nullptr for the multi-turn conversations.
  const core::EvictionShape* shape() const { return shape_.get(); }
  // The page size the workload needs (a shape's), 0 when any will do.
  uint32_t FixedPageSize() const;
  // The same workload at another page size (the multi-turn conversations; a shape keeps its own).
  Workload WithPageSize(uint32_t page_size) const;

  uint64_t requests() const;
  // Every request once, in chains.
  std::vector<std::vector<uint64_t>> Chains() const;
  // Tokens of the request's prompt.
  uint64_t PromptTokens(uint64_t request) const;
  // The tokens whose KV the engine holds after the request (the prompt first).
  std::vector<uint32_t> Tokens(uint64_t request) const;
  // Prompt tokens of the request that an unbounded cache serves, page-rounded.
  uint64_t BestCaseHitTokens(uint64_t request) const;

  uint64_t TotalPromptTokens() const;
  uint64_t TotalBestCaseHitTokens() const;
  // Largest number of full KV pages one request holds.
  uint64_t MaxPagesPerRequest() const;
  // Distinct full pages the whole workload backs up.
  uint64_t DistinctPages() const;

 private:
  explicit Workload(const WorkloadSpec& spec) : spec_(spec) {}
  // Multi-turn (request = client * rounds + round): round `round`'s prompt tokens, and the
  // tokens whose KV the engine holds after it.
  uint64_t RoundPromptTokens(uint32_t round) const;
  uint64_t ComputedTokens(uint32_t round) const;

  WorkloadSpec spec_;
  std::shared_ptr<const core::EvictionShape> shape_;
  // A shape's best case per request (computed once).
  std::shared_ptr<const std::vector<uint64_t>> best_case_;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_
