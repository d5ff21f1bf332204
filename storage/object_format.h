// The stored form of one L3 object: a fixed header naming the object, then the payload.
//
// Every backend stores the same header, so a reader can prove that the bytes it got are the
// object it asked for, whole: the header names the namespace digest, page key and shard (a
// foreign object, e.g. a hash-prefix collision in a shared directory or a key reused by another
// daemon version, is caught), the payload size (a torn or truncated object is caught) and the
// CRC-32C of the payload (bit rot, a partial overwrite). The header has its own CRC so a damaged
// size field is never trusted. Any mismatch is an ObjectDefect: the backend reports kChecksumError,
// removes the object and counts it (DESIGN.md "Failure semantics").
//
// Encoded header (kObjectHeaderBytes = 160, format version 2, little-endian):
//   0   magic "KVCELLAR"                 8 bytes
//   8   format version (2)               u16
//   10  encoded header size (160)        u16   lets a later version grow the header
//   12  flags                            u32   bit 0: parent key recorded; bit 1: first page
//   16  namespace digest                 32 bytes
//   48  page key                         32 bytes
//   80  shard                            u32
//   84  payload CRC-32C                  u32
//   88  payload size                     u64
//   96  created, Unix milliseconds       u64   informational (age, debugging)
//   104 parent page key                  32 bytes   zero unless flags bit 0
//   136 reserved, zero                   20 bytes
//   156 header CRC-32C of bytes [0,156)  u32
// The parent link says where the page sits in its chain (DESIGN.md "Restart and fleet"): the key
// of the previous page (bit 0), or "first page of its sequence" (bit 1), or neither (a writer
// that did not know it). A tier scanned at start puts pages back in the radix index with it,
// parents before children; a page with neither bit cannot be placed and is found only by the
// per-page lookups at Match time.
//
// Version 1 (written before the parent link existed) is still read: the same fields at the same
// offsets up to 104, then 20 reserved bytes and the header CRC at 124 (kObjectHeaderBytesV1 =
// 128); it decodes with ParentLink::kUnknown. Readers learn which from the version field and check
// the header size against it (DeclaredHeaderBytes), so a Redis value's payload starts at the
// right offset either way.
//
// Layout per backend:
//   file:  [header, zero-padded to kFileHeaderBlockBytes = 4 KiB][payload]. The padding keeps the
//          payload 4 KiB-aligned in the file, so one O_DIRECT readv fills a 4 KiB header buffer and
//          the host slot straight from the device, and a write is one writev from the slot. The
//          file's length is exactly 4 KiB + payload size (the same readv reads one more block into
//          a probe buffer, so a longer file is caught). (Header at the end would save the 4 KiB
//          - 1.6% of a 256 KiB object, 0.1% of 4 MiB - but a reader would have to learn the
//          payload size before it could find the header: a stat, or a second read.)
//   redis: [header (160 bytes; 128 for version 1)][payload] as one string value; no alignment to
//          keep.
//
// Threads: pure functions, any thread.
#ifndef KVCELLAR_STORAGE_OBJECT_FORMAT_H_
#define KVCELLAR_STORAGE_OBJECT_FORMAT_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "core/page_key.h"

namespace kvcellar::storage {

// The header this build writes (version 2), and the largest it reads.
inline constexpr size_t kObjectHeaderBytes = 160;
inline constexpr uint16_t kObjectFormatVersion = 2;
// Version 1's header, still read (no parent link).
inline constexpr size_t kObjectHeaderBytesV1 = 128;
inline constexpr uint16_t kObjectFormatVersionV1 = 1;
// The file backend's header block: one 4 KiB page, the O_DIRECT alignment of every device in use
// (and the host pool's slot alignment, core/host_pool.h kSlotAlignment).
inline constexpr size_t kFileHeaderBlockBytes = 4096;

// Where a page sits in its chain: what the header records of its parent.
struct ParentLink {
  enum class Kind : uint8_t {
    kUnknown = 0,  // Not recorded (a version 1 object, or a writer that did not know it).
    kFirst,        // The first page of its sequence: its parent is the namespace root.
    kKey,          // `key` is the previous page's key.
  };
  Kind kind = Kind::kUnknown;
  core::PageKey key;  // Meaningful for kKey only; zero otherwise.

  static ParentLink First() { return {Kind::kFirst, {}}; }
  static ParentLink Of(const core::PageKey& parent) { return {Kind::kKey, parent}; }
  bool operator==(const ParentLink&) const = default;
};

struct ObjectHeader {
  uint16_t version = kObjectFormatVersion;  // Decoded: the version the object was written in.
  core::PageKey ns;
  core::PageKey key;
  uint32_t shard = 0;
  uint32_t payload_crc = 0;
  uint64_t payload_bytes = 0;
  uint64_t created_unix_ms = 0;
  ParentLink parent;
};

// Why an object was refused. kNone: it is good.
enum class ObjectDefect : uint8_t {
  kNone = 0,
  kTruncated,         // Fewer bytes than the header (or the header's payload size) needs: torn.
  kBadMagic,          // Not a kvcellar object.
  kBadVersion,        // A format this build does not read.
  kBadHeaderCrc,      // Header bytes damaged.
  kForeignNamespace,  // Someone else's object under this name.
  kForeignKey,
  kForeignShard,
  kSizeMismatch,   // Payload larger than the reader's slot, or trailing bytes after it.
  kBadPayloadCrc,  // Payload bytes damaged.
  // A later format version than this build writes: another (newer) daemon's object, whole as
  // far as anyone here can tell. A miss, never removed (docs/versions.md).
  kNewerVersion,
};
inline constexpr size_t kObjectDefectCount = 11;
absl::string_view ObjectDefectName(ObjectDefect d);

// Writes the kObjectHeaderBytes encoding of `h` in the current version (with both CRCs:
// h.payload_crc must already be set; h.version is ignored).
void EncodeObjectHeader(const ObjectHeader& h, uint8_t* out);
// Writes a version 1 header (kObjectHeaderBytesV1 bytes; no parent link): what daemons before the
// parent link wrote. For tests and benchmarks of the upgrade path only.
void EncodeObjectHeaderV1(const ObjectHeader& h, uint8_t* out);

// Header for a payload: computes the payload CRC.
ObjectHeader MakeObjectHeader(const core::PageKey& ns, const core::PageKey& key, uint32_t shard,
                              const uint8_t* payload, uint64_t payload_bytes,
                              uint64_t created_unix_ms, const ParentLink& parent = {});

// Decodes a header of either version and checks its own integrity (length, magic, version, header
// size, header CRC). Identity and payload are not checked.
ObjectDefect DecodeObjectHeader(const uint8_t* in, size_t available, ObjectHeader* out);

// The encoded header size the bytes at `in` declare: kObjectHeaderBytesV1 for a version 1 header,
// kObjectHeaderBytes otherwise (also when too short or not a header: decoding then finds what is
// wrong). Where the payload starts in a Redis value.
size_t DeclaredHeaderBytes(const uint8_t* in, size_t available);

// What a reader expected to get.
struct ExpectedObject {
  const core::PageKey* ns = nullptr;
  const core::PageKey* key = nullptr;
  uint32_t shard = 0;
  uint64_t capacity = 0;  // Largest payload the reader's buffer holds.
};

// The full check of a read object: the header (`header_available` bytes at `header`), its identity
// against `expected`, and the payload. `payload_available` is how many bytes the reader found after
// the header: it must be exactly the header's payload size (fewer: kTruncated; more, i.e. bytes
// appended after the payload: kSizeMismatch), and the payload's CRC must match. A reader must
// therefore look past the payload (the file backend reads a probe block beyond its slot; Redis
// returns the whole value) and may report more than expected.capacity; only the first
// min(header's payload size, capacity) bytes at `payload` are read.
// On kNone, *out (when given) holds the header.
ObjectDefect VerifyObject(const uint8_t* header, size_t header_available,
                          const ExpectedObject& expected, const uint8_t* payload,
                          uint64_t payload_available, ObjectHeader* out = nullptr);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_OBJECT_FORMAT_H_
