// PageKey parsing and the SHA-256 key chain (spec: docs/keys.md).
//
// Hashing uses OpenSSL's low-level SHA256_Init/Update/Final. They are deprecated in OpenSSL 3 in
// favour of EVP, but for the small messages hashed here (32 + 4*P bytes, two blocks at P = 16)
// they are the fastest OpenSSL interface: on the reference machine (SHA-NI) they key 2048 pages of
// 16 tokens 1.3-1.7x faster than EVP_DigestInit_ex/Update/Final with a reused context, and 3-5x
// faster than the one-shot SHA256(), which fetches an EVP_MD on every call. EVP's per-call
// dispatch and provider lookups dominate at this size. tests/bench/core/bench_keys.cc keeps all
// three side by side so the choice can be re-measured. The deprecation is silenced for this file
// only, through OpenSSL's own switch.
#define OPENSSL_SUPPRESS_DEPRECATED 1

#include "core/page_key.h"

#include <openssl/sha.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/sha256_lanes.h"

namespace kvcellar::core {
namespace {

static_assert(SHA256_DIGEST_LENGTH == kPageKeyBytes);
static_assert(sizeof(PageKey) == kPageKeyBytes, "PageKey must be exactly its 32 bytes");

constexpr char kHexDigits[] = "0123456789abcdef";

// The last byte of an opaque key's scoping message (docs/keys.md): it makes the message 97 bytes,
// a length no chained page's message (4P + 32) has.
constexpr uint8_t kOpaqueScopeTag = 0x01;

// The scoping message's first block: the namespace digest and 32 zero bytes.
std::array<uint8_t, 64> ScopeBlock(const PageKey& ns_digest) {
  std::array<uint8_t, 64> block{};
  std::memcpy(block.data(), ns_digest.bytes.data(), kPageKeyBytes);
  return block;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Feeds tokens to the hash as uint32 little-endian, whatever the host byte order.
void UpdateTokensLE(SHA256_CTX* ctx, absl::Span<const uint32_t> tokens) {
  if constexpr (std::endian::native == std::endian::little) {
    // The in-memory representation already is the wire format: hash it in place, no copy.
    SHA256_Update(ctx, tokens.data(), tokens.size() * sizeof(uint32_t));
  } else {
    // Big-endian hosts swap through a small stack buffer, so the hot path still never
    // allocates. 64 tokens = 256 bytes = four SHA-256 blocks per update.
    constexpr size_t kChunk = 64;
    uint8_t buf[kChunk * sizeof(uint32_t)];
    for (size_t pos = 0; pos < tokens.size(); pos += kChunk) {
      const size_t n = std::min(kChunk, tokens.size() - pos);
      for (size_t j = 0; j < n; ++j) {
        const uint32_t t = tokens[pos + j];
        buf[4 * j + 0] = static_cast<uint8_t>(t);
        buf[4 * j + 1] = static_cast<uint8_t>(t >> 8);
        buf[4 * j + 2] = static_cast<uint8_t>(t >> 16);
        buf[4 * j + 3] = static_cast<uint8_t>(t >> 24);
      }
      SHA256_Update(ctx, buf, n * sizeof(uint32_t));
    }
  }
}

}  // namespace

std::string PageKey::Hex() const {
  std::string out(2 * kPageKeyBytes, '0');
  for (size_t i = 0; i < kPageKeyBytes; ++i) {
    out[2 * i] = kHexDigits[bytes[i] >> 4];
    out[2 * i + 1] = kHexDigits[bytes[i] & 0xf];
  }
  return out;
}

absl::StatusOr<PageKey> PageKey::FromHex(absl::string_view hex) {
  if (hex.size() != 2 * kPageKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("page key hex must be ", 2 * kPageKeyBytes,
                                                   " hex characters, got ", hex.size()));
  }
  PageKey key;
  for (size_t i = 0; i < hex.size(); ++i) {
    const int v = HexValue(hex[i]);
    if (v < 0) {
      const unsigned char c = static_cast<unsigned char>(hex[i]);
      return absl::InvalidArgumentError(absl::StrCat(
          "page key hex has a non-hex character ",
          (c >= 0x20 && c < 0x7f) ? absl::StrCat("'", hex.substr(i, 1), "'")
                                  : absl::StrCat("byte 0x", absl::Hex(c, absl::kZeroPad2)),
          " at offset ", i));
    }
    key.bytes[i / 2] = static_cast<uint8_t>((key.bytes[i / 2] << 4) | v);
  }
  return key;
}

absl::StatusOr<PageKey> PageKey::FromBytes(absl::string_view raw) {
  if (raw.size() != kPageKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("page key must be exactly ", kPageKeyBytes, " bytes, got ", raw.size()));
  }
  PageKey key;
  std::memcpy(key.bytes.data(), raw.data(), kPageKeyBytes);
  return key;
}

PageKey ChainPageKey(const PageKey& parent, absl::Span<const uint32_t> page_tokens) {
  PageKey key;
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  UpdateTokensLE(&ctx, page_tokens);
  SHA256_Update(&ctx, parent.bytes.data(), kPageKeyBytes);
  SHA256_Final(key.bytes.data(), &ctx);
  return key;
}

size_t ComputePageKeys(const PageKey& parent, absl::Span<const uint32_t> tokens, uint32_t page_size,
                       absl::Span<PageKey> out) {
  const size_t n = std::min(FullPages(tokens.size(), page_size), out.size());
  if (n == 0) return 0;
  if (std::endian::native == std::endian::little && sha256::HaveShaExtensions()) {
    // The tokens' memory already is their wire form; PageKey is exactly its 32 bytes.
    sha256::ChainSuffixed(parent.bytes.data(), reinterpret_cast<const uint8_t*>(tokens.data()),
                          size_t{page_size} * sizeof(uint32_t), n,
                          reinterpret_cast<uint8_t*>(out.data()));
    return n;
  }
  const PageKey* prev = &parent;
  SHA256_CTX ctx;
  for (size_t i = 0; i < n; ++i) {
    // Each digest is written straight into out[i], which is then the next page's parent.
    SHA256_Init(&ctx);
    UpdateTokensLE(&ctx, tokens.subspan(i * page_size, page_size));
    SHA256_Update(&ctx, prev->bytes.data(), kPageKeyBytes);
    SHA256_Final(out[i].bytes.data(), &ctx);
    prev = &out[i];
  }
  return n;
}

std::vector<PageKey> ComputePageKeys(const PageKey& parent, absl::Span<const uint32_t> tokens,
                                     uint32_t page_size) {
  std::vector<PageKey> out(FullPages(tokens.size(), page_size));
  ComputePageKeys(parent, tokens, page_size, absl::MakeSpan(out));
  return out;
}

PageKey ScopeOpaqueKey(const PageKey& ns_digest, const PageKey& engine_key) {
  const std::array<uint8_t, 64> first = ScopeBlock(ns_digest);
  PageKey key;
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  SHA256_Update(&ctx, first.data(), first.size());
  SHA256_Update(&ctx, engine_key.bytes.data(), kPageKeyBytes);
  SHA256_Update(&ctx, &kOpaqueScopeTag, 1);
  SHA256_Final(key.bytes.data(), &ctx);
  return key;
}

void ScopeOpaqueKeys(const PageKey& ns_digest, absl::Span<const PageKey> engine_keys,
                     absl::Span<PageKey> out) {
  const size_t n = std::min(engine_keys.size(), out.size());
  if (n == 0) return;
  const std::array<uint8_t, 64> first = ScopeBlock(ns_digest);
  if (sha256::HaveShaExtensions()) {  // PageKey is exactly its 32 bytes (static_assert above).
    sha256::HashAfterBlock(first.data(), reinterpret_cast<const uint8_t*>(engine_keys.data()), n,
                           kOpaqueScopeTag, reinterpret_cast<uint8_t*>(out.data()));
    return;
  }
  // The first block once; each key continues a copy of that state.
  SHA256_CTX after_first;
  SHA256_Init(&after_first);
  SHA256_Update(&after_first, first.data(), first.size());
  for (size_t i = 0; i < n; ++i) {
    SHA256_CTX ctx = after_first;
    SHA256_Update(&ctx, engine_keys[i].bytes.data(), kPageKeyBytes);
    SHA256_Update(&ctx, &kOpaqueScopeTag, 1);
    SHA256_Final(out[i].bytes.data(), &ctx);
  }
}

}  // namespace kvcellar::core
