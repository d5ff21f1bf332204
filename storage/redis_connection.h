// RedisConnection: one socket to one Redis or Valkey node, and the pipeline of commands it runs.
//
// Connect opens the socket with hiredis (blocking, under a timeout; AUTH when a password is set)
// and then takes it over: non-blocking, driven by poll() under the pipeline's deadline. A
// pipeline is built (Begin, Add...), then Run writes every command and reads every reply in one
// round trip. Writes go out with sendmsg straight from the caller's buffers (a SET's header and
// payload are never copied into a command buffer); replies are parsed by hiredis' reader with
// reply functions that copy a GET's payload straight from the socket buffer into its destination
// (no reply object per page). When Run stops early the connection is in an unknown state and the
// caller closes it; the next Connect reconnects.
//
// hiredis stays inside redis_connection.cc: callers see replies as RedisReply.
//
// Threads: one thread at a time (the connection's worker in storage/redis_backend.cc).
#ifndef KVCELLAR_STORAGE_REDIS_CONNECTION_H_
#define KVCELLAR_STORAGE_REDIS_CONNECTION_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/object_format.h"
#include "storage/redis_cluster.h"

struct redisContext;
struct redisReader;

namespace kvcellar::storage {

// The commands a pipeline carries; each reply is matched to its command.
// kHset and kHdel maintain the tier's index (redis_index.h): their replies settle no object.
enum class RedisCommand : uint8_t { kGet, kSet, kExists, kUnlink, kAsking, kHset, kHdel };

// The RESP types a reply can have (hiredis' REDIS_REPLY_*), kNone before one has arrived.
enum class RedisReplyType : uint8_t {
  kNone,
  kString,
  kArray,
  kInteger,
  kNil,
  kStatus,
  kError,
  kOther
};

// One reply as the reader left it. Only top-level values are kept: no command here answers with
// an array of data. A GET's value is split on arrival: its first kObjectHeaderBytes into
// `header`, the payload straight into the destination the GET named (unless larger than it).
struct RedisReply {
  RedisReplyType type = RedisReplyType::kNone;
  long long integer = 0;
  std::string text;  // Status or error text (at most 512 bytes).
  uint8_t header[kObjectHeaderBytes];
  size_t header_len = 0;
  uint64_t payload_len = 0;  // Bytes after the header; copied to the destination unless oversize.
  bool oversize = false;     // The payload did not fit the destination (not copied).

  // Where a GET's payload goes; nullptr for other commands.
  uint8_t* dst = nullptr;
  uint64_t capacity = 0;

  void Reset(uint8_t* d, uint64_t cap);
};

class RedisConnection {
 public:
  // What a command in the pipeline expects: the item it answers for, and for a GET where the
  // payload goes.
  struct Expect {
    RedisCommand cmd;
    uint32_t item;
    uint8_t* dst;
    uint64_t capacity;
  };
  using OnReply = absl::FunctionRef<void(const Expect& expect, const RedisReply& reply)>;

  RedisConnection();
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  bool connected() const { return ctx_ != nullptr; }
  // Closes any previous socket and connects within `timeout` (at least 1 ms). Unavailable: not
  // reachable; PermissionDenied: AUTH refused.
  absl::Status Connect(const RedisAddress& addr, absl::Duration timeout,
                       const std::string& password);
  void Close();

  // ---- Building a pipeline ----
  void Begin();
  // A one-key command: "<name> <key>".
  void AddSimple(RedisCommand cmd, absl::string_view name, absl::string_view key, uint32_t item,
                 uint8_t* dst = nullptr, uint64_t capacity = 0);
  void AddAsking();
  // HSET key field value (value non-empty) or HDEL key field (value empty), for `item`; all three
  // are copied.
  void AddIndex(absl::string_view key, absl::string_view field, absl::string_view value,
                uint32_t item);
  // SET key <header><payload> [PX ttl_ms]; `ttl_args` is "" or the encoded "PX <ms>" arguments.
  // header and payload are sent from where they are: they must stay valid until Run returns.
  void AddSet(absl::string_view key, const uint8_t* header, const uint8_t* payload, uint64_t size,
              absl::string_view ttl_args, uint32_t item);
  size_t pending() const { return expects_.size(); }
  const Expect& expect(size_t i) const { return expects_[i]; }

  // Sends the pipeline and reads its replies, calling on_reply(expect, reply) for each in order.
  // Returns how many replies arrived; *status says why it stopped early (the connection is then
  // unusable: the caller closes it).
  size_t Run(absl::Time deadline, absl::Status* status, OnReply on_reply);

 private:
  struct Seg {
    bool external;
    const uint8_t* ptr;  // External bytes.
    size_t off;          // Or an offset into text_.
    size_t len;
  };

  template <typename... Parts>
  void Text(const Parts&... parts);
  void External(const uint8_t* p, size_t n) { segs_.push_back({true, p, 0, n}); }
  void BuildIov();
  void Advance(size_t* next, size_t n);
  void ArmSink(size_t i);

  redisContext* ctx_ = nullptr;
  redisReader* reader_ = nullptr;
  RedisReply sink_;
  std::unique_ptr<char[]> rbuf_;
  std::string text_;
  std::vector<Seg> segs_;
  std::vector<iovec> iov_;
  std::vector<Expect> expects_;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_REDIS_CONNECTION_H_
