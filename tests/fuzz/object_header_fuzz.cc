// Fuzz target: an L3 object as a backend reads it back (storage/object_format.h): the header (160
// bytes, or 128 for format version 1), then whatever payload bytes the read found. The object's bytes are untrusted: a shared
// directory, another daemon's version, a torn write or bit rot.
//
// Input: a flags byte, then the object. The checksums would stop a mutator at the header CRC, so
// flag bits re-seal them: bit 0 the header CRC, bit 1 the payload CRC (then the header CRC again).
// The reader expects the identity the header names (bit 2 clear) or another one (set); bits 3-7
// choose the reader's capacity around the header's payload size. Checked: a good object is
// exactly what the reader asked for, and the hardware CRC path agrees with the software one.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/page_key.h"
#include "core/crc32c.h"
#include "storage/object_format.h"
#include "tests/fuzz/fuzz_util.h"

namespace core = kvcellar::core;
namespace storage = kvcellar::storage;
using storage::kObjectHeaderBytes;

namespace {

// Offsets of the encoding (object_format.h): the fields from the namespace digest to the creation
// time, [16, 104), are what a decode of either version reads (version 2 adds the parent link);
// the payload CRC and the header CRC (the header's last 4 bytes) are re-sealed.
constexpr size_t kOffFields = 16;
constexpr size_t kOffReserved = 104;
constexpr size_t kOffPayloadCrc = 84;

void Store32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return -1;
  const uint8_t flags = data[0];
  std::vector<uint8_t> object(data + 1, data + size);
  const size_t header_bytes = storage::DeclaredHeaderBytes(object.data(), object.size());
  const size_t header_crc_at = header_bytes - 4;
  const bool whole_header = object.size() >= header_bytes;
  const uint8_t* payload = whole_header ? object.data() + header_bytes : nullptr;
  const uint64_t payload_available = whole_header ? object.size() - header_bytes : 0;
  if (whole_header && (flags & 2)) {
    Store32(object.data() + kOffPayloadCrc, core::Crc32c(payload, payload_available));
  }
  if (whole_header && (flags & 3)) {
    Store32(object.data() + header_crc_at, core::Crc32c(object.data(), header_crc_at));
  }
  FUZZ_CHECK(core::Crc32c(object.data(), object.size()) ==
             core::Crc32cSoftware(object.data(), object.size()));

  storage::ObjectHeader decoded;
  const storage::ObjectDefect d =
      storage::DecodeObjectHeader(object.data(), object.size(), &decoded);
  if (d != storage::ObjectDefect::kNone) {
    FUZZ_CHECK(storage::ObjectDefectName(d) != "unknown");
    return 0;
  }
  // What decodes re-encodes to the same fields.
  uint8_t again[kObjectHeaderBytes];
  storage::EncodeObjectHeader(decoded, again);
  storage::ObjectHeader redecoded;
  FUZZ_CHECK(storage::DecodeObjectHeader(again, sizeof(again), &redecoded) ==
             storage::ObjectDefect::kNone);
  FUZZ_CHECK(std::memcmp(again + kOffFields, object.data() + kOffFields,
                         kOffReserved - kOffFields) == 0);
  FUZZ_CHECK(redecoded.parent == decoded.parent);

  kvcellar::core::PageKey other_key = decoded.key;
  other_key.bytes[0] ^= 1;
  storage::ExpectedObject expected;
  expected.ns = &decoded.ns;
  expected.key = (flags & 4) ? &other_key : &decoded.key;
  expected.shard = decoded.shard;
  const int64_t slack = static_cast<int64_t>(flags >> 3) - 16;
  expected.capacity = static_cast<uint64_t>(
      std::max<int64_t>(0, static_cast<int64_t>(std::min<uint64_t>(payload_available, 1 << 20)) +
                               slack));
  // The reader's slot, with what a read put there (never more than it holds).
  std::vector<uint8_t> slot(expected.capacity + 1);
  std::copy_n(payload, std::min<uint64_t>(payload_available, expected.capacity), slot.begin());
  storage::ObjectHeader verified;
  const storage::ObjectDefect v =
      storage::VerifyObject(object.data(), std::min(object.size(), header_bytes), expected,
                            slot.data(), payload_available, &verified);
  if (v != storage::ObjectDefect::kNone) return 0;
  FUZZ_CHECK(!(flags & 4));
  FUZZ_CHECK(verified.payload_bytes == payload_available);
  FUZZ_CHECK(verified.payload_bytes <= expected.capacity);
  FUZZ_CHECK(core::Crc32cSoftware(slot.data(), verified.payload_bytes) == verified.payload_crc);
  return 0;
}
