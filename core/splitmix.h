// SplitMix64's output function: a bijection of 64-bit integers whose consecutive inputs give
// statistically independent outputs. Deterministic patterns from it (sim engine bytes, benchmark
// tokens and keys) never repeat between neighbouring bytes, layers or keys, and every process
// that knows the seed derives the same bytes, so a reader can verify what a writer wrote.
#ifndef KVCELLAR_CORE_SPLITMIX_H_
#define KVCELLAR_CORE_SPLITMIX_H_

#include <cstdint>

namespace kvcellar::core {

constexpr uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_SPLITMIX_H_
