// Object names: how the backends spell an object's identity in text. A file path
// ("<ns16>/<kk>/<key64>.<shard>", storage/file_layout.h) and a Redis key
// ("<prefix><ns16>:<key64>:<shard>", storage/redis_backend.h) are made of the same parts: the
// namespace tag (the first kNamespaceTagBytes of the namespace digest in lowercase hex), the page
// key in lowercase hex, and the shard in decimal. The header inside every object carries the full
// namespace digest, so two namespaces whose tags collide are told apart on read.
//
// Names are written into caller buffers and parsed from views, without allocating: a batch names
// thousands of objects, and the hot paths allocate nothing per page.
//
// Threads: pure functions, any thread.
#ifndef KVCELLAR_STORAGE_OBJECT_NAME_H_
#define KVCELLAR_STORAGE_OBJECT_NAME_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "core/page_key.h"

namespace kvcellar::storage {

// Bytes of the namespace digest a name carries: 16 hex characters keep names short, and a
// collision is caught by the header (see above).
inline constexpr size_t kNamespaceTagBytes = 8;
// Characters AppendDecimal writes at most (UINT32_MAX), not counting the NUL.
inline constexpr size_t kMaxDecimalChars = 10;

// Writes 2n lowercase hex digits of p[0, n) at out; returns the end.
char* AppendHex(const uint8_t* p, size_t n, char* out);
// The namespace tag of `ns` (2 * kNamespaceTagBytes characters); returns the end.
char* AppendNamespaceTag(const core::PageKey& ns, char* out);
// `v` in decimal, NUL-terminated; returns the end (at the NUL). Needs kMaxDecimalChars + 1 bytes.
char* AppendDecimal(uint32_t v, char* out);

// Lowercase hex of even length into s.size() / 2 bytes at out. False on anything else (an
// uppercase digit too: the backends write lowercase, so such a name is not theirs).
bool ParseHex(absl::string_view s, uint8_t* out);
// A decimal uint32 without sign, spaces or more than kMaxDecimalChars digits.
bool ParseDecimal(absl::string_view s, uint32_t* out);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_OBJECT_NAME_H_
