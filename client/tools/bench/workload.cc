#include "client/tools/bench/workload.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/splitmix.h"

namespace kvcellar::bench {
namespace {

// A vocabulary size of a typical tokenizer (Llama 3 has 128256); ids only need to vary.
constexpr uint32_t kVocab = 128000;

// Token streams of a shape, apart from the multi-turn streams (small numbers) and each other.
constexpr uint64_t kPageStreams = uint64_t{1} << 63;
constexpr uint64_t kTailStreams = uint64_t{1} << 62;

// Appends n tokens of stream `stream` (a distinct id per token run of the workload).
void AppendStream(uint64_t seed, uint64_t stream, uint64_t n, std::vector<uint32_t>* out) {
  const uint64_t base = core::SplitMix64(core::SplitMix64(seed) ^ core::SplitMix64(stream));
  for (uint64_t i = 0; i < n; ++i)
    out->push_back(static_cast<uint32_t>(core::SplitMix64(base + i) % kVocab));
}

}  // namespace

absl::StatusOr<Workload> Workload::Create(const WorkloadSpec& spec) {
  Workload w(spec);
  if (spec.shape.empty()) return w;
  std::vector<std::string> ids;
  for (core::EvictionShape& s : core::EvictionShapes(spec.shape_scale, spec.seed)) {
    ids.push_back(s.id);
    if (s.id != spec.shape) continue;
    w.spec_.page_size = s.trace.page_size;
    auto best = std::make_shared<std::vector<uint64_t>>();
    absl::flat_hash_set<uint64_t> seen;
    for (const core::TraceRequest& r : s.trace.requests) {
      size_t hit = 0;
      while (hit < r.pages.size() && seen.contains(r.pages[hit])) ++hit;
      best->push_back(hit * s.trace.page_size);
      seen.insert(r.pages.begin(), r.pages.end());
    }
    w.best_case_ = std::move(best);
    w.shape_ = std::make_shared<const core::EvictionShape>(std::move(s));
    return w;
  }
  return absl::InvalidArgumentError(absl::StrCat("--shape: unknown shape '", spec.shape, "' (want ",
                                                 absl::StrJoin(ids, ", "), ")"));
}

uint32_t Workload::FixedPageSize() const { return shape_ ? shape_->trace.page_size : 0; }

Workload Workload::WithPageSize(uint32_t page_size) const {
  Workload w = *this;
  if (shape_ == nullptr) w.spec_.page_size = page_size;
  return w;
}

uint64_t Workload::requests() const {
  return shape_ ? shape_->trace.requests.size() : uint64_t{spec_.clients} * spec_.rounds;
}

std::vector<std::vector<uint64_t>> Workload::Chains() const {
  std::vector<std::vector<uint64_t>> chains;
  if (shape_ != nullptr) {
    for (uint64_t i = 0; i < requests(); ++i) chains.push_back({i});
    return chains;
  }
  for (uint32_t c = 0; c < spec_.clients; ++c) {
    chains.emplace_back();
    for (uint32_t r = 0; r < spec_.rounds; ++r)
      chains.back().push_back(uint64_t{c} * spec_.rounds + r);
  }
  return chains;
}

uint64_t Workload::PromptTokens(uint64_t request) const {
  if (shape_ != nullptr) return shape_->trace.requests[request].tokens;
  return RoundPromptTokens(static_cast<uint32_t>(request % spec_.rounds));
}

uint64_t Workload::RoundPromptTokens(uint32_t round) const {
  return spec_.system_prompt_tokens + uint64_t{round} * (spec_.new_tokens + spec_.output_tokens) +
         spec_.new_tokens;
}

uint64_t Workload::ComputedTokens(uint32_t round) const {
  return RoundPromptTokens(round) + spec_.output_tokens - 1;
}

std::vector<uint32_t> Workload::Tokens(uint64_t request) const {
  std::vector<uint32_t> t;
  if (shape_ != nullptr) {
    const core::TraceRequest& r = shape_->trace.requests[request];
    t.reserve(r.tokens);
    for (uint64_t page : r.pages)
      AppendStream(spec_.seed, kPageStreams | page, spec_.page_size, &t);
    AppendStream(spec_.seed, kTailStreams | request, r.tokens - t.size(), &t);
    return t;
  }
  const uint64_t client = request / spec_.rounds;
  const uint32_t round = static_cast<uint32_t>(request % spec_.rounds);
  t.reserve(RoundPromptTokens(round) + spec_.output_tokens);
  AppendStream(spec_.seed, 0, spec_.system_prompt_tokens, &t);
  for (uint32_t r = 0; r <= round; ++r) {
    // Streams 1, 2, ...: (client, round, new or output), all distinct.
    const uint64_t stream = 1 + 2 * (client * spec_.rounds + r);
    AppendStream(spec_.seed, stream, spec_.new_tokens, &t);
    AppendStream(spec_.seed, stream + 1, spec_.output_tokens, &t);
  }
  t.resize(ComputedTokens(round));
  return t;
}

uint64_t Workload::BestCaseHitTokens(uint64_t request) const {
  if (shape_ != nullptr) return (*best_case_)[request];
  const uint64_t p = spec_.page_size;
  const uint64_t client = request / spec_.rounds;
  const uint32_t round = static_cast<uint32_t>(request % spec_.rounds);
  if (round > 0) return ComputedTokens(round - 1) / p * p;
  // Round 0 of the first client in the queue computes the shared system prompt.
  return client == 0 ? 0 : spec_.system_prompt_tokens / p * p;
}

uint64_t Workload::TotalPromptTokens() const {
  uint64_t sum = 0;
  for (uint64_t i = 0; i < requests(); ++i) sum += PromptTokens(i);
  return sum;
}

uint64_t Workload::TotalBestCaseHitTokens() const {
  uint64_t sum = 0;
  for (uint64_t i = 0; i < requests(); ++i) sum += BestCaseHitTokens(i);
  return sum;
}

uint64_t Workload::MaxPagesPerRequest() const {
  if (shape_ != nullptr) {
    size_t most = 0;
    for (const core::TraceRequest& r : shape_->trace.requests)
      most = std::max(most, r.pages.size());
    return most;
  }
  return spec_.rounds == 0 ? 0 : ComputedTokens(spec_.rounds - 1) / spec_.page_size;
}

uint64_t Workload::DistinctPages() const {
  if (shape_ != nullptr) return shape_->trace.DistinctPages();
  const uint64_t shared = spec_.system_prompt_tokens / spec_.page_size;
  return uint64_t{spec_.clients} * (MaxPagesPerRequest() - shared) + shared;
}

}  // namespace kvcellar::bench
