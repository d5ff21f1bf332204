#include "storage/redis_watch.h"

#include <hiredis/hiredis.h>
#include <poll.h>

#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "platform/log.h"
#include "platform/sigpipe_guard.h"
#include "storage/object_name.h"
#include "storage/redis_blocking.h"

namespace kvcellar::storage {
namespace {

constexpr size_t kMaxBatch = 1024;
constexpr char kExpired[] = "__keyevent@0__:expired";
constexpr char kEvicted[] = "__keyevent@0__:evicted";
// How long a node's thread waits for a message before it looks at stop_ again.
constexpr int kPollMs = 100;

// The notification classes the watch needs in `flags` (Redis's notify-keyspace-events): keyevent
// (E), expired (x), evicted (e); 'A' stands for every class but m and n.
std::string Missing(absl::string_view flags) {
  const bool all = absl::StrContains(flags, 'A');
  std::string missing;
  if (!absl::StrContains(flags, 'E')) missing += 'E';
  if (!all && !absl::StrContains(flags, 'x')) missing += 'x';
  if (!all && !absl::StrContains(flags, 'e')) missing += 'e';
  return missing;
}

}  // namespace

bool ParseRedisObjectKey(absl::string_view prefix, absl::string_view key, FileObjectId* out) {
  if (!absl::ConsumePrefix(&key, prefix)) return false;
  constexpr size_t kTag = 2 * kNamespaceTagBytes;
  constexpr size_t kKey = 2 * core::kPageKeyBytes;
  if (key.size() < kTag + 1 + kKey + 2 || key[kTag] != ':' || key[kTag + 1 + kKey] != ':') {
    return false;
  }
  // The namespace tag is a file tier's namespace directory name too.
  return ParseNamespaceDir(key.substr(0, kTag), &out->ns_prefix) &&
         ParseHex(key.substr(kTag + 1, kKey), out->key.bytes.data()) &&
         ParseDecimal(key.substr(kTag + 1 + kKey + 1), &out->shard);
}

struct RedisRemovalWatch::NodeWatch {
  std::string address;
  std::atomic<bool> stop{false};
  std::atomic<bool> subscribed{false};
  std::thread thread;
};

RedisRemovalWatch::RedisRemovalWatch(RedisWatchOptions options, Nodes nodes)
    : options_(std::move(options)), nodes_(std::move(nodes)) {
  supervisor_ = std::thread([this] { Supervise(); });
}

RedisRemovalWatch::~RedisRemovalWatch() {
  stop_.store(true, std::memory_order_relaxed);
  if (supervisor_.joinable()) supervisor_.join();
  absl::MutexLock lock(&mu_);
  for (auto& [address, w] : watches_) w->stop.store(true, std::memory_order_relaxed);
  for (auto& [address, w] : watches_) w->thread.join();
  watches_.clear();
}

void RedisRemovalWatch::SetSink(Sink sink) {
  absl::MutexLock lock(&sink_mu_);
  sink_ = std::move(sink);
}

void RedisRemovalWatch::Deliver(absl::Span<const FileObjectId> removed) {
  removed_.fetch_add(removed.size(), std::memory_order_relaxed);
  absl::MutexLock lock(&sink_mu_);
  if (sink_) sink_(removed);
}

RedisWatchStats RedisRemovalWatch::Stats() const {
  RedisWatchStats s;
  s.messages = messages_.load(std::memory_order_relaxed);
  s.removed = removed_.load(std::memory_order_relaxed);
  s.connects = connects_.load(std::memory_order_relaxed);
  s.configured = configured_.load(std::memory_order_relaxed);
  return s;
}

bool RedisRemovalWatch::subscribed() const {
  absl::MutexLock lock(&mu_);
  if (watches_.empty()) return false;
  for (const auto& [address, w] : watches_) {
    if (!w->subscribed.load(std::memory_order_relaxed)) return false;
  }
  return true;
}

void RedisRemovalWatch::Supervise() {
  absl::Time next = absl::InfinitePast();
  while (!stop_.load(std::memory_order_relaxed)) {
    if (absl::Now() >= next) {
      next = absl::Now() + options_.refresh;
      const std::vector<std::string> nodes = nodes_();
      const absl::flat_hash_set<std::string> wanted(nodes.begin(), nodes.end());
      std::vector<std::unique_ptr<NodeWatch>> gone;
      {
        absl::MutexLock lock(&mu_);
        for (auto it = watches_.begin(); it != watches_.end();) {
          if (wanted.contains(it->first)) {
            ++it;
            continue;
          }
          it->second->stop.store(true, std::memory_order_relaxed);
          gone.push_back(std::move(it->second));
          watches_.erase(it++);
        }
        for (const std::string& address : wanted) {
          if (watches_.contains(address)) continue;
          auto w = std::make_unique<NodeWatch>();
          w->address = address;
          NodeWatch* raw = w.get();
          w->thread = std::thread([this, raw] { Watch(raw); });
          watches_.emplace(address, std::move(w));
        }
      }
      for (auto& w : gone) w->thread.join();
    }
    absl::SleepFor(absl::Milliseconds(kPollMs));
  }
}

void RedisRemovalWatch::Watch(NodeWatch* node) {
  platform::ScopedSigpipeBlock no_sigpipe;  // hiredis writes with write(2).
  const auto stopping = [&] {
    return stop_.load(std::memory_order_relaxed) || node->stop.load(std::memory_order_relaxed);
  };
  const auto pause = [&] {
    for (absl::Time until = absl::Now() + options_.retry; absl::Now() < until && !stopping();) {
      absl::SleepFor(absl::Milliseconds(kPollMs));
    }
  };
  while (!stopping()) {
    node->subscribed.store(false, std::memory_order_relaxed);
    absl::StatusOr<RedisAddress> addr = ParseRedisAddress(node->address);
    if (!addr.ok()) return;
    absl::StatusOr<HiredisContext> conn =
        ConnectBlocking(*addr, options_.connect_timeout, options_.password);
    if (!conn.ok()) {
      pause();
      continue;
    }
    redisContext* c = conn->get();
    if (options_.configure) {
      HiredisReply got(
          static_cast<redisReply*>(redisCommand(c, "CONFIG GET notify-keyspace-events")));
      std::string flags;
      bool refused = got == nullptr || got->type != REDIS_REPLY_ARRAY || got->elements != 2 ||
                     got->element[1]->type != REDIS_REPLY_STRING;
      if (!refused) flags.assign(got->element[1]->str, got->element[1]->len);
      if (const std::string missing = Missing(flags); !refused && !missing.empty()) {
        const std::string value = flags + missing;
        HiredisReply set(static_cast<redisReply*>(
            redisCommand(c, "CONFIG SET notify-keyspace-events %s", value.c_str())));
        refused = set == nullptr || set->type == REDIS_REPLY_ERROR;
        if (!refused) {
          configured_.fetch_add(1, std::memory_order_relaxed);
          KVLOG(Info, "redis keyspace notifications enabled",
                {{"node", node->address}, {"notify_keyspace_events", value}});
        }
      }
      if (refused && !warned_config_.exchange(true)) {
        KVLOG(Warn,
              "redis refused CONFIG: set notify-keyspace-events to include Exe on the server, or "
              "objects it expires or evicts stay L3 hits until a prefetch misses them",
              {{"node", node->address}});
      }
    }
    if (c->err != 0) {
      pause();
      continue;
    }
    HiredisReply sub(
        static_cast<redisReply*>(redisCommand(c, "SUBSCRIBE %s %s", kExpired, kEvicted)));
    if (sub == nullptr) {
      pause();
      continue;
    }
    sub.reset();
    // The second subscription's confirmation.
    void* second = nullptr;
    if (redisGetReply(c, &second) != REDIS_OK) {
      pause();
      continue;
    }
    freeReplyObject(second);
    connects_.fetch_add(1, std::memory_order_relaxed);
    node->subscribed.store(true, std::memory_order_relaxed);
    std::vector<FileObjectId> batch;
    bool broken = false;
    while (!stopping() && !broken) {
      pollfd p{c->fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, kPollMs);
      if (ready < 0 && errno != EINTR) break;
      if (ready <= 0) continue;
      if (redisBufferRead(c) != REDIS_OK) break;
      for (;;) {
        void* raw = nullptr;
        if (redisGetReplyFromReader(c, &raw) != REDIS_OK) {
          broken = true;
          break;
        }
        if (raw == nullptr) break;
        HiredisReply r(static_cast<redisReply*>(raw));
        // ["message", channel, key]
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 3 ||
            r->element[2]->type != REDIS_REPLY_STRING) {
          continue;
        }
        messages_.fetch_add(1, std::memory_order_relaxed);
        FileObjectId id;
        if (ParseRedisObjectKey(options_.key_prefix,
                                absl::string_view(r->element[2]->str, r->element[2]->len), &id)) {
          batch.push_back(id);
          if (batch.size() >= kMaxBatch) {
            Deliver(batch);
            batch.clear();
          }
        }
      }
      if (!batch.empty()) {
        Deliver(batch);
        batch.clear();
      }
    }
    node->subscribed.store(false, std::memory_order_relaxed);
    if (!stopping()) pause();
  }
}

}  // namespace kvcellar::storage
