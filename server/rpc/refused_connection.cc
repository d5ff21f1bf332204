#include "server/rpc/refused_connection.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcellar::server {
namespace http2 {
namespace {

// RFC 9113 6: frame types, flags and the error code used.
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kGoAway = 0x7;
constexpr uint8_t kFlagAck = 0x1;         // SETTINGS
constexpr uint8_t kFlagEndStream = 0x1;   // HEADERS
constexpr uint8_t kFlagEndHeaders = 0x4;  // HEADERS
constexpr uint32_t kEnhanceYourCalm = 0xb;
// grpc-status of UNAVAILABLE (gRPC's status codes).
constexpr char kUnavailable[] = "14";

void AppendU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>(v >> shift));
}

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream_id, absl::string_view payload) {
  std::string out;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  out.push_back(static_cast<char>(n >> 16));
  out.push_back(static_cast<char>(n >> 8));
  out.push_back(static_cast<char>(n));
  out.push_back(static_cast<char>(type));
  out.push_back(static_cast<char>(flags));
  AppendU32(&out, stream_id & 0x7fffffffu);
  out.append(payload.data(), payload.size());
  return out;
}

// HPACK (RFC 7541 5.1) integer with a `prefix_bits` prefix, the high bits of the first byte
// being `first`.
void AppendHpackInt(std::string* out, uint8_t first, int prefix_bits, size_t v) {
  const size_t max = (size_t{1} << prefix_bits) - 1;
  if (v < max) {
    out->push_back(static_cast<char>(first | v));
    return;
  }
  out->push_back(static_cast<char>(first | max));
  v -= max;
  while (v >= 128) {
    out->push_back(static_cast<char>(0x80 | (v & 0x7f)));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A string literal, not Huffman-coded (RFC 7541 5.2).
void AppendHpackString(std::string* out, absl::string_view s) {
  AppendHpackInt(out, 0x00, 7, s.size());
  out->append(s.data(), s.size());
}

// A literal header field without indexing, new name (RFC 7541 6.2.2).
void AppendLiteral(std::string* out, absl::string_view name, absl::string_view value) {
  out->push_back(0x00);
  AppendHpackString(out, name);
  AppendHpackString(out, value);
}

// gRPC's grpc-message encoding: bytes outside printable ASCII, and '%', as %XX.
std::string PercentEncode(absl::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c > 0x7e || c == '%') {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

}  // namespace

std::string ServerPreface() { return Frame(kSettings, 0, 0, ""); }

std::string SettingsAck() { return Frame(kSettings, kFlagAck, 0, ""); }

std::string UnavailableTrailers(uint32_t stream_id, absl::string_view message) {
  std::string block;
  block.push_back(static_cast<char>(0x88));  // :status 200, static table entry 8.
  // content-type (static table entry 31) as a literal without indexing, indexed name.
  AppendHpackInt(&block, 0x00, 4, 31);
  AppendHpackString(&block, "application/grpc");
  AppendLiteral(&block, "grpc-status", kUnavailable);
  AppendLiteral(&block, "grpc-message", PercentEncode(message));
  return Frame(kHeaders, kFlagEndStream | kFlagEndHeaders, stream_id, block);
}

std::string GoAway(uint32_t last_stream_id, absl::string_view debug) {
  std::string payload;
  AppendU32(&payload, last_stream_id & 0x7fffffffu);
  AppendU32(&payload, kEnhanceYourCalm);
  payload.append(debug.data(), debug.size());
  return Frame(kGoAway, 0, 0, payload);
}

}  // namespace http2

namespace {

// The client connection preface (RFC 9113 3.4).
constexpr char kClientPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kClientPrefaceBytes = sizeof(kClientPreface) - 1;
constexpr size_t kFrameHeaderBytes = 9;
// Bytes read per read(2); what the client sends is dropped once parsed.
constexpr size_t kReadChunkBytes = 4096;
// Reads per Serve call, so that one fast sender cannot keep the accept thread.
constexpr int kMaxReadsPerPoll = 4;

}  // namespace

RefusedConnections::~RefusedConnections() {
  for (const Pending& p : pending_) ::close(p.fd);
}

bool RefusedConnections::Send(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    // A fresh socket's buffer takes these few hundred bytes at once; a client whose buffer is
    // full is not reading its answer.
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

void RefusedConnections::Add(int fd, std::string reason, absl::Time now) {
  if (pending_.size() >= kMaxPending) {
    ::close(pending_.front().fd);
    pending_.pop_front();
  }
  if (!Send(fd, http2::ServerPreface())) {
    ::close(fd);
    return;
  }
  Pending p;
  p.fd = fd;
  p.deadline = now + kLinger;
  p.reason = std::move(reason);
  pending_.push_back(std::move(p));
  // The client may have sent its call already: answer it now rather than at the next poll.
  if (!Serve(pending_.back())) {
    ::close(pending_.back().fd);
    pending_.pop_back();
  }
}

void RefusedConnections::AppendPollFds(std::vector<pollfd>* fds) const {
  for (const Pending& p : pending_) fds->push_back(pollfd{p.fd, POLLIN, 0});
}

void RefusedConnections::OnPoll(const pollfd* fds, size_t n, absl::Time now) {
  // fds[i] is pending_[i]: nothing was added or removed since AppendPollFds.
  std::deque<Pending> kept;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    bool keep = p.deadline > now;
    if (keep && i < n && fds[i].revents != 0) keep = Serve(p);
    if (keep) {
      kept.push_back(std::move(p));
    } else {
      ::close(p.fd);
    }
  }
  pending_.swap(kept);
}

int RefusedConnections::TimeoutMs(absl::Time now) const {
  if (pending_.empty()) return -1;
  const absl::Duration left = pending_.front().deadline - now;
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
}

bool RefusedConnections::Serve(Pending& p) {
  uint8_t buf[kReadChunkBytes];
  for (int i = 0; i < kMaxReadsPerPoll; ++i) {
    const ssize_t n = ::read(p.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;  // The client closed (it read the GOAWAY), or reset.
    const uint32_t answered = p.last_stream;
    if (!Parse(p, buf, static_cast<size_t>(n))) return false;
    if (p.last_stream != answered && !p.gone_away) {
      // Every call of this read is answered: no stream past the last one will be.
      p.gone_away = true;
      if (!Send(p.fd, http2::GoAway(p.last_stream, p.reason))) return false;
      ::shutdown(p.fd, SHUT_WR);
    }
  }
  return true;
}

bool RefusedConnections::Parse(Pending& p, const uint8_t* data, size_t n) {
  while (n > 0) {
    if (p.preface_left > 0) {
      const size_t k = std::min(n, p.preface_left);
      const size_t at = kClientPrefaceBytes - p.preface_left;
      if (std::memcmp(data, kClientPreface + at, k) != 0) return false;  // Not HTTP/2.
      p.preface_left -= k;
      data += k;
      n -= k;
      continue;
    }
    if (p.payload_left > 0) {
      const size_t k = std::min<size_t>(n, p.payload_left);
      p.payload_left -= static_cast<uint32_t>(k);
      data += k;
      n -= k;
      continue;
    }
    const size_t k = std::min(n, kFrameHeaderBytes - p.header_bytes);
    std::memcpy(p.header + p.header_bytes, data, k);
    p.header_bytes += k;
    data += k;
    n -= k;
    if (p.header_bytes < kFrameHeaderBytes) break;
    p.header_bytes = 0;
    p.payload_left = (uint32_t{p.header[0]} << 16) | (uint32_t{p.header[1]} << 8) | p.header[2];
    const uint8_t type = p.header[3];
    const uint8_t flags = p.header[4];
    const uint32_t stream = ((uint32_t{p.header[5]} << 24) | (uint32_t{p.header[6]} << 16) |
                             (uint32_t{p.header[7]} << 8) | p.header[8]) &
                            0x7fffffffu;
    if (p.gone_away) continue;  // Nothing more is answered once the write side is shut.
    if (type == http2::kSettings && (flags & http2::kFlagAck) == 0) {
      if (!Send(p.fd, http2::SettingsAck())) return false;
    } else if (type == http2::kHeaders && stream > p.last_stream && stream % 2 == 1) {
      // A new call (client streams are odd). Its END_HEADERS or CONTINUATION frames do not
      // matter: it is answered whatever it asked.
      if (!Send(p.fd, http2::UnavailableTrailers(stream, p.reason))) return false;
      p.last_stream = stream;
    }
  }
  return true;
}

}  // namespace kvcellar::server
