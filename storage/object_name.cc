#include "storage/object_name.h"

#include <cstdint>
#include <cstdio>

namespace kvcellar::storage {
namespace {

constexpr char kHexDigits[] = "0123456789abcdef";

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // Only lowercase: we write lowercase, anything else is not ours.
}

}  // namespace

char* AppendHex(const uint8_t* p, size_t n, char* out) {
  for (size_t i = 0; i < n; ++i) {
    *out++ = kHexDigits[p[i] >> 4];
    *out++ = kHexDigits[p[i] & 0xf];
  }
  return out;
}

char* AppendNamespaceTag(const core::PageKey& ns, char* out) {
  return AppendHex(ns.bytes.data(), kNamespaceTagBytes, out);
}

char* AppendDecimal(uint32_t v, char* out) {
  return out + std::snprintf(out, kMaxDecimalChars + 1, "%u", v);
}

bool ParseHex(absl::string_view s, uint8_t* out) {
  if (s.size() % 2 != 0) return false;
  for (size_t i = 0; i < s.size() / 2; ++i) {
    int hi = HexValue(s[2 * i]), lo = HexValue(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

bool ParseDecimal(absl::string_view s, uint32_t* out) {
  if (s.empty() || s.size() > kMaxDecimalChars) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

}  // namespace kvcellar::storage
