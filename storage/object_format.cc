#include "storage/object_format.h"

#include <cstring>

#include "core/crc32c.h"
#include "storage/little_endian.h"

namespace kvcellar::storage {

using core::Crc32c;

namespace {

constexpr char kMagic[8] = {'K', 'V', 'C', 'E', 'L', 'L', 'A', 'R'};
constexpr size_t kOffVersion = 8;
constexpr size_t kOffHeaderSize = 10;
constexpr size_t kOffFlags = 12;
constexpr size_t kOffNs = 16;
constexpr size_t kOffKey = 48;
constexpr size_t kOffShard = 80;
constexpr size_t kOffPayloadCrc = 84;
constexpr size_t kOffPayloadBytes = 88;
constexpr size_t kOffCreated = 96;
constexpr size_t kOffParent = 104;
constexpr size_t kOffHeaderCrc = 156;
constexpr size_t kOffHeaderCrcV1 = 124;
static_assert(kOffHeaderCrc + 4 == kObjectHeaderBytes);
static_assert(kOffHeaderCrcV1 + 4 == kObjectHeaderBytesV1);
static_assert(kOffParent + core::kPageKeyBytes <= kOffHeaderCrc);
constexpr uint32_t kFlagParentKey = 1u << 0;
constexpr uint32_t kFlagFirstPage = 1u << 1;

}  // namespace

absl::string_view ObjectDefectName(ObjectDefect d) {
  switch (d) {
    case ObjectDefect::kNone: return "none";
    case ObjectDefect::kTruncated: return "truncated";
    case ObjectDefect::kBadMagic: return "bad_magic";
    case ObjectDefect::kBadVersion: return "bad_version";
    case ObjectDefect::kNewerVersion:
      return "newer_version";
    case ObjectDefect::kBadHeaderCrc: return "bad_header_crc";
    case ObjectDefect::kForeignNamespace: return "foreign_namespace";
    case ObjectDefect::kForeignKey: return "foreign_key";
    case ObjectDefect::kForeignShard: return "foreign_shard";
    case ObjectDefect::kSizeMismatch: return "size_mismatch";
    case ObjectDefect::kBadPayloadCrc: return "bad_payload_crc";
  }
  return "unknown";
}

// The fields both versions share, at the same offsets.
void EncodeCommon(const ObjectHeader& h, uint16_t version, size_t bytes, uint32_t flags,
                  uint8_t* out) {
  std::memset(out, 0, bytes);
  std::memcpy(out, kMagic, sizeof(kMagic));
  StoreLe<uint16_t>(out + kOffVersion, version);
  StoreLe<uint16_t>(out + kOffHeaderSize, static_cast<uint16_t>(bytes));
  StoreLe<uint32_t>(out + kOffFlags, flags);
  std::memcpy(out + kOffNs, h.ns.bytes.data(), core::kPageKeyBytes);
  std::memcpy(out + kOffKey, h.key.bytes.data(), core::kPageKeyBytes);
  StoreLe<uint32_t>(out + kOffShard, h.shard);
  StoreLe<uint32_t>(out + kOffPayloadCrc, h.payload_crc);
  StoreLe<uint64_t>(out + kOffPayloadBytes, h.payload_bytes);
  StoreLe<uint64_t>(out + kOffCreated, h.created_unix_ms);
}

void EncodeObjectHeader(const ObjectHeader& h, uint8_t* out) {
  uint32_t flags = 0;
  if (h.parent.kind == ParentLink::Kind::kKey) flags |= kFlagParentKey;
  if (h.parent.kind == ParentLink::Kind::kFirst) flags |= kFlagFirstPage;
  EncodeCommon(h, kObjectFormatVersion, kObjectHeaderBytes, flags, out);
  if (h.parent.kind == ParentLink::Kind::kKey) {
    std::memcpy(out + kOffParent, h.parent.key.bytes.data(), core::kPageKeyBytes);
  }
  StoreLe<uint32_t>(out + kOffHeaderCrc, Crc32c(out, kOffHeaderCrc));
}

void EncodeObjectHeaderV1(const ObjectHeader& h, uint8_t* out) {
  EncodeCommon(h, kObjectFormatVersionV1, kObjectHeaderBytesV1, 0, out);
  StoreLe<uint32_t>(out + kOffHeaderCrcV1, Crc32c(out, kOffHeaderCrcV1));
}

size_t DeclaredHeaderBytes(const uint8_t* in, size_t available) {
  if (available >= kOffHeaderSize + 2 && std::memcmp(in, kMagic, sizeof(kMagic)) == 0 &&
      LoadLe<uint16_t>(in + kOffVersion) == kObjectFormatVersionV1 &&
      LoadLe<uint16_t>(in + kOffHeaderSize) == kObjectHeaderBytesV1) {
    return kObjectHeaderBytesV1;
  }
  return kObjectHeaderBytes;
}

ObjectHeader MakeObjectHeader(const core::PageKey& ns, const core::PageKey& key, uint32_t shard,
                              const uint8_t* payload, uint64_t payload_bytes,
                              uint64_t created_unix_ms, const ParentLink& parent) {
  ObjectHeader h;
  h.parent = parent;
  h.ns = ns;
  h.key = key;
  h.shard = shard;
  h.payload_bytes = payload_bytes;
  h.payload_crc = Crc32c(payload, payload_bytes);
  h.created_unix_ms = created_unix_ms;
  return h;
}

ObjectDefect DecodeObjectHeader(const uint8_t* in, size_t available, ObjectHeader* out) {
  if (available < kObjectHeaderBytesV1) return ObjectDefect::kTruncated;
  if (std::memcmp(in, kMagic, sizeof(kMagic)) != 0) return ObjectDefect::kBadMagic;
  // Version before CRC: a newer format may lay out (and checksum) its header differently.
  const uint16_t version = LoadLe<uint16_t>(in + kOffVersion);
  if (version > kObjectFormatVersion) return ObjectDefect::kNewerVersion;
  if (version != kObjectFormatVersion && version != kObjectFormatVersionV1) {
    return ObjectDefect::kBadVersion;
  }
  const bool v1 = version == kObjectFormatVersionV1;
  const size_t bytes = v1 ? kObjectHeaderBytesV1 : kObjectHeaderBytes;
  if (available < bytes) return ObjectDefect::kTruncated;
  const size_t crc_at = v1 ? kOffHeaderCrcV1 : kOffHeaderCrc;
  if (LoadLe<uint32_t>(in + crc_at) != Crc32c(in, crc_at)) return ObjectDefect::kBadHeaderCrc;
  if (LoadLe<uint16_t>(in + kOffHeaderSize) != bytes) return ObjectDefect::kBadVersion;
  const uint32_t flags = v1 ? 0 : LoadLe<uint32_t>(in + kOffFlags);
  // Both links at once, or a bit this version does not know: not a header it wrote.
  if ((flags & ~(kFlagParentKey | kFlagFirstPage)) != 0 ||
      flags == (kFlagParentKey | kFlagFirstPage)) {
    return ObjectDefect::kBadVersion;
  }
  out->version = version;
  out->parent = ParentLink{};
  if ((flags & kFlagFirstPage) != 0) out->parent = ParentLink::First();
  if ((flags & kFlagParentKey) != 0) {
    out->parent.kind = ParentLink::Kind::kKey;
    std::memcpy(out->parent.key.bytes.data(), in + kOffParent, core::kPageKeyBytes);
  }
  std::memcpy(out->ns.bytes.data(), in + kOffNs, core::kPageKeyBytes);
  std::memcpy(out->key.bytes.data(), in + kOffKey, core::kPageKeyBytes);
  out->shard = LoadLe<uint32_t>(in + kOffShard);
  out->payload_crc = LoadLe<uint32_t>(in + kOffPayloadCrc);
  out->payload_bytes = LoadLe<uint64_t>(in + kOffPayloadBytes);
  out->created_unix_ms = LoadLe<uint64_t>(in + kOffCreated);
  return ObjectDefect::kNone;
}

ObjectDefect VerifyObject(const uint8_t* header, size_t header_available,
                          const ExpectedObject& expected, const uint8_t* payload,
                          uint64_t payload_available, ObjectHeader* out) {
  ObjectHeader h;
  ObjectDefect d = DecodeObjectHeader(header, header_available, &h);
  if (d != ObjectDefect::kNone) return d;
  if (h.ns != *expected.ns) return ObjectDefect::kForeignNamespace;
  if (h.key != *expected.key) return ObjectDefect::kForeignKey;
  if (h.shard != expected.shard) return ObjectDefect::kForeignShard;
  if (h.payload_bytes > expected.capacity) return ObjectDefect::kSizeMismatch;
  if (payload_available < h.payload_bytes) return ObjectDefect::kTruncated;
  if (payload_available > h.payload_bytes) return ObjectDefect::kSizeMismatch;
  if (Crc32c(payload, h.payload_bytes) != h.payload_crc) return ObjectDefect::kBadPayloadCrc;
  if (out != nullptr) *out = h;
  return ObjectDefect::kNone;
}

}  // namespace kvcellar::storage
