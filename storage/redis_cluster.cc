#include "storage/redis_cluster.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "platform/sigpipe_guard.h"
#include "storage/redis_blocking.h"

namespace kvcellar::storage {
namespace {}  // namespace

uint16_t Crc16(absl::string_view data) {
  uint16_t crc = 0;
  for (unsigned char c : data) {
    crc ^= static_cast<uint16_t>(c) << 8;
    for (int i = 0; i < 8; ++i) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

uint16_t KeyHashSlot(absl::string_view key) {
  // The first '{' and the first '}' after it; a tag is used only if non-empty.
  const size_t open = key.find('{');
  if (open != absl::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != absl::string_view::npos && close != open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return Crc16(key) & (kClusterSlots - 1);
}

std::string RedisAddress::ToString() const {
  if (is_unix) return absl::StrCat("unix:", host);
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<RedisAddress> ParseRedisAddress(absl::string_view text) {
  RedisAddress a;
  if (absl::ConsumePrefix(&text, "unix:")) {
    if (text.empty()) return absl::InvalidArgumentError("redis address: empty socket path");
    a.is_unix = true;
    a.host = std::string(text);
    return a;
  }
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis address: want host:port or unix:/path, got \"", text, "\""));
  }
  absl::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (!absl::SimpleAtoi(text.substr(colon + 1), &a.port) || a.port <= 0 || a.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("redis address: bad port in \"", text, "\""));
  }
  a.host = std::string(host);
  return a;
}

bool ParseRedirect(absl::string_view error, Redirect* out) {
  Redirect r;
  if (absl::ConsumePrefix(&error, "MOVED ")) {
    r.kind = Redirect::Kind::kMoved;
  } else if (absl::ConsumePrefix(&error, "ASK ")) {
    r.kind = Redirect::Kind::kAsk;
  } else {
    return false;
  }
  const size_t space = error.find(' ');
  if (space == absl::string_view::npos) return false;
  int slot;
  if (!absl::SimpleAtoi(error.substr(0, space), &slot) || slot < 0 || slot >= kClusterSlots) {
    return false;
  }
  r.slot = static_cast<uint16_t>(slot);
  r.address = std::string(absl::StripAsciiWhitespace(error.substr(space + 1)));
  if (r.address.empty()) return false;
  *out = std::move(r);
  return true;
}

absl::StatusOr<std::vector<SlotRange>> FetchClusterSlots(const RedisAddress& node,
                                                         absl::Duration timeout,
                                                         const std::string& password) {
  absl::StatusOr<HiredisContext> c = ConnectBlocking(node, timeout, password);
  if (!c.ok()) return c.status();
  platform::ScopedSigpipeBlock no_sigpipe;  // hiredis writes with write(2).
  HiredisReply reply(static_cast<redisReply*>(redisCommand(c->get(), "CLUSTER SLOTS")));
  if (reply == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("CLUSTER SLOTS on ", node.ToString(), ": ", (*c)->errstr));
  }
  if (reply->type == REDIS_REPLY_ERROR) {
    return absl::FailedPreconditionError(absl::StrCat("CLUSTER SLOTS on ", node.ToString(), ": ",
                                                      absl::string_view(reply->str, reply->len)));
  }
  if (reply->type != REDIS_REPLY_ARRAY) {
    return absl::DataLossError("CLUSTER SLOTS: not an array");
  }
  std::vector<SlotRange> out;
  for (size_t i = 0; i < reply->elements; ++i) {
    const redisReply* r = reply->element[i];
    // [first, last, [host, port, id, ...], replicas...]
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 3 ||
        r->element[0]->type != REDIS_REPLY_INTEGER || r->element[1]->type != REDIS_REPLY_INTEGER ||
        r->element[2]->type != REDIS_REPLY_ARRAY || r->element[2]->elements < 2) {
      return absl::DataLossError("CLUSTER SLOTS: malformed range");
    }
    const redisReply* primary = r->element[2];
    if (primary->element[0]->type != REDIS_REPLY_STRING ||
        primary->element[1]->type != REDIS_REPLY_INTEGER) {
      return absl::DataLossError("CLUSTER SLOTS: malformed node");
    }
    SlotRange range;
    const long long first = r->element[0]->integer, last = r->element[1]->integer;
    if (first < 0 || last >= kClusterSlots || first > last) {
      return absl::DataLossError("CLUSTER SLOTS: slot out of range");
    }
    range.first = static_cast<uint16_t>(first);
    range.last = static_cast<uint16_t>(last);
    RedisAddress a;
    a.host.assign(primary->element[0]->str, primary->element[0]->len);
    if (a.host.empty() || a.host == "?") a.host = node.host;
    a.port = static_cast<int>(primary->element[1]->integer);
    range.address = a.ToString();
    out.push_back(std::move(range));
  }
  return out;
}

SlotMap::SlotMap() {
  for (auto& s : slots_) s.store(kUnknown, std::memory_order_relaxed);
}

int SlotMap::NodeId(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < addresses_.size(); ++i) {
    if (addresses_[i] == address) return static_cast<int>(i);
  }
  addresses_.push_back(address);
  return static_cast<int>(addresses_.size() - 1);
}

std::string SlotMap::Address(int node) const {
  absl::MutexLock lock(&mu_);
  return node >= 0 && static_cast<size_t>(node) < addresses_.size() ? addresses_[node] : "";
}

size_t SlotMap::node_count() const {
  absl::MutexLock lock(&mu_);
  return addresses_.size();
}

void SlotMap::Replace(const std::vector<SlotRange>& ranges) {
  std::vector<int> next(kClusterSlots, kUnknown);
  for (const SlotRange& r : ranges) {
    const int id = NodeId(r.address);
    for (int s = r.first; s <= r.last; ++s) next[s] = id;
  }
  for (int s = 0; s < kClusterSlots; ++s) slots_[s].store(next[s], std::memory_order_release);
}

}  // namespace kvcellar::storage
