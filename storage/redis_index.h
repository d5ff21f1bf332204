// RedisIndex: the Redis tier's record of what it holds, which a restarted daemon reads back to put
// the pages in its index (server/l3/l3_recovery.h) without a lookup per page at Match time.
//
// A Redis value's header carries the page's parent link (object_format.h) like a file's, but
// reading every header back means a GET of every object (a whole tier of 64 KiB+ values over the
// network). So every SET is followed, in the same pipeline on the same connection, by
//   HSET <index key> <key (32 bytes) || shard (u32 LE)> <entry (kIndexEntryBytes)>
// and every UNLINK (Delete, a corrupt object removed) by HDEL of the same field. The entry holds
// what recovery needs: object format version, parent link, payload size, the full namespace
// digest. Index keys:
//   standalone  <key_prefix><ns>:idx                one hash per namespace
//   cluster     <key_prefix><ns>:idx:{<tag>}        one hash per namespace and slot
// where <tag> is a short string whose hash slot is the object key's slot (SlotTag), so the entry
// lives on the node and in the slot of its object: it goes in the same pipeline, follows the same
// MOVED/ASK, migrates with its object when a slot moves, and spreads over the cluster as the
// objects do (one hash per namespace would make one slot take every index write of the node set).
//
// The index is a hint, never a source of bytes: its entry can outlive its object (expired by TTL,
// evicted by maxmemory, a SET that failed after its HSET went through) and an object can lack an
// entry (written by a build without the index, its hash evicted). A page the readback puts in the
// daemon's index is read with the object's own header and payload CRC checked, so a stale entry
// is a miss at load time, never wrong bytes.
//
// Readback (ReadRedisIndex): on each node, SCAN for the index keys, then HSCAN each, in batches of
// kReadbackCount, until done or the deadline passes (what was read by then is delivered). Each
// batch's objects are checked with pipelined EXISTS: entries whose object is gone are removed
// (HDEL) and counted, so a restart prunes what TTL and eviction left behind; one that goes after
// the check is still a hint that the read verifies. Runs on
// the backend's readback thread (redis_backend.h), with its own blocking connection per node.
//
// Threads: the functions are pure or block the calling thread only.
#ifndef KVCELLAR_STORAGE_REDIS_INDEX_H_
#define KVCELLAR_STORAGE_REDIS_INDEX_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/page_key.h"
#include "storage/file_backend.h"
#include "storage/object_format.h"

namespace kvcellar::storage {

// Field: page key then shard (u32 little-endian).
inline constexpr size_t kIndexFieldBytes = 32 + 4;
// Entry: entry version (1), object format version (1), parent kind (1), parent key (32), payload
// bytes (u64 LE, 8), namespace digest (32).
inline constexpr size_t kIndexEntryBytes = 1 + 1 + 1 + 32 + 8 + 32;
inline constexpr uint8_t kIndexEntryVersion = 1;
// SCAN and HSCAN COUNT hint: a few hundred KiB per reply with 36 + 75 byte entries.
inline constexpr int kReadbackCount = 1000;

struct IndexEntry {
  core::PageKey ns;
  core::PageKey key;
  uint32_t shard = 0;
  uint16_t version = kObjectFormatVersion;
  ParentLink parent;
  uint64_t payload_bytes = 0;
};

void EncodeIndexField(const core::PageKey& key, uint32_t shard, char out[kIndexFieldBytes]);
void EncodeIndexEntry(const IndexEntry& e, char out[kIndexEntryBytes]);
// False when either is malformed (another writer's, a future entry version).
bool DecodeIndexEntry(absl::string_view field, absl::string_view entry, IndexEntry* out);

// A string of at most 4 characters [0-9a-z] whose Redis Cluster hash slot is `slot`.
absl::string_view SlotTag(uint16_t slot);

// The index key of namespace `ns`'s objects (of `slot`'s, in a cluster) into out; returns its
// length. Needs prefix.size() + kMaxIndexKeySuffix bytes.
inline constexpr size_t kMaxIndexKeySuffix = 16 + 5 + 7;
size_t FormatIndexKey(absl::string_view prefix, const core::PageKey& ns, bool cluster,
                      uint16_t slot, char* out);

struct RedisIndexReadback {
  std::vector<std::string> nodes;  // "host:port" or "unix:/path": every primary.
  std::string key_prefix;
  std::string password;
  absl::Duration connect_timeout = absl::Milliseconds(500);
  absl::Time deadline = absl::InfiniteFuture();
  const std::atomic<bool>* stop = nullptr;
};

// What the readback found, in the shape of a file tier's scan (Found::id, bytes and mtime_ns are
// zero but the key and shard; `dropped` counts malformed entries and stale ones, `entries` every
// entry read).
// `complete` is false when a node could not be read or the deadline or stop cut it short.
struct RedisIndexResult {
  FileScanResult scan;
  bool complete = true;
  uint64_t index_keys = 0;
  // Entries whose object was gone (expired, evicted): removed from the index, not delivered.
  uint64_t stale = 0;
};
RedisIndexResult ReadRedisIndex(const RedisIndexReadback& options);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_INDEX_H_
