// SHA-256 of many independent messages at once, on the CPU's SHA extensions.
//
// Opaque page keys are scoped by their namespace: the daemon indexes SHA-256(ns_digest || 32 zero
// bytes || engine_key || 0x01) (docs/keys.md), every page independent of the others and every
// message beginning with the same block. One SHA-256 at a time is latency-bound on SHA-NI (each
// sha256rnds2 waits for the last), so four messages are compressed in lockstep, each
// instruction of one message hiding the latency of the others'.
//
// The key chain (docs/keys.md) hashes each page's tokens before its parent key for the same
// reason: the token blocks of many pages are compressed in lockstep, and only the block holding
// the parent key is serial.
//
// Threads: pure functions.
#ifndef KVCELLAR_CORE_SHA256_LANES_H_
#define KVCELLAR_CORE_SHA256_LANES_H_

#include <cstddef>
#include <cstdint>

namespace kvcellar::core::sha256 {

// True when this CPU has the SHA extensions (and the SSSE3/SSE4.1 the code around them uses).
bool HaveShaExtensions();

// out + 32*i = SHA-256(first_block[0..64) || suffixes[32*i .. 32*i + 32) || tag) for i < n:
// 97-byte messages sharing their first block, which is compressed once; each message then costs
// one block. Only when HaveShaExtensions(). `out` may be `suffixes`.
void HashAfterBlock(const uint8_t* first_block, const uint8_t* suffixes, size_t n, uint8_t tag,
                    uint8_t* out);

// The key chain of docs/keys.md: for i < n, out + 32*i = SHA-256(pages[i*page_bytes ..
// (i+1)*page_bytes) || key_{i-1}), where key_{-1} = parent[0..32). The whole 64-byte blocks of a
// page that precede its parent key do not depend on it, so they are compressed four pages at a
// time; only each page's last block (two when its tail of tokens exceeds 23 bytes) waits for the
// previous key. Only when HaveShaExtensions(). `out` (n * 32 bytes) must not overlap `pages`;
// `parent` may be anywhere, including out - 32.
void ChainSuffixed(const uint8_t* parent, const uint8_t* pages, size_t page_bytes, size_t n,
                   uint8_t* out);

}  // namespace kvcellar::core::sha256

#endif  // KVCELLAR_CORE_SHA256_LANES_H_
