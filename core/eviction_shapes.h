// The traffic shapes eviction policies are judged on, as traces for core/eviction_sim.h, each with
// the L2 size (in pages) it is replayed at. Deterministic for a seed. kvcellar_bench_eviction
// replays them offline beside Belady's bound; kvcellar-bench --shape replays one through a real
// daemon.
//
//   multi_turn      kvcellar-bench's workload (SGLang HiCache's multi-turn benchmark): C clients
//                   x R rounds, each round's prompt the conversation so far plus 2048 new tokens
//                   (and 1 output token), 128-token pages, clients in turn with a round barrier:
//                   every conversation comes back once per round, a cycle.
//   zipf_prompts    shared system prompts of 16 pages, chosen by Zipf popularity (s = 1), each
//                   request with a unique 4-page user part.
//   chat_and_scans  multi-turn chat with one-shot long documents (64 pages, never asked again)
//                   between its requests: a scan.
//   two_tenants     a chat tenant with high reuse beside a tenant reading long documents chosen
//                   uniformly from a large set (low reuse), their requests alternating.
#ifndef KVCELLAR_CORE_EVICTION_SHAPES_H_
#define KVCELLAR_CORE_EVICTION_SHAPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/eviction_sim.h"

namespace kvcellar::core {

struct EvictionShape {
  std::string id;  // What kvcellar-bench --shape names it: multi_turn, multi_turn_2, ...
  std::string name;
  std::string l2;  // How the L2 size was chosen ("history / 1.56").
  Trace trace;
  uint64_t capacity_pages = 0;
};

// Every shape; `scale` < 1 shrinks clients, requests and documents (smoke runs).
std::vector<EvictionShape> EvictionShapes(double scale, uint64_t seed);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_EVICTION_SHAPES_H_
