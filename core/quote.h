// Quote: how an error message or log line shows a value it was given (a client's string, a
// config value).
//
// Error messages travel back in gRPC's status message, which is metadata: a message over gRPC's
// metadata limit (8 KiB by default) turns the whole call into RESOURCE_EXHAUSTED, and the
// connection's other calls can fail with it. So a value is never echoed whole: at most
// kMaxQuotedBytes of it, C-escaped (control bytes, quotes and non-ASCII bytes become escapes,
// so the result is printable ASCII whatever the input), then "..." and the value's length.
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_CORE_QUOTE_H_
#define KVCELLAR_CORE_QUOTE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace kvcellar::core {

// Bytes of a value shown before it is cut: enough to recognise any legitimate name or dtype
// (ids are at most 256 bytes, but their first 64 tell them apart in practice).
inline constexpr size_t kMaxQuotedBytes = 64;

// fp16 becomes "fp16" (with the quotes); an 8000-byte value becomes its first 64 bytes in quotes,
// then `... (8000 bytes)`. The result is at most 4 * kMaxQuotedBytes + 32 characters.
std::string Quote(absl::string_view value);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_QUOTE_H_
