// PageKey: the 32-byte identity of one page of KV cache (see docs/keys.md).
//
// Keys are SHA-256 chains over token pages rooted at the namespace digest, or opaque 32-byte
// values an engine supplies for a namespace marked opaque. Either way the daemon treats a key as
// 32 bytes compared for equality; nothing here depends on how it was derived.
#ifndef KVCELLAR_CORE_PAGE_KEY_H_
#define KVCELLAR_CORE_PAGE_KEY_H_

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

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

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_PAGE_KEY_H_
