#include "client/tools/bench/workload.h"

#include "core/splitmix.h"

namespace kvcellar::bench {
namespace {

// A vocabulary size of a typical tokenizer (Llama 3 has 128256); ids only need to vary.
constexpr uint32_t kVocab = 128000;

// Appends n tokens of stream `stream` (a distinct id per token run of the workload).
void AppendStream(uint64_t seed, uint64_t stream, uint64_t n, std::vector<uint32_t>* out) {
  const uint64_t base = core::SplitMix64(core::SplitMix64(seed) ^ core::SplitMix64(stream));
  for (uint64_t i = 0; i < n; ++i)
    out->push_back(static_cast<uint32_t>(core::SplitMix64(base + i) % kVocab));
}

}  // namespace

uint64_t Workload::PromptTokens(uint32_t round) const {
  return spec_.system_prompt_tokens + uint64_t{round} * (spec_.new_tokens + spec_.output_tokens) +
         spec_.new_tokens;
}

uint64_t Workload::ComputedTokens(uint32_t round) const {
  return PromptTokens(round) + spec_.output_tokens - 1;
}

std::vector<uint32_t> Workload::Tokens(uint32_t client, uint32_t round) const {
  std::vector<uint32_t> t;
  t.reserve(PromptTokens(round) + spec_.output_tokens);
  AppendStream(spec_.seed, 0, spec_.system_prompt_tokens, &t);
  for (uint32_t r = 0; r <= round; ++r) {
    // Streams 1, 2, ...: (client, round, new or output), all distinct.
    const uint64_t stream = 1 + 2 * (uint64_t{client} * spec_.rounds + r);
    AppendStream(spec_.seed, stream, spec_.new_tokens, &t);
    AppendStream(spec_.seed, stream + 1, spec_.output_tokens, &t);
  }
  t.resize(ComputedTokens(round));
  return t;
}

uint64_t Workload::BestCaseHitTokens(uint32_t client, uint32_t round) const {
  const uint64_t p = spec_.page_size;
  if (round > 0) return ComputedTokens(round - 1) / p * p;
  // Round 0 of the first client in the queue computes the shared system prompt.
  return client == 0 ? 0 : spec_.system_prompt_tokens / p * p;
}

uint64_t Workload::TotalPromptTokens() const {
  uint64_t sum = 0;
  for (uint32_t r = 0; r < spec_.rounds; ++r) sum += PromptTokens(r);
  return sum * spec_.clients;
}

uint64_t Workload::TotalBestCaseHitTokens() const {
  uint64_t sum = 0;
  for (uint32_t c = 0; c < spec_.clients; ++c) {
    for (uint32_t r = 0; r < spec_.rounds; ++r) sum += BestCaseHitTokens(c, r);
  }
  return sum;
}

uint64_t Workload::MaxPagesPerRequest() const {
  return spec_.rounds == 0 ? 0 : ComputedTokens(spec_.rounds - 1) / spec_.page_size;
}

uint64_t Workload::DistinctPages() const {
  const uint64_t shared = spec_.system_prompt_tokens / spec_.page_size;
  return uint64_t{spec_.clients} * (MaxPagesPerRequest() - shared) + shared;
}

}  // namespace kvcellar::bench
