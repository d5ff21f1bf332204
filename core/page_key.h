// PageKey: the 32-byte identity of one page of KV cache (see docs/keys.md).
//
// Keys are SHA-256 chains over token pages rooted at the namespace digest, or opaque 32-byte
// values an engine supplies for a namespace marked opaque. Either way the daemon treats a key as
// 32 bytes compared for equality; nothing here depends on how it was derived.
#ifndef KVCELLAR_CORE_PAGE_KEY_H_
#define KVCELLAR_CORE_PAGE_KEY_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcellar::core {

inline constexpr size_t kPageKeyBytes = 32;  // SHA-256 digest size.

struct PageKey {
  std::array<uint8_t, kPageKeyBytes> bytes{};

  friend bool operator==(const PageKey& a, const PageKey& b) { return a.bytes == b.bytes; }
  friend bool operator!=(const PageKey& a, const PageKey& b) { return !(a == b); }
  friend bool operator<(const PageKey& a, const PageKey& b) { return a.bytes < b.bytes; }

  // The key is already a uniformly distributed digest, so its first 8 bytes are a good hash.
  template <typename H>
  friend H AbslHashValue(H h, const PageKey& k) {
    uint64_t v;
    std::memcpy(&v, k.bytes.data(), sizeof(v));
    return H::combine(std::move(h), v);
  }

  // Lowercase hex, 64 characters.
  std::string Hex() const;
  // Parses 64 hex characters (either case).
  static absl::StatusOr<PageKey> FromHex(absl::string_view hex);
  // Takes exactly 32 raw bytes, as they arrive in a protobuf `bytes` field.
  static absl::StatusOr<PageKey> FromBytes(absl::string_view raw);
  absl::string_view AsBytes() const {
    return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
  }
};

// Standard-library hasher for the rare std:: container; prefer absl containers.
struct PageKeyHash {
  size_t operator()(const PageKey& k) const {
    uint64_t v;
    std::memcpy(&v, k.bytes.data(), sizeof(v));
    return static_cast<size_t>(v);
  }
};

// ---- Key chain (docs/keys.md) ----------------------------------------------------------------
//
// k_i = SHA-256(tokens[iP, (i+1)P) as uint32 little-endian || k_{i-1}), k_{-1} = ns_digest.
// Only full pages are keyed; a trailing partial page has no key. The functions below never
// allocate (except the std::vector convenience) and are safe to call from any thread.

// Number of full pages in `num_tokens` tokens; 0 when page_size is 0.
inline size_t FullPages(size_t num_tokens, uint32_t page_size) {
  return page_size == 0 ? 0 : num_tokens / page_size;
}

// The key of one page: SHA-256(page_tokens as uint32 LE || parent). `page_tokens` is the whole
// page (page_size tokens); `parent` is the previous page's key, or ns_digest for page 0.
PageKey ChainPageKey(const PageKey& parent, absl::Span<const uint32_t> page_tokens);

// Writes the keys of the full pages of `tokens` to out[0..n) and returns n =
// min(FullPages(tokens.size(), page_size), out.size()); so a short `out` asks for a prefix.
//
// `parent` is ns_digest when tokens[0] is the first token of the sequence. To extend a chain the
// engine already has (it holds pages [0, i)), pass k_{i-1} and the tokens from i*page_size on:
// the result equals keys [i, ...) of the full chain. page_size 0 keys nothing.
size_t ComputePageKeys(const PageKey& parent, absl::Span<const uint32_t> tokens, uint32_t page_size,
                       absl::Span<PageKey> out);

// Convenience for tests and tools; allocates the result.
std::vector<PageKey> ComputePageKeys(const PageKey& parent, absl::Span<const uint32_t> tokens,
                                     uint32_t page_size);

// Opaque namespaces: the engine supplies its own 32-byte page keys, which are unique only within
// that engine's own scheme (two models hashed by the same engine code can produce the same
// value). The daemon therefore indexes SHA-256(ns_digest || 32 zero bytes || engine_key || 0x01),
// which puts opaque keys in the same global key space as chained keys without collisions: that
// message is 97 bytes long, and a chained page's message (4P + 32 bytes) never is. Its first
// block is the same for every key of a namespace, so a key costs one block.
PageKey ScopeOpaqueKey(const PageKey& ns_digest, const PageKey& engine_key);

// out[i] = ScopeOpaqueKey(ns_digest, engine_keys[i]) for every i (out.size() == engine_keys.size();
// out may be engine_keys): on CPUs with the SHA extensions four keys at a time
// (core/sha256_lanes.h), else one by one through OpenSSL.
void ScopeOpaqueKeys(const PageKey& ns_digest, absl::Span<const PageKey> engine_keys,
                     absl::Span<PageKey> out);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_PAGE_KEY_H_
