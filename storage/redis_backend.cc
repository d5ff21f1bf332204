#include "storage/redis_backend.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "storage/object_format.h"
#include "storage/redis_cluster.h"

namespace kvcellar::storage {
namespace {

constexpr size_t kMaxPrefixBytes = 64;
// "<prefix><ns16>:<key64>:<shard>" fits with room to spare.
constexpr size_t kMaxKeyBytes = kMaxPrefixBytes + 16 + 1 + 64 + 1 + 10 + 1;
// One read() from the socket; replies larger than this accumulate in hiredis' reader buffer.
constexpr size_t kReadChunk = 256 * 1024;
// sendmsg takes at most IOV_MAX (1024 on Linux) segments per call.
constexpr size_t kMaxIov = 1024;

constexpr char kHexDigits[] = "0123456789abcdef";

enum class Cmd : uint8_t { kGet, kSet, kExists, kUnlink, kAsking };

// ---- Replies ----------------------------------------------------------------------------------

// Where hiredis' reader puts the reply being parsed. Reply functions fill it instead of building
// redisReply objects; a GET's value is split on arrival: the header into `header`, the payload
// straight into the destination slot.
struct ReplySink {
  int type = 0;
  long long integer = 0;
  std::string text;  // Status or error text.
  uint8_t* dst = nullptr;
  uint64_t capacity = 0;
  uint8_t header[kObjectHeaderBytes];
  size_t header_len = 0;
  uint64_t payload_len = 0;
  bool oversize = false;

  void Reset(uint8_t* d, uint64_t cap) {
    type = 0;
    integer = 0;
    text.clear();
    dst = d;
    capacity = cap;
    header_len = 0;
    payload_len = 0;
    oversize = false;
  }
};

void* SinkString(const redisReadTask* task, char* str, size_t len) {
  auto* sink = static_cast<ReplySink*>(task->privdata);
  if (task->parent != nullptr) return sink;  // Inside an array: no data command replies so.
  sink->type = task->type;
  if (task->type == REDIS_REPLY_STRING && sink->dst != nullptr) {
    sink->header_len = std::min(len, kObjectHeaderBytes);
    std::memcpy(sink->header, str, sink->header_len);
    if (len > kObjectHeaderBytes) {
      sink->payload_len = len - kObjectHeaderBytes;
      if (sink->payload_len <= sink->capacity) {
        std::memcpy(sink->dst, str + kObjectHeaderBytes, sink->payload_len);
      } else {
        sink->oversize = true;
      }
    }
  } else {
    sink->text.assign(str, std::min<size_t>(len, 512));
  }
  return sink;
}
void* SinkArray(const redisReadTask* task, int) {
  auto* sink = static_cast<ReplySink*>(task->privdata);
  if (task->parent == nullptr) sink->type = REDIS_REPLY_ARRAY;
  return sink;
}
void* SinkInteger(const redisReadTask* task, long long v) {
  auto* sink = static_cast<ReplySink*>(task->privdata);
  if (task->parent == nullptr) {
    sink->type = REDIS_REPLY_INTEGER;
    sink->integer = v;
  }
  return sink;
}
void* SinkNil(const redisReadTask* task) {
  auto* sink = static_cast<ReplySink*>(task->privdata);
  if (task->parent == nullptr) sink->type = REDIS_REPLY_NIL;
  return sink;
}
void SinkFree(void*) {}

// hiredis takes a non-const pointer but never writes through it.
const redisReplyObjectFunctions kSinkFunctions = {SinkString, SinkArray, SinkInteger, SinkNil,
                                                  SinkFree};

// What an error reply means for the object.
ObjectStatus StatusFromError(absl::string_view e) {
  if (absl::StartsWith(e, "OOM")) return ObjectStatus::kRejected;
  if (absl::StartsWith(e, "TRYAGAIN") || absl::StartsWith(e, "CLUSTERDOWN") ||
      absl::StartsWith(e, "LOADING") || absl::StartsWith(e, "BUSY") ||
      absl::StartsWith(e, "MASTERDOWN") || absl::StartsWith(e, "READONLY")) {
    return ObjectStatus::kRetry;
  }
  return ObjectStatus::kDeviceError;
}

// ---- Connection -------------------------------------------------------------------------------

// One socket to one node, with a pipeline under construction. Owned by one worker thread.
class Connection {
 public:
  struct Expect {
    Cmd cmd;
    uint32_t item;
    uint8_t* dst;
    uint64_t capacity;
  };

  Connection() : rbuf_(new char[kReadChunk]) {}
  ~Connection() { Close(); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  bool connected() const { return ctx_ != nullptr; }

  absl::Status Connect(const RedisAddress& addr, absl::Duration timeout,
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
    reader_ = redisReaderCreateWithFunctions(
        const_cast<redisReplyObjectFunctions*>(&kSinkFunctions));
    if (reader_ == nullptr) {
      redisFree(c);
      return absl::ResourceExhaustedError("redis reader");
    }
    reader_->maxbuf = 0;  // Keep the buffer between replies: no reallocation per large value.
    reader_->privdata = &sink_;
    ctx_ = c;
    return absl::OkStatus();
  }

  void Close() {
    if (reader_ != nullptr) redisReaderFree(reader_);
    reader_ = nullptr;
    if (ctx_ != nullptr) redisFree(ctx_);
    ctx_ = nullptr;
  }

  // ---- Building a pipeline ----
  void Begin() {
    text_.clear();
    segs_.clear();
    expects_.clear();
  }
  void AddSimple(Cmd cmd, absl::string_view name, absl::string_view key, uint32_t item,
                 uint8_t* dst = nullptr, uint64_t capacity = 0) {
    Text("*2\r\n$", name.size(), "\r\n", name, "\r\n$", key.size(), "\r\n", key, "\r\n");
    expects_.push_back({cmd, item, dst, capacity});
  }
  void AddAsking() {
    Text("*1\r\n$6\r\nASKING\r\n");
    expects_.push_back({Cmd::kAsking, 0, nullptr, 0});
  }
  // SET key <header><payload> [PX ttl_ms]; `ttl_args` is "" or the encoded "PX <ms>" arguments.
  void AddSet(absl::string_view key, const uint8_t* header, const uint8_t* payload, uint64_t size,
              absl::string_view ttl_args, uint32_t item) {
    Text(ttl_args.empty() ? "*3" : "*5", "\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$",
         kObjectHeaderBytes + size, "\r\n");
    External(header, kObjectHeaderBytes);
    External(payload, size);
    Text("\r\n", ttl_args);
    expects_.push_back({Cmd::kSet, item, nullptr, 0});
  }
  size_t pending() const { return expects_.size(); }
  const Expect& expect(size_t i) const { return expects_[i]; }

  // Sends the pipeline and reads its replies, calling on_reply(expect, sink) for each in order.
  // Returns how many replies arrived; *status says why it stopped early (the connection is then
  // unusable: the caller closes it).
  template <typename OnReply>
  size_t Run(absl::Time deadline, absl::Status* status, OnReply&& on_reply) {
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
                         : static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(
                               left, absl::Milliseconds(1))));
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

 private:
  struct Seg {
    bool external;
    const uint8_t* ptr;  // External bytes.
    size_t off;          // Or an offset into text_.
    size_t len;
  };

  // Appends RESP text in place (no temporary strings: the buffer's capacity is reused from one
  // pipeline to the next), extending the previous text segment when contiguous.
  template <typename... Parts>
  void Text(const Parts&... parts) {
    const size_t before = text_.size();
    absl::StrAppend(&text_, parts...);
    const size_t n = text_.size() - before;
    if (!segs_.empty() && !segs_.back().external) {
      segs_.back().len += n;
    } else {
      segs_.push_back({false, nullptr, before, n});
    }
  }
  void External(const uint8_t* p, size_t n) { segs_.push_back({true, p, 0, n}); }

  void BuildIov() {
    iov_.clear();
    for (const Seg& s : segs_) {
      void* base = s.external ? static_cast<void*>(const_cast<uint8_t*>(s.ptr))
                              : static_cast<void*>(text_.data() + s.off);
      iov_.push_back({base, s.len});
    }
  }
  void Advance(size_t* next, size_t n) {
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
  void ArmSink(size_t i) {
    if (i < expects_.size() && expects_[i].cmd == Cmd::kGet) {
      sink_.Reset(expects_[i].dst, expects_[i].capacity);
    } else {
      sink_.Reset(nullptr, 0);
    }
  }

  redisContext* ctx_ = nullptr;
  redisReader* reader_ = nullptr;
  ReplySink sink_;
  std::unique_ptr<char[]> rbuf_;
  std::string text_;
  std::vector<Seg> segs_;
  std::vector<iovec> iov_;
  std::vector<Expect> expects_;
};

}  // namespace

// ---- Impl -------------------------------------------------------------------------------------

class RedisBackend::Impl {
 public:
  explicit Impl(const RedisBackendOptions& options) : options_(options) {}
  ~Impl();

  absl::Status Init();
  absl::Status Exists(const ExistsRequest& request, ExistsCallback done);
  absl::Status Get(const GetRequest& request, BatchCallback done);
  absl::Status Put(const PutRequest& request, BatchCallback done);
  absl::Status Delete(const DeleteRequest& request, BatchCallback done);
  BackendStats Stats() const;
  size_t FormatKey(const PageKey& ns, const PageKey& key, uint32_t shard, char* out) const;

  const std::string& name() const { return name_; }
  const RedisBackendOptions& options() const { return options_; }

 private:
  // Exists per object. Unknown: transient (timeout, connection, no route) or an error reply.
  enum Presence : uint8_t { kPending = 0, kPresent, kAbsent, kUnknownTransient, kUnknownError };

  struct Item {
    PageKey key;
    uint32_t shard = 0;
    uint8_t* buf = nullptr;  // Get: destination; Put: source.
    uint64_t len = 0;        // Get: capacity; Put: size.
    uint16_t slot = 0;
    uint8_t redirects = 0;
    bool header_ready = false;
    uint8_t key_len = 0;
    char rkey[kMaxKeyBytes];
    uint8_t header[kObjectHeaderBytes];  // Put: encoded once, resent as is after a redirect.
  };

  struct Batch {
    OpKind kind = OpKind::kGet;
    PageKey ns;
    absl::Time deadline;
    std::vector<Item> items;
    std::vector<ItemResult> results;
    std::vector<uint8_t> presence;  // Exists: Presence per (key, shard).
    size_t nkeys = 0;
    size_t nshards = 0;
    std::atomic<size_t> remaining{0};  // Unresolved items, plus one while submitting.
    std::atomic<bool> deadline_exceeded{false};
    BatchCallback done;
    ExistsCallback exists_done;
  };

  // Items of one batch for one node, run as one pipeline on one connection.
  struct Chunk {
    Batch* batch = nullptr;
    std::vector<uint32_t> items;
    bool asking = false;
    Chunk* next = nullptr;
  };

  struct Node {
    RedisAddress address;
    std::string address_text;
    absl::Mutex mu;
    Chunk* head ABSL_GUARDED_BY(mu) = nullptr;
    Chunk* tail ABSL_GUARDED_BY(mu) = nullptr;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    // After a failed connect, no new attempt before this (absl::ToUnixNanos).
    std::atomic<int64_t> retry_after_ns{0};
    std::vector<std::thread> workers;

    bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return head != nullptr || stopping;
    }
  };

  struct Redirected {
    uint32_t item;
    int node;
    bool asking;
  };

  Batch* NewBatch(OpKind kind, const PageKey& ns, absl::Duration timeout, size_t n);
  // Names item i of `b` (key, shard), formats its Redis key and picks its cluster slot from that
  // very key, so the key a command sends and the node it goes to never disagree.
  Item& AddressItem(Batch* b, size_t i, const PageKey& key, uint32_t shard) const;
  absl::Status CheckOpen(size_t items) const;
  void Dispatch(Batch* b, absl::Span<const uint32_t> items, int node_hint, bool asking);
  Node* EnsureNode(int id);
  void Enqueue(Node* node, Chunk* c);
  void WorkerLoop(Node* node);
  void RunChunk(Node* node, Connection* conn, Chunk* c);
  void Resolve(Batch* b, uint32_t item, ObjectStatus status, uint64_t bytes);
  void ResolveExists(Batch* b, uint32_t item, Presence p);
  void ReleaseSubmitRef(Batch* b);
  void Deliver(Batch* b);
  void CallbackLoop();
  void RequestRefresh();
  void RefreshLoop();
  bool RefreshNow();
  bool CallbackWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !deferred_.empty();
  }
  bool RefreshWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || refresh_requested_;
  }

  const RedisBackendOptions options_;
  std::string name_;
  std::string ttl_args_;  // "$2\r\nPX\r\n$<n>\r\n<ms>\r\n", or empty without a TTL.
  StatsCounters stats_;
  SlotMap slots_;
  std::thread refresher_;
  std::thread callbacks_;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);  // Indexed by SlotMap node id.
  size_t batches_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool refresh_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Batch*> deferred_ ABSL_GUARDED_BY(mu_);  // Completed while submitting.
};

absl::Status RedisBackend::Impl::Init() {
  if (options_.addresses.empty()) return absl::InvalidArgumentError("addresses: empty");
  if (!options_.cluster && options_.addresses.size() != 1) {
    return absl::InvalidArgumentError("addresses: standalone mode takes exactly one address");
  }
  if (options_.key_prefix.size() > kMaxPrefixBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key_prefix: longer than ", kMaxPrefixBytes, " bytes"));
  }
  if (options_.connections_per_node < 1) {
    return absl::InvalidArgumentError("connections_per_node: must be at least 1");
  }
  for (const std::string& a : options_.addresses) {
    absl::StatusOr<RedisAddress> parsed = ParseRedisAddress(a);
    if (!parsed.ok()) return parsed.status();
    if (options_.cluster && parsed->is_unix) {
      return absl::InvalidArgumentError("addresses: a cluster is reached over TCP");
    }
    EnsureNode(slots_.NodeId(parsed->ToString()));
  }
  if (const int64_t ms = absl::ToInt64Milliseconds(options_.ttl); ms > 0) {
    const std::string v = absl::StrCat(ms);
    ttl_args_ = absl::StrCat("$2\r\nPX\r\n$", v.size(), "\r\n", v, "\r\n");
  }
  name_ = absl::StrCat(options_.cluster ? "redis-cluster:" : "redis:", options_.addresses[0]);
  callbacks_ = std::thread([this] { CallbackLoop(); });
  if (options_.cluster) {
    if (!RefreshNow()) {
      KVLOG(Warn, "redis cluster unreachable at startup, will retry",
            {{"seeds", options_.addresses[0]}});
    }
    refresher_ = std::thread([this] { RefreshLoop(); });
  }
  return absl::OkStatus();
}

RedisBackend::Impl::~Impl() {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    mu_.Await(absl::Condition(+[](size_t* n) { return *n == 0; }, &batches_in_flight_));
    stopping_ = true;
  }
  std::vector<Node*> nodes;
  {
    absl::MutexLock lock(&mu_);
    for (auto& n : nodes_) {
      if (n != nullptr) nodes.push_back(n.get());
    }
  }
  for (Node* n : nodes) {
    absl::MutexLock lock(&n->mu);
    n->stopping = true;
  }
  for (Node* n : nodes) {
    for (std::thread& t : n->workers) t.join();
  }
  if (refresher_.joinable()) refresher_.join();
  if (callbacks_.joinable()) callbacks_.join();
}

size_t RedisBackend::Impl::FormatKey(const PageKey& ns, const PageKey& key, uint32_t shard,
                                     char* out) const {
  char* p = out;
  std::memcpy(p, options_.key_prefix.data(), options_.key_prefix.size());
  p += options_.key_prefix.size();
  for (size_t i = 0; i < 8; ++i) {
    *p++ = kHexDigits[ns.bytes[i] >> 4];
    *p++ = kHexDigits[ns.bytes[i] & 0xf];
  }
  *p++ = ':';
  for (uint8_t b : key.bytes) {
    *p++ = kHexDigits[b >> 4];
    *p++ = kHexDigits[b & 0xf];
  }
  *p++ = ':';
  p += std::snprintf(p, 11, "%u", shard);
  return static_cast<size_t>(p - out);
}

absl::Status RedisBackend::Impl::CheckOpen(size_t items) const {
  if (items > options_.max_batch_items) {
    return absl::InvalidArgumentError(absl::StrCat("items: ", items, " exceeds max_batch_items ",
                                                   options_.max_batch_items));
  }
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("redis backend is shutting down");
  return absl::OkStatus();
}

RedisBackend::Impl::Batch* RedisBackend::Impl::NewBatch(OpKind kind, const PageKey& ns,
                                                        absl::Duration timeout, size_t n) {
  auto* b = new Batch;
  b->kind = kind;
  b->ns = ns;
  b->deadline =
      absl::Now() + (timeout > absl::ZeroDuration() ? timeout : options_.command_timeout);
  b->items.resize(n);
  b->remaining.store(n + 1, std::memory_order_relaxed);  // +1: the submission itself.
  absl::MutexLock lock(&mu_);
  ++batches_in_flight_;
  return b;
}

RedisBackend::Impl::Item& RedisBackend::Impl::AddressItem(Batch* b, size_t i, const PageKey& key,
                                                         uint32_t shard) const {
  Item& it = b->items[i];
  it.key = key;
  it.shard = shard;
  it.key_len = static_cast<uint8_t>(FormatKey(b->ns, it.key, it.shard, it.rkey));
  it.slot = KeyHashSlot(absl::string_view(it.rkey, it.key_len));
  return it;
}

absl::Status RedisBackend::Impl::Get(const GetRequest& request, BatchCallback done) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    if (request.items[i].dst == nullptr || request.items[i].capacity == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: no destination buffer"));
    }
  }
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  Batch* b = NewBatch(OpKind::kGet, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  absl::InlinedVector<uint32_t, 64> all;
  for (size_t i = 0; i < request.items.size(); ++i) {
    Item& it = AddressItem(b, i, request.items[i].key, request.items[i].shard);
    it.buf = request.items[i].dst;
    it.len = request.items[i].capacity;
    all.push_back(static_cast<uint32_t>(i));
  }
  Dispatch(b, all, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

absl::Status RedisBackend::Impl::Put(const PutRequest& request, BatchCallback done) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    if (request.items[i].src == nullptr || request.items[i].size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: empty source buffer"));
    }
  }
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  Batch* b = NewBatch(OpKind::kPut, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  absl::InlinedVector<uint32_t, 64> admitted;
  for (size_t i = 0; i < request.items.size(); ++i) {
    Item& it = AddressItem(b, i, request.items[i].key, request.items[i].shard);
    it.buf = const_cast<uint8_t*>(request.items[i].src);  // Only ever sent from.
    it.len = request.items[i].size;
    if (it.len > options_.max_object_bytes) {
      Resolve(b, static_cast<uint32_t>(i), ObjectStatus::kRejected, 0);
    } else {
      admitted.push_back(static_cast<uint32_t>(i));
    }
  }
  Dispatch(b, admitted, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

absl::Status RedisBackend::Impl::Delete(const DeleteRequest& request, BatchCallback done) {
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  Batch* b = NewBatch(OpKind::kDelete, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  absl::InlinedVector<uint32_t, 64> all;
  for (size_t i = 0; i < request.items.size(); ++i) {
    AddressItem(b, i, request.items[i].key, request.items[i].shard);
    all.push_back(static_cast<uint32_t>(i));
  }
  Dispatch(b, all, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

absl::Status RedisBackend::Impl::Exists(const ExistsRequest& request, ExistsCallback done) {
  if (request.shards.empty() && !request.keys.empty()) {
    return absl::InvalidArgumentError("shards: empty");
  }
  const size_t n = request.keys.size() * request.shards.size();
  if (absl::Status s = CheckOpen(n); !s.ok()) return s;
  Batch* b = NewBatch(OpKind::kExists, request.ns, request.timeout, n);
  b->exists_done = std::move(done);
  b->nkeys = request.keys.size();
  b->nshards = request.shards.size();
  b->presence.assign(n, kPending);
  absl::InlinedVector<uint32_t, 64> all;
  for (size_t k = 0; k < b->nkeys; ++k) {
    for (size_t s = 0; s < b->nshards; ++s) {
      const size_t i = k * b->nshards + s;
      AddressItem(b, i, request.keys[k], request.shards[s]);
      all.push_back(static_cast<uint32_t>(i));
    }
  }
  Dispatch(b, all, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

// Groups items by node (the slot map's, or node_hint for redirects) and spreads each node's share
// over its connections.
void RedisBackend::Impl::Dispatch(Batch* b, absl::Span<const uint32_t> items, int node_hint,
                                  bool asking) {
  if (items.empty()) return;
  absl::InlinedVector<std::pair<int, std::vector<uint32_t>>, 4> groups;
  for (uint32_t i : items) {
    int node = node_hint;
    if (node < 0) node = options_.cluster ? slots_.Lookup(b->items[i].slot) : 0;
    if (node < 0) {
      // No node serves this slot as far as we know: the map is being (re)built.
      RequestRefresh();
      if (b->kind == OpKind::kExists) {
        ResolveExists(b, i, kUnknownTransient);
      } else {
        Resolve(b, i, ObjectStatus::kRetry, 0);
      }
      continue;
    }
    auto it = std::find_if(groups.begin(), groups.end(),
                           [node](const auto& g) { return g.first == node; });
    if (it == groups.end()) {
      groups.emplace_back(node, std::vector<uint32_t>{});
      it = groups.end() - 1;
    }
    it->second.push_back(i);
  }
  for (auto& [node_id, list] : groups) {
    Node* node = EnsureNode(node_id);
    const size_t nchunks =
        std::min<size_t>(static_cast<size_t>(options_.connections_per_node), list.size());
    for (size_t c = 0; c < nchunks; ++c) {
      auto* chunk = new Chunk;
      chunk->batch = b;
      chunk->asking = asking;
      const size_t begin = list.size() * c / nchunks, end = list.size() * (c + 1) / nchunks;
      chunk->items.assign(list.begin() + begin, list.begin() + end);
      Enqueue(node, chunk);
    }
  }
}

RedisBackend::Impl::Node* RedisBackend::Impl::EnsureNode(int id) {
  absl::MutexLock lock(&mu_);
  if (static_cast<size_t>(id) >= nodes_.size()) nodes_.resize(id + 1);
  if (nodes_[id] == nullptr) {
    auto node = std::make_unique<Node>();
    node->address_text = slots_.Address(id);
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(node->address_text);
    if (a.ok()) node->address = *a;
    Node* raw = node.get();
    for (int i = 0; i < options_.connections_per_node; ++i) {
      raw->workers.emplace_back([this, raw] { WorkerLoop(raw); });
    }
    nodes_[id] = std::move(node);
  }
  return nodes_[id].get();
}

void RedisBackend::Impl::Enqueue(Node* node, Chunk* c) {
  absl::MutexLock lock(&node->mu);
  c->next = nullptr;
  if (node->tail == nullptr) node->head = c; else node->tail->next = c;
  node->tail = c;
}

void RedisBackend::Impl::WorkerLoop(Node* node) {
  Connection conn;
  for (;;) {
    Chunk* c;
    {
      absl::MutexLock lock(&node->mu, absl::Condition(node, &Node::HasWork));
      if (node->head == nullptr) return;  // Stopping, and nothing left.
      c = node->head;
      node->head = c->next;
      if (node->head == nullptr) node->tail = nullptr;
    }
    RunChunk(node, &conn, c);
    delete c;
  }
}

void RedisBackend::Impl::RunChunk(Node* node, Connection* conn, Chunk* c) {
  Batch* b = c->batch;
  auto fail_all = [&](absl::Span<const uint32_t> items, ObjectStatus status, bool timeout) {
    if (timeout) b->deadline_exceeded.store(true, std::memory_order_relaxed);
    for (uint32_t i : items) {
      if (b->kind == OpKind::kExists) {
        ResolveExists(b, i, kUnknownTransient);
      } else {
        Resolve(b, i, status, 0);
      }
    }
  };
  const absl::Time now = absl::Now();
  if (now >= b->deadline) return fail_all(c->items, ObjectStatus::kRetry, true);

  if (!conn->connected()) {
    if (absl::ToUnixNanos(now) < node->retry_after_ns.load(std::memory_order_relaxed)) {
      return fail_all(c->items, ObjectStatus::kRetry, false);  // Down a moment ago: fail fast.
    }
    absl::Status s = conn->Connect(node->address, std::min(options_.connect_timeout, b->deadline - now),
                                   options_.password);
    if (!s.ok()) {
      node->retry_after_ns.store(absl::ToUnixNanos(absl::Now() + options_.reconnect_backoff),
                                 std::memory_order_relaxed);
      if (options_.cluster) RequestRefresh();
      return fail_all(c->items, ObjectStatus::kRetry, false);
    }
    stats_.reconnects.fetch_add(1, std::memory_order_relaxed);
  }

  conn->Begin();
  for (uint32_t i : c->items) {
    Item& it = b->items[i];
    const absl::string_view key(it.rkey, it.key_len);
    if (c->asking) conn->AddAsking();
    switch (b->kind) {
      case OpKind::kGet:
        conn->AddSimple(Cmd::kGet, "GET", key, i, it.buf, it.len);
        break;
      case OpKind::kPut:
        if (!it.header_ready) {
          EncodeObjectHeader(
              MakeObjectHeader(b->ns, it.key, it.shard, it.buf, it.len,
                               static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()))),
              it.header);
          it.header_ready = true;
        }
        conn->AddSet(key, it.header, it.buf, it.len, ttl_args_, i);
        break;
      case OpKind::kExists:
        conn->AddSimple(Cmd::kExists, "EXISTS", key, i);
        break;
      case OpKind::kDelete:
        conn->AddSimple(Cmd::kUnlink, "UNLINK", key, i);
        break;
    }
  }

  absl::InlinedVector<Redirected, 4> redirected;
  absl::InlinedVector<uint32_t, 4> corrupt;
  auto on_reply = [&](const Connection::Expect& e, const ReplySink& r) {
    if (e.cmd == Cmd::kAsking) return;
    const uint32_t i = e.item;
    Item& it = b->items[i];
    if (r.type == REDIS_REPLY_ERROR) {
      Redirect rd;
      if (ParseRedirect(r.text, &rd)) {
        stats_.redirects.fetch_add(1, std::memory_order_relaxed);
        if (++it.redirects > options_.max_redirects) {
          if (b->kind == OpKind::kExists) return ResolveExists(b, i, kUnknownTransient);
          return Resolve(b, i, ObjectStatus::kRetry, 0);
        }
        const int target = slots_.NodeId(rd.address);
        if (rd.kind == Redirect::Kind::kMoved) {
          slots_.SetSlot(rd.slot, target);
          RequestRefresh();
        }
        redirected.push_back({i, target, rd.kind == Redirect::Kind::kAsk});
        return;
      }
      const ObjectStatus s = StatusFromError(r.text);
      if (absl::StartsWith(r.text, "CLUSTERDOWN") || absl::StartsWith(r.text, "READONLY")) {
        RequestRefresh();
      }
      if (b->kind == OpKind::kExists) {
        return ResolveExists(b, i,
                             s == ObjectStatus::kRetry ? kUnknownTransient : kUnknownError);
      }
      return Resolve(b, i, s, 0);
    }
    switch (e.cmd) {
      case Cmd::kGet: {
        if (r.type == REDIS_REPLY_NIL) return Resolve(b, i, ObjectStatus::kNotFound, 0);
        if (r.type != REDIS_REPLY_STRING) return Resolve(b, i, ObjectStatus::kDeviceError, 0);
        ExpectedObject expected;
        expected.ns = &b->ns;
        expected.key = &it.key;
        expected.shard = it.shard;
        expected.capacity = it.len;
        const uint64_t payload = r.oversize ? it.len + 1 : r.payload_len;
        const ObjectDefect d =
            VerifyObject(r.header, r.header_len, expected, it.buf, payload);
        if (d == ObjectDefect::kNone) return Resolve(b, i, ObjectStatus::kOk, r.payload_len);
        KVLOG(Warn, "l3 object corrupt, removed",
              {{"backend", name_},
               {"key", absl::string_view(it.rkey, it.key_len)},
               {"defect", ObjectDefectName(d)}});
        corrupt.push_back(i);  // Resolved once it is gone.
        return;
      }
      case Cmd::kSet:
        return Resolve(b, i,
                       r.type == REDIS_REPLY_STATUS ? ObjectStatus::kOk : ObjectStatus::kDeviceError,
                       it.len);
      case Cmd::kExists:
        return ResolveExists(b, i,
                             r.type == REDIS_REPLY_INTEGER
                                 ? (r.integer > 0 ? kPresent : kAbsent)
                                 : kUnknownError);
      case Cmd::kUnlink:
        if (r.type != REDIS_REPLY_INTEGER) return Resolve(b, i, ObjectStatus::kDeviceError, 0);
        return Resolve(b, i, r.integer > 0 ? ObjectStatus::kOk : ObjectStatus::kNotFound, 0);
      case Cmd::kAsking:
        return;
    }
  };

  absl::Status status;
  const size_t got = conn->Run(b->deadline, &status, on_reply);
  if (!status.ok()) {
    // Unanswered commands: the connection is in an unknown state (replies may still come), so it
    // goes; the objects are transient failures.
    const bool timeout = absl::IsDeadlineExceeded(status);
    absl::InlinedVector<uint32_t, 16> unanswered;
    for (size_t k = got; k < conn->pending(); ++k) {
      if (conn->expect(k).cmd != Cmd::kAsking) unanswered.push_back(conn->expect(k).item);
    }
    conn->Close();
    if (!timeout) {
      node->retry_after_ns.store(absl::ToUnixNanos(absl::Now() + options_.reconnect_backoff),
                                 std::memory_order_relaxed);
      if (options_.cluster) RequestRefresh();
    }
    fail_all(unanswered, ObjectStatus::kRetry, timeout);
  }

  if (!corrupt.empty()) {
    // Remove what failed verification before answering, so a retry does not find it again.
    if (conn->connected()) {
      conn->Begin();
      for (uint32_t i : corrupt) {
        conn->AddSimple(Cmd::kUnlink, "UNLINK",
                        absl::string_view(b->items[i].rkey, b->items[i].key_len), i);
      }
      // Within the batch deadline: past it, the bad value stays and the next read finds it again.
      absl::Status s;
      size_t removed = 0;
      conn->Run(b->deadline, &s, [&](const Connection::Expect&, const ReplySink& r) {
        removed += r.type == REDIS_REPLY_INTEGER;
      });
      if (!s.ok()) conn->Close();
      stats_.corrupt_removed.fetch_add(removed, std::memory_order_relaxed);
    }
    for (uint32_t i : corrupt) Resolve(b, i, ObjectStatus::kChecksumError, 0);
  }

  if (!redirected.empty()) {
    // Regroup by (target, asking) and send again; they count against the batch like any item.
    while (!redirected.empty()) {
      const int target = redirected.front().node;
      const bool asking = redirected.front().asking;
      absl::InlinedVector<uint32_t, 16> same;
      for (size_t k = 0; k < redirected.size();) {
        if (redirected[k].node == target && redirected[k].asking == asking) {
          same.push_back(redirected[k].item);
          redirected.erase(redirected.begin() + k);
        } else {
          ++k;
        }
      }
      Dispatch(b, same, target, asking);
    }
  }
}

void RedisBackend::Impl::Resolve(Batch* b, uint32_t item, ObjectStatus status, uint64_t bytes) {
  b->results[item] = ItemResult{status, status == ObjectStatus::kOk ? bytes : 0};
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Deliver(b);
}

void RedisBackend::Impl::ResolveExists(Batch* b, uint32_t item, Presence p) {
  b->presence[item] = p;
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Deliver(b);
}

// Drops the submission's own reference; if that was the last, every item was settled without a
// worker (all rejected, no route, empty batch) and a backend thread must deliver.
void RedisBackend::Impl::ReleaseSubmitRef(Batch* b) {
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    absl::MutexLock lock(&mu_);
    deferred_.push_back(b);
  }
}

void RedisBackend::Impl::CallbackLoop() {
  for (;;) {
    Batch* b;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Impl::CallbackWake));
      if (deferred_.empty()) return;
      b = deferred_.front();
      deferred_.pop_front();
    }
    Deliver(b);
  }
}

void RedisBackend::Impl::Deliver(Batch* b) {
  const bool late = b->deadline_exceeded.load(std::memory_order_relaxed);
  if (b->kind == OpKind::kExists) {
    ExistsResult r;
    r.present_prefix = b->nkeys;
    for (size_t k = 0; k < b->nkeys && r.present_prefix == b->nkeys; ++k) {
      for (size_t s = 0; s < b->nshards; ++s) {
        const uint8_t p = b->presence[k * b->nshards + s];
        if (p == kPresent) continue;
        r.present_prefix = k;
        r.status = p == kAbsent              ? ObjectStatus::kOk
                   : p == kUnknownTransient ? ObjectStatus::kRetry
                                            : ObjectStatus::kDeviceError;
        if (p != kAbsent) break;
      }
    }
    stats_.RecordExists(b->nkeys, r);
    std::move(b->exists_done)(r);
  } else {
    stats_.RecordBatch(b->kind, b->results, late);
    BatchResult r;
    r.items = std::move(b->results);
    r.deadline_exceeded = late;
    std::move(b->done)(std::move(r));
  }
  delete b;
  absl::MutexLock lock(&mu_);
  --batches_in_flight_;
}

// ---- Cluster topology -------------------------------------------------------------------------

void RedisBackend::Impl::RequestRefresh() {
  if (!options_.cluster) return;
  absl::MutexLock lock(&mu_);
  refresh_requested_ = true;
}

bool RedisBackend::Impl::RefreshNow() {
  // Seeds first (ids 0..), then every node learned since.
  const size_t n = slots_.node_count();
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(slots_.Address(static_cast<int>(i)));
    if (!a.ok()) continue;
    absl::StatusOr<std::vector<SlotRange>> ranges =
        FetchClusterSlots(*a, options_.connect_timeout, options_.password);
    if (!ranges.ok()) continue;
    slots_.Replace(*ranges);
    stats_.topology_refreshes.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

void RedisBackend::Impl::RefreshLoop() {
  absl::Time last = absl::InfinitePast();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Impl::RefreshWake));
      if (stopping_) return;
      // Rate limit: requests arriving meanwhile fold into the next refresh.
      const absl::Time next = last + options_.refresh_interval;
      if (absl::Now() < next) {
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), next - absl::Now());
        if (stopping_) return;
      }
      refresh_requested_ = false;
    }
    last = absl::Now();
    RefreshNow();
  }
}

BackendStats RedisBackend::Impl::Stats() const {
  BackendStats s;
  stats_.Snapshot(&s);
  return s;
}

// ---- RedisBackend -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<RedisBackend>> RedisBackend::Create(
    const RedisBackendOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<RedisBackend>(new RedisBackend(std::move(impl)));
}

RedisBackend::RedisBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisBackend::~RedisBackend() = default;

absl::string_view RedisBackend::name() const { return impl_->name(); }

Capabilities RedisBackend::capabilities() const {
  Capabilities c;
  c.shared_across_nodes = true;
  c.max_object_bytes = impl_->options().max_object_bytes;
  c.persistent = false;  // Whether Redis persists (RDB/AOF) is its configuration, not ours.
  c.max_batch_items = impl_->options().max_batch_items;
  return c;
}

absl::Status RedisBackend::Exists(const ExistsRequest& request, ExistsCallback done) {
  return impl_->Exists(request, std::move(done));
}
absl::Status RedisBackend::Get(const GetRequest& request, BatchCallback done) {
  return impl_->Get(request, std::move(done));
}
absl::Status RedisBackend::Put(const PutRequest& request, BatchCallback done) {
  return impl_->Put(request, std::move(done));
}
absl::Status RedisBackend::Delete(const DeleteRequest& request, BatchCallback done) {
  return impl_->Delete(request, std::move(done));
}
BackendStats RedisBackend::Stats() const { return impl_->Stats(); }

std::string RedisBackend::ObjectKey(const PageKey& ns, const PageKey& key, uint32_t shard) const {
  char buf[kMaxKeyBytes];
  return std::string(buf, impl_->FormatKey(ns, key, shard, buf));
}

}  // namespace kvcellar::storage
