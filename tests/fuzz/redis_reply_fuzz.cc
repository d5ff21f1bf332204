// Fuzz target: Redis replies as the L3 Redis backend reads them (storage/redis_connection.h). The
// input is what a Redis server (or anything listening at its address) answers to a pipeline; it
// reaches the daemon's code the way a socket delivers it: RedisConnection::Run reads it through
// hiredis' reader with the connection's own reply functions, which split a GET's value into
// header and payload straight into the destination. Each reply is then interpreted as the
// backend does: a redirect is parsed with its target address, a GET's value is verified as an
// object (storage/object_format.h).
//
// Input: a byte choosing the pipeline (which commands, the GET's destination size), then the
// server's bytes. One Unix socket per process; a connection per input.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/page_key.h"
#include "storage/object_format.h"
#include "storage/redis_cluster.h"
#include "storage/redis_connection.h"
#include "tests/fuzz/fuzz_util.h"

namespace storage = kvcellar::storage;

namespace {

// Server bytes written per input: below the socket's buffer, so the write never blocks.
constexpr size_t kMaxReplyBytes = 64 * 1024;

// A listening Unix socket in a fresh temporary directory, removed at exit.
class FakeServer {
 public:
  FakeServer() {
    char dir[] = "/tmp/kvcellar-fuzz-redis-XXXXXX";
    FUZZ_CHECK(mkdtemp(dir) != nullptr);
    dir_ = dir;
    address_.is_unix = true;
    address_.host = absl::StrCat(dir_, "/redis.sock");
    listener_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, address_.host.c_str(), sizeof(sa.sun_path) - 1);
    FUZZ_CHECK(bind(listener_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
    FUZZ_CHECK(listen(listener_, 4) == 0);
  }
  ~FakeServer() {
    close(listener_);
    unlink(address_.host.c_str());
    rmdir(dir_.c_str());
  }
  const storage::RedisAddress& address() const { return address_; }

  // Accepts the connection just made, sends `reply` and closes its writing side: the reader sees
  // the bytes, then end of stream.
  int Answer(const uint8_t* reply, size_t n) {
    const int peer = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    FUZZ_CHECK(peer >= 0);
    size_t off = 0;
    while (off < n) {
      const ssize_t w = write(peer, reply + off, n - off);
      FUZZ_CHECK(w > 0);
      off += static_cast<size_t>(w);
    }
    shutdown(peer, SHUT_WR);
    return peer;  // Kept open until the client is done: it absorbs the pipeline's commands.
  }

 private:
  std::string dir_;
  storage::RedisAddress address_;
  int listener_ = -1;
};

FakeServer& Server() {
  static FakeServer* server = new FakeServer();
  static const int registered = std::atexit([] { delete server; });
  (void)registered;
  return *server;
}

// The backend's reading of a reply (storage/redis_backend.cc OnReply), with its invariants.
void Interpret(const storage::RedisConnection::Expect& e, const storage::RedisReply& r,
               const kvcellar::core::PageKey& ns, const kvcellar::core::PageKey& key) {
  FUZZ_CHECK(r.type != storage::RedisReplyType::kNone);
  FUZZ_CHECK(r.text.size() <= 512);
  if (r.type == storage::RedisReplyType::kError) {
    storage::Redirect rd;
    if (storage::ParseRedirect(r.text, &rd)) {
      FUZZ_CHECK(rd.slot < storage::kClusterSlots);
      FUZZ_CHECK(!rd.address.empty());
      (void)storage::ParseRedisAddress(rd.address);
    }
    return;
  }
  if (e.cmd != storage::RedisCommand::kGet || r.type != storage::RedisReplyType::kString) return;
  FUZZ_CHECK(r.header_len <= storage::kObjectHeaderBytes);
  FUZZ_CHECK(r.oversize || r.payload_len <= e.capacity);
  FUZZ_CHECK(r.payload_len == 0 || r.header_len == storage::kObjectHeaderBytes ||
             r.header_len == storage::kObjectHeaderBytesV1);
  storage::ExpectedObject expected;
  expected.ns = &ns;
  expected.key = &key;
  expected.capacity = e.capacity;
  const uint64_t payload = r.oversize ? e.capacity + 1 : r.payload_len;
  (void)storage::VerifyObject(r.header, r.header_len, expected, e.dst, payload);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size - 1 > kMaxReplyBytes) return -1;
  const uint8_t shape = data[0];
  static constexpr storage::RedisCommand kOrder[] = {
      storage::RedisCommand::kGet, storage::RedisCommand::kSet, storage::RedisCommand::kExists,
      storage::RedisCommand::kUnlink, storage::RedisCommand::kGet};
  const int commands = 1 + (shape & 3);
  const uint64_t capacity = uint64_t{64} << ((shape >> 2) & 7);  // 64 B .. 8 KiB.
  std::vector<std::vector<uint8_t>> destinations;
  destinations.reserve(commands);  // Their buffers are handed out below.

  storage::RedisConnection conn;
  FUZZ_CHECK(conn.Connect(Server().address(), absl::Seconds(5), "").ok());
  conn.Begin();
  uint8_t header[storage::kObjectHeaderBytes] = {};
  const uint8_t payload[8] = {};
  for (int i = 0; i < commands; ++i) {
    const storage::RedisCommand cmd = kOrder[(i + (shape >> 5)) % 5];
    if (cmd == storage::RedisCommand::kSet) {
      conn.AddSet("kvc:k", header, payload, sizeof(payload), "", i);
    } else if (cmd == storage::RedisCommand::kGet) {
      destinations.emplace_back(capacity);
      conn.AddSimple(cmd, "GET", "kvc:k", i, destinations.back().data(), capacity);
    } else {
      conn.AddSimple(cmd, cmd == storage::RedisCommand::kExists ? "EXISTS" : "UNLINK", "kvc:k", i);
    }
  }
  const int peer = Server().Answer(data + 1, size - 1);
  const kvcellar::core::PageKey ns{}, key{};
  absl::Status status;
  const size_t got = conn.Run(absl::Now() + absl::Seconds(5), &status,
                              [&](const storage::RedisConnection::Expect& e,
                                  const storage::RedisReply& r) { Interpret(e, r, ns, key); });
  close(peer);
  FUZZ_CHECK(got <= static_cast<size_t>(commands));
  // Every command answered, or a reason: the server closed, or its bytes were not RESP.
  FUZZ_CHECK(got == static_cast<size_t>(commands) || !status.ok());
  FUZZ_CHECK(!absl::IsDeadlineExceeded(status));
  return 0;
}
