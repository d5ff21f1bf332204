#include "storage/redis_index.h"

#include <hiredis/hiredis.h>

#include <array>
#include <cstring>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "platform/sigpipe_guard.h"
#include "storage/little_endian.h"
#include "storage/object_name.h"
#include "storage/redis_blocking.h"
#include "storage/redis_cluster.h"

namespace kvcellar::storage {
namespace {

uint8_t* Bytes(char* p) { return reinterpret_cast<uint8_t*>(p); }
const uint8_t* Bytes(const char* p) { return reinterpret_cast<const uint8_t*>(p); }

// Shortest tags first, over [0-9a-z]: 36 + 36^2 + 36^3 + 36^4 candidates cover every slot (the
// first three lengths leave about 900 of 16384 slots uncovered; four leave none).
struct SlotTags {
  std::array<std::array<char, 5>, kClusterSlots> tag{};
  SlotTags() {
    static constexpr char kAlphabet[] = "0123456789abcdefghijklmnopqrstuvwxyz";
    size_t left = kClusterSlots;
    char s[5] = {};
    for (int len = 1; len <= 4 && left > 0; ++len) {
      uint64_t total = 1;
      for (int i = 0; i < len; ++i) total *= 36;
      for (uint64_t n = 0; n < total && left > 0; ++n) {
        uint64_t v = n;
        for (int i = 0; i < len; ++i, v /= 36) s[i] = kAlphabet[v % 36];
        const uint16_t slot = Crc16(absl::string_view(s, len)) % kClusterSlots;
        if (tag[slot][0] != 0) continue;
        std::memcpy(tag[slot].data(), s, len);
        --left;
      }
    }
  }
};

// SCAN MATCH pattern for the index keys under `prefix`: glob characters in it escaped.
std::string IndexKeyPattern(absl::string_view prefix) {
  std::string p;
  for (char c : prefix) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') p.push_back('\\');
    p.push_back(c);
  }
  p.append(2 * kNamespaceTagBytes, '?');
  p.append(":idx*");
  return p;
}

bool Stopped(const RedisIndexReadback& o) {
  return absl::Now() >= o.deadline ||
         (o.stop != nullptr && o.stop->load(std::memory_order_relaxed));
}

// [cursor, [items...]] of SCAN and HSCAN; false on anything else.
bool ParseCursorReply(const redisReply* r, std::string* cursor) {
  if (r == nullptr || r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
      r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_ARRAY) {
    return false;
  }
  cursor->assign(r->element[0]->str, r->element[0]->len);
  return true;
}

class Reader {
 public:
  Reader(const RedisIndexReadback& o, RedisIndexResult* out) : o_(o), out_(out) {}

  // Every index key of the node, then every entry of each; false when cut short.
  bool ReadNode(const std::string& node) {
    platform::ScopedSigpipeBlock no_sigpipe;  // hiredis writes with write(2).
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(node);
    if (!a.ok()) return false;
    absl::StatusOr<HiredisContext> ctx = ConnectBlocking(*a, o_.connect_timeout, o_.password);
    if (!ctx.ok()) return false;
    ctx_ = *std::move(ctx);
    std::vector<std::string> keys;
    const std::string pattern = IndexKeyPattern(o_.key_prefix);
    std::string cursor = "0";
    do {
      if (Stopped(o_)) return false;
      HiredisReply r(static_cast<redisReply*>(redisCommand(ctx_.get(), "SCAN %s MATCH %b COUNT %d",
                                                           cursor.c_str(), pattern.data(),
                                                           pattern.size(), kReadbackCount)));
      if (!ParseCursorReply(r.get(), &cursor)) return false;
      const redisReply* list = r->element[1];
      for (size_t i = 0; i < list->elements; ++i) {
        if (list->element[i]->type == REDIS_REPLY_STRING) {
          keys.emplace_back(list->element[i]->str, list->element[i]->len);
        }
      }
    } while (cursor != "0");
    for (const std::string& key : keys) {
      ++out_->index_keys;
      if (!ReadHash(key)) return false;
    }
    return true;
  }

 private:
  bool ReadHash(const std::string& key) {
    std::string cursor = "0";
    do {
      if (Stopped(o_)) return false;
      HiredisReply r(
          static_cast<redisReply*>(redisCommand(ctx_.get(), "HSCAN %b %s COUNT %d", key.data(),
                                                key.size(), cursor.c_str(), kReadbackCount)));
      if (!ParseCursorReply(r.get(), &cursor)) return false;
      const redisReply* list = r->element[1];
      std::vector<IndexEntry> page;
      std::vector<std::string> fields;
      for (size_t i = 0; i + 1 < list->elements; i += 2) {
        const redisReply* f = list->element[i];
        const redisReply* v = list->element[i + 1];
        ++out_->scan.entries;
        IndexEntry e;
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING ||
            !DecodeIndexEntry(absl::string_view(f->str, f->len), absl::string_view(v->str, v->len),
                              &e)) {
          ++out_->scan.dropped;  // Not ours to remove: another build's entry, say.
          continue;
        }
        page.push_back(e);
        fields.emplace_back(f->str, f->len);
      }
      if (!KeepPresent(key, page, fields)) return false;
    } while (cursor != "0");
    return true;
  }

  // Adds the entries whose object still exists and removes the others from the index (expired,
  // evicted): one pipelined EXISTS per entry, on this node, which owns the entry's slot and so its
  // object's. A hint removed by a race with a writer is a hint lost, never a wrong hit.
  bool KeepPresent(const std::string& key, const std::vector<IndexEntry>& page,
                   const std::vector<std::string>& fields) {
    char name[256];
    for (const IndexEntry& e : page) {
      const size_t n = ObjectKeyName(e, name);
      redisAppendCommand(ctx_.get(), "EXISTS %b", name, n);
    }
    std::vector<size_t> gone;
    for (size_t i = 0; i < page.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_.get(), &raw) != REDIS_OK) return false;
      HiredisReply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) {
        gone.push_back(i);
      } else {
        Add(page[i]);  // Present, or unknown (an error reply): kept as a hint.
      }
    }
    for (size_t i : gone) {
      redisAppendCommand(ctx_.get(), "HDEL %b %b", key.data(), key.size(), fields[i].data(),
                         fields[i].size());
    }
    for (size_t k = 0; k < gone.size(); ++k) {
      void* raw = nullptr;
      if (redisGetReply(ctx_.get(), &raw) != REDIS_OK) return false;
      freeReplyObject(raw);
    }
    out_->stale += gone.size();
    out_->scan.dropped += gone.size();
    return true;
  }

  // The object's Redis key, as RedisBackend names it: <prefix><ns>:<key>:<shard>.
  size_t ObjectKeyName(const IndexEntry& e, char* out) const {
    char* p = out;
    std::memcpy(p, o_.key_prefix.data(), o_.key_prefix.size());
    p += o_.key_prefix.size();
    p = AppendNamespaceTag(e.ns, p);
    *p++ = ':';
    p = AppendHex(e.key.bytes.data(), e.key.bytes.size(), p);
    *p++ = ':';
    p = AppendDecimal(e.shard, p);
    return static_cast<size_t>(p - out);
  }

  void Add(const IndexEntry& e) {
    FileScanResult& s = out_->scan;
    if (e.version > kObjectFormatVersion) {
      ++s.newer;  // A newer daemon's object: not one this build can read.
      return;
    }
    auto [it, inserted] = ns_slot_.try_emplace(e.ns, static_cast<uint32_t>(s.namespaces.size()));
    if (inserted) s.namespaces.push_back(e.ns);
    FileStartupScan::Found f{};
    f.id.key = e.key;
    f.id.shard = e.shard;
    f.ns = it->second;
    f.version = e.version;
    f.parent = e.parent;
    f.payload_bytes = e.payload_bytes;
    s.objects.push_back(f);
    ++s.found;
    if (e.parent.kind == ParentLink::Kind::kUnknown) ++s.legacy;
    s.payload_bytes += e.payload_bytes;
  }

  const RedisIndexReadback& o_;
  RedisIndexResult* const out_;
  HiredisContext ctx_;
  absl::flat_hash_map<core::PageKey, uint32_t> ns_slot_;
};

}  // namespace

void EncodeIndexField(const core::PageKey& key, uint32_t shard, char out[kIndexFieldBytes]) {
  std::memcpy(out, key.bytes.data(), 32);
  StoreLe<uint32_t>(Bytes(out + 32), shard);
}

void EncodeIndexEntry(const IndexEntry& e, char out[kIndexEntryBytes]) {
  out[0] = static_cast<char>(kIndexEntryVersion);
  out[1] = static_cast<char>(e.version);
  out[2] = static_cast<char>(e.parent.kind);
  std::memcpy(out + 3, e.parent.key.bytes.data(), 32);
  StoreLe<uint64_t>(Bytes(out + 35), e.payload_bytes);
  std::memcpy(out + 43, e.ns.bytes.data(), 32);
}

bool DecodeIndexEntry(absl::string_view field, absl::string_view entry, IndexEntry* out) {
  if (field.size() != kIndexFieldBytes || entry.size() != kIndexEntryBytes) return false;
  if (static_cast<uint8_t>(entry[0]) != kIndexEntryVersion) return false;
  const uint8_t kind = static_cast<uint8_t>(entry[2]);
  if (kind > static_cast<uint8_t>(ParentLink::Kind::kKey)) return false;
  std::memcpy(out->key.bytes.data(), field.data(), 32);
  out->shard = LoadLe<uint32_t>(Bytes(field.data() + 32));
  out->version = static_cast<uint8_t>(entry[1]);
  out->parent.kind = static_cast<ParentLink::Kind>(kind);
  std::memcpy(out->parent.key.bytes.data(), entry.data() + 3, 32);
  if (out->parent.kind != ParentLink::Kind::kKey) out->parent.key = core::PageKey{};
  out->payload_bytes = LoadLe<uint64_t>(Bytes(entry.data() + 35));
  std::memcpy(out->ns.bytes.data(), entry.data() + 43, 32);
  return true;
}

absl::string_view SlotTag(uint16_t slot) {
  static const SlotTags* const tags = new SlotTags();
  const std::array<char, 5>& t = tags->tag[slot % kClusterSlots];
  return absl::string_view(t.data(), std::strlen(t.data()));
}

size_t FormatIndexKey(absl::string_view prefix, const core::PageKey& ns, bool cluster,
                      uint16_t slot, char* out) {
  char* p = out;
  std::memcpy(p, prefix.data(), prefix.size());
  p += prefix.size();
  p = AppendNamespaceTag(ns, p);
  std::memcpy(p, ":idx", 4);
  p += 4;
  if (cluster) {
    const absl::string_view tag = SlotTag(slot);
    *p++ = ':';
    *p++ = '{';
    std::memcpy(p, tag.data(), tag.size());
    p += tag.size();
    *p++ = '}';
  }
  return static_cast<size_t>(p - out);
}

RedisIndexResult ReadRedisIndex(const RedisIndexReadback& options) {
  const absl::Time start = absl::Now();
  RedisIndexResult out;
  Reader reader(options, &out);
  for (const std::string& node : options.nodes) {
    if (!reader.ReadNode(node)) {
      out.complete = false;
      if (Stopped(options)) break;
    }
  }
  out.scan.elapsed = absl::Now() - start;
  return out;
}

}  // namespace kvcellar::storage
