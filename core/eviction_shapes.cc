#include "core/eviction_shapes.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvcellar::core {
namespace {

// kvcellar-bench's multi-turn workload (client/tools/bench/workload.h): 128-token pages, 2048 new
// prompt tokens and 1 output token per round.
constexpr uint32_t kPage = 128;
constexpr uint64_t kNewTokens = 2048;
constexpr uint64_t kOutputTokens = 1;

// A page id: its sequence (a conversation, a document, a system prompt, a user part) and its
// position there. A page's parent is the page before it in its sequence, or the system prompt's
// last page for a user part.
uint64_t PageId(uint64_t sequence, uint64_t page) { return sequence << 24 | page; }

// Sequence numbers of each kind, far apart.
constexpr uint64_t kChats = 0;
constexpr uint64_t kTenantChats = 1 << 20;
constexpr uint64_t kDocs = 2 << 20;
constexpr uint64_t kPrompts = 3 << 20;
constexpr uint64_t kUserParts = 4 << 20;

// Round r's prompt of conversation `sequence`: the conversation so far and the new tokens.
TraceRequest ChatRequest(uint64_t sequence, uint32_t round) {
  TraceRequest request;
  request.tokens = (round + 1) * kNewTokens + round * kOutputTokens;
  for (uint64_t p = 0; p < request.tokens / kPage; ++p)
    request.pages.push_back(PageId(sequence, p));
  return request;
}

TraceRequest DocumentRequest(uint64_t sequence, uint32_t pages) {
  TraceRequest request;
  request.tokens = uint64_t{pages} * kPage + kPage / 2;
  for (uint32_t p = 0; p < pages; ++p) request.pages.push_back(PageId(sequence, p));
  return request;
}

uint64_t Scaled(uint64_t n, double scale) {
  return std::max<uint64_t>(2, static_cast<uint64_t>(std::llround(static_cast<double>(n) * scale)));
}

uint64_t HistoryPages(const Trace& trace) { return trace.DistinctPages(); }

EvictionShape MultiTurn(double scale, double divisor) {
  EvictionShape s;
  s.trace.page_size = kPage;
  const uint64_t clients = Scaled(80, scale);
  for (uint32_t round = 0; round < 10; ++round) {
    for (uint64_t c = 0; c < clients; ++c)
      s.trace.requests.push_back(ChatRequest(kChats + c, round));
  }
  s.capacity_pages = static_cast<uint64_t>(static_cast<double>(HistoryPages(s.trace)) / divisor);
  char name[64];
  std::snprintf(name, sizeof(name), "multi_turn (%llu clients x 10 rounds)",
                static_cast<unsigned long long>(clients));
  s.name = name;
  s.id = divisor == 1.56 ? "multi_turn" : "multi_turn_2";
  std::snprintf(name, sizeof(name), "history / %.2f", divisor);
  s.l2 = name;
  return s;
}

EvictionShape ZipfPrompts(double scale, std::mt19937_64& rng) {
  constexpr uint32_t kPromptPages = 16;
  constexpr uint32_t kUserPages = 4;
  const uint64_t prompts = Scaled(200, scale);
  const uint64_t requests = Scaled(6000, scale);
  std::vector<double> weights(prompts);
  for (uint64_t k = 0; k < prompts; ++k) weights[k] = 1.0 / static_cast<double>(k + 1);
  std::discrete_distribution<uint64_t> popular(weights.begin(), weights.end());
  EvictionShape s;
  s.trace.page_size = kPage;
  for (uint64_t i = 0; i < requests; ++i) {
    TraceRequest request;
    const uint64_t prompt = popular(rng);
    for (uint32_t p = 0; p < kPromptPages; ++p)
      request.pages.push_back(PageId(kPrompts + prompt, p));
    for (uint32_t p = 0; p < kUserPages; ++p) {
      request.pages.push_back(PageId(kUserParts + i, kPromptPages + p));
    }
    request.tokens = uint64_t{kPromptPages + kUserPages} * kPage + 50;
    s.trace.requests.push_back(std::move(request));
  }
  s.capacity_pages = prompts * kPromptPages / 3;
  s.name = s.id = "zipf_prompts";
  s.l2 = "system prompts / 3";
  return s;
}

EvictionShape ChatAndScans(double scale) {
  constexpr uint32_t kDocPages = 64;
  const uint64_t clients = Scaled(40, scale);
  EvictionShape s;
  s.trace.page_size = kPage;
  uint64_t docs = 0;
  uint64_t chat_pages = 0;
  for (uint32_t round = 0; round < 10; ++round) {
    for (uint64_t c = 0; c < clients; ++c) {
      s.trace.requests.push_back(ChatRequest(kChats + c, round));
      if (round == 9) chat_pages += s.trace.requests.back().pages.size();
      if (c % 2 == 1) s.trace.requests.push_back(DocumentRequest(kDocs + docs++, kDocPages));
    }
  }
  s.capacity_pages = static_cast<uint64_t>(static_cast<double>(chat_pages) / 1.56);
  s.name = s.id = "chat_and_scans";
  s.l2 = "chat history / 1.56";
  return s;
}

EvictionShape TwoTenants(double scale, std::mt19937_64& rng) {
  constexpr uint32_t kDocPages = 32;
  const uint64_t clients = Scaled(20, scale);
  const uint64_t docs = Scaled(400, scale);
  std::uniform_int_distribution<uint64_t> any_doc(0, docs - 1);
  EvictionShape s;
  s.trace.page_size = kPage;
  for (uint32_t round = 0; round < 10; ++round) {
    for (uint64_t c = 0; c < clients; ++c) {
      s.trace.requests.push_back(ChatRequest(kTenantChats + c, round));
      s.trace.requests.push_back(DocumentRequest(kDocs + any_doc(rng), kDocPages));
    }
  }
  s.capacity_pages = HistoryPages(s.trace) / 4;
  s.name = s.id = "two_tenants";
  s.l2 = "history / 4";
  return s;
}

}  // namespace

std::vector<EvictionShape> EvictionShapes(double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<EvictionShape> shapes;
  shapes.push_back(MultiTurn(scale, 1.56));
  shapes.push_back(MultiTurn(scale, 2.0));
  shapes.push_back(ZipfPrompts(scale, rng));
  shapes.push_back(ChatAndScans(scale));
  shapes.push_back(TwoTenants(scale, rng));
  return shapes;
}

}  // namespace kvcellar::core
