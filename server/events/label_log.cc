#include "server/events/label_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'C', 'L', 'A', 'B', 'L', '1'};
constexpr size_t kHeaderBytes = 16;
// Body before the tokens: ns, key, flags and padding, engine hash, token count.
constexpr size_t kFixedBody = 32 + 32 + 4 + 8 + 4;
// A page of more tokens than this is not a page (guards the reader against a garbled length).
constexpr uint32_t kMaxTokens = 1u << 20;

template <typename T>
void Put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
T Get(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void Encode(const core::PageKey& ns, const core::PageKey& key, const core::PageLabel& label,
            std::string& out) {
  const uint32_t body = static_cast<uint32_t>(kFixedBody + label.tokens.size() * 4);
  const size_t start = out.size();
  Put(out, body);
  Put(out, uint32_t{0});  // CRC, below.
  out.append(reinterpret_cast<const char*>(ns.bytes.data()), core::kPageKeyBytes);
  out.append(reinterpret_cast<const char*>(key.bytes.data()), core::kPageKeyBytes);
  const uint8_t flags[4] = {static_cast<uint8_t>(label.has_engine_hash ? 1 : 0), 0, 0, 0};
  out.append(reinterpret_cast<const char*>(flags), 4);
  Put(out, label.engine_hash);
  Put(out, static_cast<uint32_t>(label.tokens.size()));
  out.append(reinterpret_cast<const char*>(label.tokens.data()), label.tokens.size() * 4);
  const uint32_t crc = core::Crc32c(out.data() + start + 8, body);
  std::memcpy(out.data() + start + 4, &crc, 4);
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::Status(
      absl::ErrnoToStatusCode(errno),
      absl::StrCat("events.label_log: ", what, " ", path, ": ", std::strerror(errno)));
}

bool WriteFully(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::string Header() {
  std::string h(kHeaderBytes, '\0');
  std::memcpy(h.data(), kMagic, sizeof(kMagic));
  return h;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LabelLog>> LabelLog::Open(const LabelLogOptions& options) {
  const int fd = ::open(options.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot open", options.path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status s = Errno("cannot stat", options.path);
    ::close(fd);
    return s;
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t r = ::pread(fd, data.data() + got, data.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  data.resize(got);
  if (!data.empty() && (data.size() < kHeaderBytes || std::memcmp(data.data(), kMagic, 8) != 0)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "events.label_log: ", options.path,
        " is not a kvcellar label log (its first bytes are not KVCLABL1): name another file"));
  }
  auto log = std::unique_ptr<LabelLog>(new LabelLog(options, fd));
  LabelLogStats& s = log->stats_;
  uint64_t token_bytes = 0;
  size_t end = kHeaderBytes;
  if (data.empty()) {
    const std::string h = Header();
    if (!WriteFully(fd, h.data(), h.size())) {
      absl::Status err = Errno("cannot write", options.path);
      return err;  // The log's destructor closes fd.
    }
  } else {
    size_t p = kHeaderBytes;
    while (p + 8 <= data.size()) {
      const uint32_t body = Get<uint32_t>(data.data() + p);
      const uint32_t crc = Get<uint32_t>(data.data() + p + 4);
      if (body < kFixedBody || (body - kFixedBody) % 4 != 0 || p + 8 + body > data.size()) break;
      const char* b = data.data() + p + 8;
      if (core::Crc32c(b, body) != crc) break;
      const uint32_t tokens = Get<uint32_t>(b + 76);
      if (tokens > kMaxTokens || kFixedBody + size_t{tokens} * 4 != body) break;
      p += 8 + body;
      end = p;
      if (token_bytes + size_t{tokens} * 4 > options.max_recovered_bytes) {
        ++s.recovered_skipped;
        continue;
      }
      KeyPair k;
      std::memcpy(k.ns.bytes.data(), b, 32);
      std::memcpy(k.key.bytes.data(), b + 32, 32);
      auto label = std::make_shared<core::PageLabel>();
      label->has_engine_hash = (static_cast<uint8_t>(b[64]) & 1) != 0;
      label->engine_hash = Get<uint64_t>(b + 68);
      label->tokens.resize(tokens);
      std::memcpy(label->tokens.data(), b + kFixedBody, size_t{tokens} * 4);
      token_bytes += size_t{tokens} * 4;
      ++s.recovered;
      log->recovered_.insert_or_assign(k, std::move(label));
    }
    if (end < data.size()) {
      s.truncated_bytes = data.size() - end;
      if (::ftruncate(fd, static_cast<off_t>(end)) != 0) {
        return Errno("cannot truncate the torn tail of", options.path);
      }
    }
  }
  if (::lseek(fd, 0, SEEK_END) < 0) return Errno("cannot seek in", options.path);
  log->file_bytes_ = data.empty() ? kHeaderBytes : end;
  log->compacted_bytes_ = log->file_bytes_;
  KVLOG(Info, "label log opened",
        {{"path", options.path},
         {"labels", s.recovered},
         {"skipped", s.recovered_skipped},
         {"truncated_bytes", s.truncated_bytes}});
  log->thread_ = std::thread([l = log.get()] { l->Run(); });
  return log;
}

LabelLog::LabelLog(LabelLogOptions options, int fd) : options_(std::move(options)), fd_(fd) {}

LabelLog::~LabelLog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  Flush();
  absl::MutexLock lock(&io_mu_);
  if (fd_ >= 0) ::close(fd_);
}

void LabelLog::SetSnapshot(Snapshot snapshot, std::function<bool()> keep_recovered) {
  absl::MutexLock lock(&mu_);
  snapshot_ = std::move(snapshot);
  keep_recovered_ = std::move(keep_recovered);
}

std::shared_ptr<const core::PageLabel> LabelLog::Take(const core::PageKey& ns,
                                                      const core::PageKey& key) {
  absl::MutexLock lock(&recovered_mu_);
  if (recovered_.empty()) return nullptr;
  auto it = recovered_.find(KeyPair{ns, key});
  if (it == recovered_.end()) return nullptr;
  std::shared_ptr<const core::PageLabel> label = std::move(it->second);
  recovered_.erase(it);
  ++taken_;
  return label;
}

void LabelLog::Append(const core::PageKey& ns, absl::Span<const core::PageKey> keys,
                      absl::Span<const std::shared_ptr<const core::PageLabel>> labels,
                      const std::vector<bool>& attached) {
  std::string records;
  uint64_t n = 0;
  for (size_t i = 0; i < keys.size() && i < labels.size(); ++i) {
    if (labels[i] == nullptr || (!attached.empty() && !attached[i])) continue;
    Encode(ns, keys[i], *labels[i], records);
    ++n;
  }
  if (n == 0) return;
  absl::MutexLock lock(&mu_);
  buffer_ += records;
  stats_.appended += n;
}

bool LabelLog::WriteOut(const std::string& bytes) {
  if (bytes.empty()) return true;
  bool ok;
  {
    absl::MutexLock io(&io_mu_);
    ok = WriteFully(fd_, bytes.data(), bytes.size());
  }
  absl::MutexLock lock(&mu_);
  if (ok) {
    file_bytes_ += bytes.size();
  } else {
    ++stats_.write_errors;
  }
  return ok;
}

void LabelLog::Flush() {
  std::string out;
  {
    absl::MutexLock lock(&mu_);
    out.swap(buffer_);
  }
  WriteOut(out);
}

void LabelLog::CompactNow() {
  Flush();
  Compact();
}

void LabelLog::Run() {
  for (;;) {
    bool compact = false;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.flush_interval);
      if (stop_) return;
      compact =
          snapshot_ != nullptr &&
          file_bytes_ > compacted_bytes_ + std::max(options_.compact_min_bytes, compacted_bytes_);
    }
    Flush();
    if (compact) Compact();
  }
}

void LabelLog::Compact() {
  Snapshot snapshot;
  std::function<bool()> keep_recovered;
  {
    absl::MutexLock lock(&mu_);
    if (snapshot_ == nullptr) return;
    snapshot = snapshot_;
    keep_recovered = keep_recovered_;
  }
  const bool keep = keep_recovered != nullptr && keep_recovered();
  // Held throughout: no record reaches the old file after the snapshot below. Everything
  // attached before the snapshot is in an index (Append follows the index's Label) or was
  // removed from it; what is attached after stays in buffer_ and is written to the new file.
  absl::MutexLock io(&io_mu_);
  // The snapshot runs under each index's read lock: it only takes references, and the records
  // are encoded after it, so Backups wait on the index for no longer than the copy.
  struct Live {
    core::PageKey ns;
    core::PageKey key;
    std::shared_ptr<const core::PageLabel> label;
  };
  std::vector<Live> live;
  snapshot([&live](const core::PageKey& ns, const core::PageKey& key,
                   const std::shared_ptr<const core::PageLabel>& label) {
    live.push_back({ns, key, label});
  });
  std::string out = Header();
  for (const Live& l : live) Encode(l.ns, l.key, *l.label, out);
  if (keep) {
    absl::MutexLock lock(&recovered_mu_);
    for (const auto& [k, label] : recovered_) Encode(k.ns, k.key, *label, out);
  } else {
    absl::MutexLock lock(&recovered_mu_);
    recovered_.clear();
  }
  const std::string tmp = absl::StrCat(options_.path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool ok = fd >= 0 && WriteFully(fd, out.data(), out.size()) &&
            ::rename(tmp.c_str(), options_.path.c_str()) == 0;
  if (!ok) {
    KVLOG(Warn, "label log compaction failed",
          {{"path", options_.path}, {"error", std::strerror(errno)}});
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    absl::MutexLock lock(&mu_);
    ++stats_.write_errors;
    compacted_bytes_ = file_bytes_;  // Not again at once.
    return;
  }
  ::close(fd_);
  fd_ = fd;
  absl::MutexLock lock(&mu_);
  file_bytes_ = out.size();
  compacted_bytes_ = out.size();
  ++stats_.compactions;
}

LabelLogStats LabelLog::Stats() const {
  LabelLogStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
    s.file_bytes = file_bytes_;
  }
  absl::MutexLock lock(&recovered_mu_);
  s.taken = taken_;
  return s;
}

}  // namespace kvcellar::server
