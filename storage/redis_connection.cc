#include "storage/redis_connection.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "platform/sigpipe_guard.h"

namespace kvcellar::storage {
namespace {

// One read() from the socket; replies larger than this accumulate in hiredis' reader buffer.
constexpr size_t kReadChunk = 256 * 1024;
// sendmsg takes at most IOV_MAX (1024 on Linux) segments per call.
constexpr size_t kMaxIov = 1024;
// Status and error text kept from a reply.
constexpr size_t kMaxReplyText = 512;

RedisReplyType ReplyType(int hiredis_type) {
  switch (hiredis_type) {
    case REDIS_REPLY_STRING: return RedisReplyType::kString;
    case REDIS_REPLY_ARRAY: return RedisReplyType::kArray;
    case REDIS_REPLY_INTEGER: return RedisReplyType::kInteger;
    case REDIS_REPLY_NIL: return RedisReplyType::kNil;
    case REDIS_REPLY_STATUS: return RedisReplyType::kStatus;
    case REDIS_REPLY_ERROR: return RedisReplyType::kError;
    default: return RedisReplyType::kOther;
  }
}

// Reply functions for hiredis' reader: they fill the connection's RedisReply instead of building
// redisReply objects.
void* SinkString(const redisReadTask* task, char* str, size_t len) {
  auto* sink = static_cast<RedisReply*>(task->privdata);
  if (task->parent != nullptr) return sink;  // Inside an array: no data command replies so.
  sink->type = ReplyType(task->type);
  if (task->type == REDIS_REPLY_STRING && sink->dst != nullptr) {
    // A version 1 object's payload starts after its shorter header (storage/object_format.h).
    const size_t header_bytes =
        DeclaredHeaderBytes(reinterpret_cast<const uint8_t*>(str), len);
    sink->header_len = std::min(len, header_bytes);
    std::memcpy(sink->header, str, sink->header_len);
    if (len > header_bytes) {
      sink->payload_len = len - header_bytes;
      if (sink->payload_len <= sink->capacity) {
        std::memcpy(sink->dst, str + header_bytes, sink->payload_len);
      } else {
        sink->oversize = true;
      }
    }
  } else {
    sink->text.assign(str, std::min<size_t>(len, kMaxReplyText));
  }
  return sink;
}
void* SinkArray(const redisReadTask* task, int) {
  auto* sink = static_cast<RedisReply*>(task->privdata);
  if (task->parent == nullptr) sink->type = RedisReplyType::kArray;
  return sink;
}
void* SinkInteger(const redisReadTask* task, long long v) {
  auto* sink = static_cast<RedisReply*>(task->privdata);
  if (task->parent == nullptr) {
    sink->type = RedisReplyType::kInteger;
    sink->integer = v;
  }
  return sink;
}
void* SinkNil(const redisReadTask* task) {
  auto* sink = static_cast<RedisReply*>(task->privdata);
  if (task->parent == nullptr) sink->type = RedisReplyType::kNil;
  return sink;
}
void SinkFree(void*) {}

// hiredis takes a non-const pointer but never writes through it.
const redisReplyObjectFunctions kSinkFunctions = {SinkString, SinkArray, SinkInteger, SinkNil,
                                                  SinkFree};

}  // namespace

void RedisReply::Reset(uint8_t* d, uint64_t cap) {
  type = RedisReplyType::kNone;
  integer = 0;
  text.clear();
  dst = d;
  capacity = cap;
  header_len = 0;
  payload_len = 0;
  oversize = false;
}

RedisConnection::RedisConnection() : rbuf_(new char[kReadChunk]) {}
RedisConnection::~RedisConnection() { Close(); }

absl::Status RedisConnection::Connect(const RedisAddress& addr, absl::Duration timeout,
                                      const std::string& password) {
  Close();
  if (timeout < absl::Milliseconds(1)) timeout = absl::Milliseconds(1);
  const timeval tv = absl::ToTimeval(timeout);
  redisContext* c = addr.is_unix ? redisConnectUnixWithTimeout(addr.host.c_str(), tv)
                                 : redisConnectWithTimeout(addr.host.c_str(), addr.port, tv);
  if (c == nullptr) return absl::ResourceExhaustedError("redis context");
  if (c->err != 0) {
    absl::Status s = absl::UnavailableError(c->errstr);
    redisFree(c);
    return s;
  }
  if (!password.empty()) {
    redisSetTimeout(c, tv);
    platform::ScopedSigpipeBlock no_sigpipe;  // hiredis writes with write(2).
    auto* r = static_cast<redisReply*>(redisCommand(c, "AUTH %s", password.c_str()));
    const bool ok = r != nullptr && r->type != REDIS_REPLY_ERROR;
    if (r != nullptr) freeReplyObject(r);
    if (!ok) {
      redisFree(c);
      return absl::PermissionDeniedError("AUTH refused");
    }
  }
  // From here on the socket is ours: non-blocking, driven by poll() under the batch deadline.
  // hiredis' context only owns the descriptor; its reader is not used.
  const int flags = ::fcntl(c->fd, F_GETFL);
  ::fcntl(c->fd, F_SETFL, flags | O_NONBLOCK);
  reader_ = redisReaderCreateWithFunctions(const_cast<redisReplyObjectFunctions*>(&kSinkFunctions));
  if (reader_ == nullptr) {
    redisFree(c);
    return absl::ResourceExhaustedError("redis reader");
  }
  reader_->maxbuf = 0;  // Keep the buffer between replies: no reallocation per large value.
  reader_->privdata = &sink_;
  ctx_ = c;
  return absl::OkStatus();
}

void RedisConnection::Close() {
  if (reader_ != nullptr) redisReaderFree(reader_);
  reader_ = nullptr;
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

// ---- Building a pipeline ----------------------------------------------------------------------

// Appends RESP text in place (no temporary strings: the buffer's capacity is reused from one
// pipeline to the next), extending the previous text segment when contiguous.
template <typename... Parts>
void RedisConnection::Text(const Parts&... parts) {
  const size_t before = text_.size();
  absl::StrAppend(&text_, parts...);
  const size_t n = text_.size() - before;
  if (!segs_.empty() && !segs_.back().external) {
    segs_.back().len += n;
  } else {
    segs_.push_back({false, nullptr, before, n});
  }
}

void RedisConnection::Begin() {
  text_.clear();
  segs_.clear();
  expects_.clear();
}

void RedisConnection::AddSimple(RedisCommand cmd, absl::string_view name, absl::string_view key,
                                uint32_t item, uint8_t* dst, uint64_t capacity) {
  Text("*2\r\n$", name.size(), "\r\n", name, "\r\n$", key.size(), "\r\n", key, "\r\n");
  expects_.push_back({cmd, item, dst, capacity});
}

void RedisConnection::AddIndex(absl::string_view key, absl::string_view field,
                               absl::string_view value, uint32_t item) {
  if (value.empty()) {
    Text("*3\r\n$4\r\nHDEL\r\n$", key.size(), "\r\n", key, "\r\n$", field.size(), "\r\n", field,
         "\r\n");
    expects_.push_back({RedisCommand::kHdel, item, nullptr, 0});
    return;
  }
  Text("*4\r\n$4\r\nHSET\r\n$", key.size(), "\r\n", key, "\r\n$", field.size(), "\r\n", field,
       "\r\n$", value.size(), "\r\n", value, "\r\n");
  expects_.push_back({RedisCommand::kHset, item, nullptr, 0});
}

void RedisConnection::AddAsking() {
  Text("*1\r\n$6\r\nASKING\r\n");
  expects_.push_back({RedisCommand::kAsking, 0, nullptr, 0});
}

void RedisConnection::AddSet(absl::string_view key, const uint8_t* header, const uint8_t* payload,
                             uint64_t size, absl::string_view ttl_args, uint32_t item) {
  Text(ttl_args.empty() ? "*3" : "*5", "\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$",
       kObjectHeaderBytes + size, "\r\n");
  External(header, kObjectHeaderBytes);
  External(payload, size);
  Text("\r\n", ttl_args);
  expects_.push_back({RedisCommand::kSet, item, nullptr, 0});
}

// ---- Running it -------------------------------------------------------------------------------

size_t RedisConnection::Run(absl::Time deadline, absl::Status* status, OnReply on_reply) {
  *status = absl::OkStatus();
  BuildIov();
  size_t iov_next = 0;
  size_t got = 0;
  const size_t want = expects_.size();
  ArmSink(got);
  // Replies already buffered from an earlier pipeline would be a protocol violation.
  while (got < want) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      *status = absl::DeadlineExceededError("redis pipeline deadline");
      return got;
    }
    pollfd p{ctx_->fd, POLLIN, 0};
    if (iov_next < iov_.size()) p.events |= POLLOUT;
    const int ms = deadline == absl::InfiniteFuture()
                       ? -1
                       : static_cast<int>(absl::ToInt64Milliseconds(
                             absl::Ceil(left, absl::Milliseconds(1))));
    const int rc = ::poll(&p, 1, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      *status = absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
      return got;
    }
    if (rc == 0) continue;  // Loop re-checks the deadline.
    if (p.revents & POLLOUT) {
      msghdr m{};
      m.msg_iov = &iov_[iov_next];
      m.msg_iovlen = std::min(kMaxIov, iov_.size() - iov_next);
      const ssize_t n = ::sendmsg(ctx_->fd, &m, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        *status = absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
        return got;
      }
      if (n > 0) Advance(&iov_next, static_cast<size_t>(n));
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::read(ctx_->fd, rbuf_.get(), kReadChunk);
      if (n == 0) {
        *status = absl::UnavailableError("connection closed by server");
        return got;
      }
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        *status = absl::UnavailableError(absl::StrCat("read: ", std::strerror(errno)));
        return got;
      }
      if (redisReaderFeed(reader_, rbuf_.get(), static_cast<size_t>(n)) != REDIS_OK) {
        *status = absl::InternalError("redis reader feed");
        return got;
      }
      while (got < want) {
        void* reply = nullptr;
        if (redisReaderGetReply(reader_, &reply) != REDIS_OK) {
          *status = absl::DataLossError(absl::StrCat("redis protocol: ", reader_->errstr));
          return got;
        }
        if (reply == nullptr) break;  // Incomplete: wait for more bytes.
        on_reply(expects_[got], sink_);
        ++got;
        ArmSink(got);
      }
    }
  }
  return got;
}

void RedisConnection::BuildIov() {
  iov_.clear();
  for (const Seg& s : segs_) {
    void* base = s.external ? static_cast<void*>(const_cast<uint8_t*>(s.ptr))
                            : static_cast<void*>(text_.data() + s.off);
    iov_.push_back({base, s.len});
  }
}

// Consumes n sent bytes from the iovecs starting at *next.
void RedisConnection::Advance(size_t* next, size_t n) {
  while (n > 0 && *next < iov_.size()) {
    iovec& v = iov_[*next];
    if (n >= v.iov_len) {
      n -= v.iov_len;
      ++*next;
    } else {
      v.iov_base = static_cast<char*>(v.iov_base) + n;
      v.iov_len -= n;
      n = 0;
    }
  }
}

// Points the reply sink at what reply i expects: a GET's destination, or nothing.
void RedisConnection::ArmSink(size_t i) {
  if (i < expects_.size() && expects_[i].cmd == RedisCommand::kGet) {
    sink_.Reset(expects_[i].dst, expects_[i].capacity);
  } else {
    sink_.Reset(nullptr, 0);
  }
}

}  // namespace kvcellar::storage
