// The multi-turn conversation workload of kvcellar-bench: the shape SGLang HiCache is
// benchmarked with (clients that each hold a conversation of several rounds; every round sends
// the whole history plus new tokens and gets output tokens back).
//
// Client c's conversation: an optional system prompt shared by every client, then per round r the
// round's new tokens followed by its output tokens. Round r's prompt is everything before round
// r's output; after the round the engine holds KV for the prompt and every output token but the
// last (the last sampled token has not been fed back yet), which is what it backs up. Token ids
// are a pure function of (seed, client, round, position): seeded, synthetic, distinct per client.
//
// Requests are served first come, first served: all clients start with round 0, and a client
// joins the back of the queue again when its round finishes. So a client's round r+1 never
// starts before its round r has been backed up, and the best case (an unbounded cache) hits every
// full page of the previous round's KV; `BestCaseHitTokens` is that number.
//
// Threading: immutable after construction; any thread may call it.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_

#include <cstdint>
#include <vector>

namespace kvcellar::bench {

struct WorkloadSpec {
  uint32_t clients = 80;
  uint32_t rounds = 10;
  uint32_t new_tokens = 2048;  // Per round.
  uint32_t output_tokens = 1;  // Per round, >= 1.
  uint32_t system_prompt_tokens = 0;
  uint32_t page_size = 64;
  uint64_t seed = 1;
};

class Workload {
 public:
  explicit Workload(const WorkloadSpec& spec) : spec_(spec) {}
  const WorkloadSpec& spec() const { return spec_; }

  // Tokens of round `round`'s prompt.
  uint64_t PromptTokens(uint32_t round) const;
  // Tokens whose KV the engine holds after round `round` (prompt + outputs but the last).
  uint64_t ComputedTokens(uint32_t round) const;
  // The first ComputedTokens(round) tokens of client `client`'s conversation.
  std::vector<uint32_t> Tokens(uint32_t client, uint32_t round) const;
  // Prompt tokens of (client, round) that an unbounded cache serves, page-rounded: the previous
  // round's full KV pages, or the system prompt's full pages once an earlier client computed it.
  uint64_t BestCaseHitTokens(uint32_t client, uint32_t round) const;

  uint64_t requests() const { return uint64_t{spec_.clients} * spec_.rounds; }
  uint64_t TotalPromptTokens() const;
  uint64_t TotalBestCaseHitTokens() const;
  // Largest number of full KV pages one request holds (the last round's).
  uint64_t MaxPagesPerRequest() const;
  // Distinct full pages the whole workload backs up (the system prompt's pages once).
  uint64_t DistinctPages() const;

 private:
  WorkloadSpec spec_;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_WORKLOAD_H_
