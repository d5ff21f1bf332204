// SHA-256 of many independent one-block messages at once, on the CPU's SHA extensions.
//
// Opaque page keys are scoped by their namespace: the daemon indexes SHA-256(ns_digest ||
// engine_key) (docs/keys.md), one 64-byte message per page, every page independent of the
// others. One SHA-256 at a time is latency-bound on SHA-NI (each sha256rnds2 waits for the last),
// so four messages are compressed in lockstep, each instruction of one message hiding the
// latency of the others'; the second block of every message is the same constant padding
// block, whose message schedule is computed once.
//
// Threads: pure functions.
#ifndef KVCELLAR_CORE_SHA256_LANES_H_
#define KVCELLAR_CORE_SHA256_LANES_H_

#include <cstddef>
#include <cstdint>

namespace kvcellar::core::sha256 {

// True when this CPU has the SHA extensions (and the SSSE3/SSE4.1 the code around them uses).
bool HaveShaExtensions();

// out + 32*i = SHA-256(prefix[0..32) || suffixes[32*i .. 32*i + 32)) for i < n. Only when
// HaveShaExtensions(). `out` may be `suffixes`.
void HashPrefixedPairs(const uint8_t* prefix, const uint8_t* suffixes, size_t n, uint8_t* out);

}  // namespace kvcellar::core::sha256

#endif  // KVCELLAR_CORE_SHA256_LANES_H_
