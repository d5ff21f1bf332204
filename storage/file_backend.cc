#include "storage/file_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "storage/object_format.h"

namespace kvcellar::storage {
namespace {

constexpr uint64_t kBlock = kFileHeaderBlockBytes;
// A Get reads this much past the end of its slot, into a buffer of its own, so that bytes after
// the payload reach the verifier even when the object fills the slot exactly (the usual case:
// the namespace fixes the object size). An intact file ends where its payload does, so the probe
// reads nothing and costs no I/O; it is one block so that O_DIRECT accepts it.
constexpr uint64_t kTailProbe = kBlock;
// "<ns16>/<kk>/<key64>.<shard>" is at most 95 characters; the temp suffix adds
// ".tmp-" + host (at most kMaxHostChars) + "-<pid>-<seq>" (at most 32).
constexpr size_t kMaxHostChars = 64;
constexpr size_t kMaxRelPath = 256;
constexpr char kTempMarker[] = ".tmp-";
// Scanned objects enter the index in chunks, so the lock is never held for a whole directory tree.
constexpr size_t kScanInsertChunk = 4096;
// How often the sweeper looks for queued objects past their deadline while the queue is not empty.
constexpr absl::Duration kSweepPeriod = absl::Milliseconds(2);
// Modes of the directories and objects the tier creates, whatever the umask: owner only. A cached
// KV page is the prompt in another form; only the daemon's user reads it. Daemons sharing a
// directory (`shared`) run as one user (docs/storage.md "Permissions").
constexpr mode_t kDirMode = 0700;
constexpr mode_t kObjectMode = 0600;

// The process umask, read without changing it (umask(2) reads only by setting, which races with
// other threads creating files): the "Umask:" line of /proc/self/status (Linux 4.7+). nullopt
// where that is missing.
std::optional<mode_t> ReadProcessUmask() {
  FILE* f = std::fopen("/proc/self/status", "re");
  if (f == nullptr) return std::nullopt;
  std::optional<mode_t> mask;
  char line[256];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned int m = 0;
    if (std::sscanf(line, "Umask: %o", &m) == 1) {
      mask = static_cast<mode_t>(m);
      break;
    }
  }
  std::fclose(f);
  return mask;
}

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
// Disk footprint of an object: the header block plus the payload in whole blocks.
uint64_t FileBytes(uint64_t payload) { return kBlock + RoundUp(payload, kBlock); }

// An object in the index: the directory's 8-byte namespace prefix, the key, the shard.
struct ObjKey {
  uint64_t ns_prefix = 0;
  PageKey key;
  uint32_t shard = 0;

  friend bool operator==(const ObjKey& a, const ObjKey& b) {
    return a.ns_prefix == b.ns_prefix && a.shard == b.shard && a.key == b.key;
  }
  template <typename H>
  friend H AbslHashValue(H h, const ObjKey& k) {
    return H::combine(std::move(h), k.key, k.ns_prefix, k.shard);
  }
};

uint64_t NsPrefix(const PageKey& ns) {
  uint64_t v;
  std::memcpy(&v, ns.bytes.data(), sizeof(v));
  return v;
}

constexpr char kHexDigits[] = "0123456789abcdef";

char* AppendHex(const uint8_t* p, size_t n, char* out) {
  for (size_t i = 0; i < n; ++i) {
    *out++ = kHexDigits[p[i] >> 4];
    *out++ = kHexDigits[p[i] & 0xf];
  }
  return out;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // Only lowercase: we write lowercase, anything else is not ours.
}

bool ParseHex(absl::string_view s, uint8_t* out) {
  if (s.size() % 2 != 0) return false;
  for (size_t i = 0; i < s.size() / 2; ++i) {
    int hi = HexValue(s[2 * i]), lo = HexValue(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

bool ParseU32(absl::string_view s, uint32_t* out) {
  if (s.empty() || s.size() > 10) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

// "<ns16>/<kk>" into out; returns the end.
char* FormatLeafDir(uint64_t ns_prefix, const PageKey& key, char* out) {
  uint8_t ns8[8];
  std::memcpy(ns8, &ns_prefix, sizeof(ns8));
  out = AppendHex(ns8, sizeof(ns8), out);
  *out++ = '/';
  out = AppendHex(key.bytes.data(), 1, out);
  *out = '\0';
  return out;
}

// "<ns16>/<kk>/<key64>.<shard>", NUL-terminated; returns the end.
char* FormatObjectPath(uint64_t ns_prefix, const PageKey& key, uint32_t shard, char* out) {
  out = FormatLeafDir(ns_prefix, key, out);
  *out++ = '/';
  out = AppendHex(key.bytes.data(), key.bytes.size(), out);
  out += std::snprintf(out, 12, ".%u", shard);
  return out;
}

// Which status an errno becomes. Full devices and quotas reject; resource shortages and NFS's
// stale handles are transient; everything else is the device's fault.
ObjectStatus StatusFromErrno(int err) {
  switch (err) {
    case ENOENT:
      return ObjectStatus::kNotFound;
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return ObjectStatus::kRejected;
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EAGAIN:
    case EINTR:
    case EBUSY:
    case ETIMEDOUT:
    case ESTALE:
    case ECANCELED:
      return ObjectStatus::kRetry;
    default:
      return ObjectStatus::kDeviceError;
  }
}

// The index: objects by identity, with their disk footprint, in a recency list (hot end = most
// recently written or read). Entries live in a slab linked by index, so inserting, touching and
// evicting allocate nothing once the slab and map have grown to the working set.
// Threads: none of its own; the owner's mutex guards it.
class ObjectIndex {
 public:
  static constexpr uint32_t kNil = UINT32_MAX;

  size_t size() const { return map_.size(); }
  bool Contains(const ObjKey& id) const { return map_.contains(id); }

  // Inserts at the hot end or moves there; returns the footprint it replaced (0 when new).
  uint64_t UpsertHot(const ObjKey& id, uint64_t bytes) {
    auto [it, inserted] = map_.try_emplace(id, kNil);
    uint64_t old = 0;
    if (inserted) {
      it->second = NewEntry(id, bytes);
    } else {
      old = slab_[it->second].bytes;
      slab_[it->second].bytes = bytes;
      Unlink(it->second);
    }
    LinkHot(it->second);
    return old;
  }
  // Inserts at the cold end; false (nothing changed) when present.
  bool InsertCold(const ObjKey& id, uint64_t bytes) {
    auto [it, inserted] = map_.try_emplace(id, kNil);
    if (!inserted) return false;
    it->second = NewEntry(id, bytes);
    LinkCold(it->second);
    return true;
  }
  void Touch(const ObjKey& id) {
    auto it = map_.find(id);
    if (it == map_.end()) return;
    Unlink(it->second);
    LinkHot(it->second);
  }
  // The footprint removed, or nullopt when absent.
  std::optional<uint64_t> Remove(const ObjKey& id) {
    auto it = map_.find(id);
    if (it == map_.end()) return std::nullopt;
    uint32_t e = it->second;
    map_.erase(it);
    uint64_t bytes = slab_[e].bytes;
    Unlink(e);
    free_.push_back(e);
    return bytes;
  }
  bool PopColdest(ObjKey* id, uint64_t* bytes) {
    if (cold_ == kNil) return false;
    *id = slab_[cold_].id;
    *bytes = *Remove(*id);
    return true;
  }

 private:
  struct Entry {
    ObjKey id;
    uint64_t bytes = 0;
    uint32_t hotter = kNil;
    uint32_t colder = kNil;
  };

  uint32_t NewEntry(const ObjKey& id, uint64_t bytes) {
    uint32_t e;
    if (!free_.empty()) {
      e = free_.back();
      free_.pop_back();
    } else {
      e = static_cast<uint32_t>(slab_.size());
      slab_.emplace_back();
    }
    slab_[e] = Entry{id, bytes, kNil, kNil};
    return e;
  }
  void Unlink(uint32_t e) {
    Entry& x = slab_[e];
    if (x.hotter != kNil) slab_[x.hotter].colder = x.colder; else hot_ = x.colder;
    if (x.colder != kNil) slab_[x.colder].hotter = x.hotter; else cold_ = x.hotter;
    x.hotter = x.colder = kNil;
  }
  void LinkHot(uint32_t e) {
    slab_[e].colder = hot_;
    slab_[e].hotter = kNil;
    if (hot_ != kNil) slab_[hot_].hotter = e; else cold_ = e;
    hot_ = e;
  }
  void LinkCold(uint32_t e) {
    slab_[e].hotter = cold_;
    slab_[e].colder = kNil;
    if (cold_ != kNil) slab_[cold_].colder = e; else hot_ = e;
    cold_ = e;
  }

  absl::flat_hash_map<ObjKey, uint32_t> map_;
  std::vector<Entry> slab_;
  std::vector<uint32_t> free_;
  uint32_t hot_ = kNil;
  uint32_t cold_ = kNil;
};

// Set while a thread is inside a submitting call, so a batch that completes during submission
// delivers its callback from an engine thread instead (the contract in backend.h).
thread_local int tls_submitting = 0;

struct SubmitScope {
  SubmitScope() { ++tls_submitting; }
  ~SubmitScope() { --tls_submitting; }
};

std::string LocalHostId() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

// ---- Impl -------------------------------------------------------------------------------------

class FileBackend::Impl {
 public:
  explicit Impl(const FileBackendOptions& options) : options_(options) {}
  ~Impl();

  absl::Status Init();

  absl::Status Exists(const ExistsRequest& request, ExistsCallback done);
  absl::Status Get(const GetRequest& request, BatchCallback done);
  absl::Status Put(const PutRequest& request, BatchCallback done);
  absl::Status Delete(const DeleteRequest& request, BatchCallback done);
  BackendStats Stats() const;
  bool WaitForIndex(absl::Duration timeout) const;

  const std::string& name() const { return name_; }
  const FileBackendOptions& options() const { return options_; }
  absl::string_view engine_name() const { return engine_->name(); }

 private:
  enum Stage : uint8_t {
    kOpen,
    kRead,
    kWrite,
    kSync,
    kClose,
    kRename,
    kDirOpen,
    kDirSync,
    kDirClose,
    kUnlink,
    kUnlinkCorrupt,
    kCleanupClose,
    kCleanupUnlink,
    kStatx,
  };

  struct Batch;

  // One object of a batch and its I/O state machine: each completed IoOp advances `stage`.
  struct Task {
    IoOp op;
    Batch* batch = nullptr;
    uint32_t index = 0;  // Request item (Exists: key * shards + shard).
    Stage stage = kOpen;
    bool direct = false;
    bool made_dirs = false;
    ObjectStatus status = ObjectStatus::kOk;
    ObjectDefect defect = ObjectDefect::kNone;
    int fd = -1;
    // While the task holds an I/O slot: the 4 KiB header buffer, then the Get's tail probe
    // (kTailProbe bytes at block + kBlock).
    uint8_t* block = nullptr;
    struct iovec iov[3];
    uint64_t io_total = 0;
    uint64_t io_done = 0;
    uint64_t payload = 0;   // Get: payload bytes served.
    uint64_t reserved = 0;  // Put: bytes reserved against capacity until published.
    ObjKey id;
    uint8_t* buf = nullptr;  // Get: destination; Put: source.
    uint64_t len = 0;        // Get: capacity; Put: size.
    struct statx stx;
    Task* next = nullptr;  // Queue link.
    char path[kMaxRelPath];
    char tmp[kMaxRelPath];
  };

  // Exists per-object outcome.
  enum Presence : uint8_t { kPending = 0, kPresent, kAbsent, kUnknownError, kUnknownTimeout };

  struct Batch {
    Impl* impl = nullptr;
    OpKind kind = OpKind::kGet;
    PageKey ns;
    absl::Time deadline;
    std::unique_ptr<Task[]> tasks;
    size_t ntasks = 0;
    std::vector<ItemResult> results;
    std::atomic<size_t> remaining{0};
    std::atomic<bool> deadline_exceeded{false};
    BatchCallback done;
    // Exists.
    ExistsCallback exists_done;
    size_t nkeys = 0;
    size_t nshards = 0;
    std::vector<uint8_t> presence;  // Presence per (key, shard).
    IoOp hop;  // Carries the callback onto an engine thread when needed.
  };

  // An unlink of an evicted object, in flight.
  struct EvictOp {
    IoOp op;
    Impl* impl = nullptr;
    char path[kMaxRelPath];
  };

  // What the startup scan found: objects to index, and its place in the tree so it can resume.
  struct ScanState {
    struct Found {
      ObjKey id;
      uint64_t bytes;
      int64_t mtime_ns;
    };
    bool listed_root = false;
    std::vector<std::string> ns_dirs;
    size_t ns_next = 0;
    std::vector<std::string> leaves;  // Leaf directories of ns_dirs[ns_next - 1] not yet read.
    std::vector<Found> found;
    uint64_t temps_removed = 0;
    uint64_t entries_seen = 0;
  };

  // Submission.
  Batch* NewBatch(OpKind kind, const PageKey& ns, absl::Duration timeout, size_t ntasks);
  void InitTask(Batch* b, Task* t, uint32_t index, const PageKey& key, uint32_t shard);
  void Pump();
  void StartTask(Task* t, IoOp** out, size_t* nout);
  void Finish(Task* t, ObjectStatus status);
  void CompleteBatch(Batch* b);
  void Deliver(Batch* b);
  void FinishExpired(Task* t);

  // Completions.
  static void OnOpDone(IoOp* op);
  static void OnHop(IoOp* op);
  static void OnEvicted(IoOp* op);
  void Advance(Task* t, int64_t res);
  void AdvanceGet(Task* t, int64_t res);
  void AdvancePut(Task* t, int64_t res);
  void AdvanceDelete(Task* t, int64_t res);
  void AdvanceExists(Task* t, int64_t res);

  void Submit(Task* t) { engine_->Submit(&t->op); }
  void PrepOpen(Task* t, const char* path, int flags);
  void PrepTransferRest(Task* t, IoOp::Code code);
  void PrepReadRest(Task* t);
  void PrepWriteRest(Task* t);
  void PrepSimple(Task* t, IoOp::Code code, Stage stage);
  void CleanupPut(Task* t, ObjectStatus status);
  void DisableDirect(int err);
  void EnsureDirs(Task* t);
  int MakeDir(int dirfd, const char* path) const;
  void Publish(Task* t);
  void Forget(const ObjKey& id);
  void CountCorrupt(Task* t);

  // Capacity: reserve for a write, evicting the coldest objects as needed.
  bool ReserveLocked(uint64_t bytes, absl::InlinedVector<ObjKey, 8>* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictOverCapacityLocked(absl::InlinedVector<ObjKey, 8>* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteRemovedLocked(const ObjKey& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnlinkVictims(const absl::InlinedVector<ObjKey, 8>& victims);

  // Startup scan.
  bool ScanUntil(absl::Time until);  // True when the tree has been read.
  void ScanLeaf(const std::string& ns_dir, uint64_t ns_prefix, const std::string& leaf);
  bool IsStaleTemp(absl::string_view suffix, int64_t mtime_ns) const;
  void PublishScan();
  void ScanThread();

  void SweepThread();
  bool SweepWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || queue_head_ != nullptr;
  }
  bool Authoritative() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !options_.shared && index_complete_;
  }
  absl::Status CheckOpen(size_t items) const;

  const FileBackendOptions options_;
  std::string name_;
  std::string host_id_;
  int root_fd_ = -1;
  // The umask (read at Open) takes bits of kDirMode or kObjectMode away, or is unknown: each
  // directory and object is chmod-ed to its mode after it is created. A umask only ever narrows
  // a mode, and the usual ones (022, 027, 077) leave the owner's bits: no chmod then.
  bool chmod_after_create_ = true;
  const pid_t pid_ = getpid();
  std::unique_ptr<IoEngine> engine_;
  std::atomic<bool> direct_ok_{true};
  std::atomic<uint64_t> temp_seq_{0};
  StatsCounters stats_;
  // max_inflight_objects slots of [header block][tail probe], 4 KiB-aligned.
  uint8_t* blocks_ = nullptr;
  std::thread scanner_;
  std::thread sweeper_;
  std::atomic<bool> stop_scan_{false};
  ScanState scan_;  // Owned by Init's thread, then by the scanner thread alone.

  mutable absl::Mutex mu_;
  ObjectIndex index_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool index_complete_ ABSL_GUARDED_BY(mu_) = false;
  // Objects removed while the scan runs, so it does not re-add what it listed before they went.
  absl::flat_hash_set<ObjKey> removed_during_scan_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> free_blocks_ ABSL_GUARDED_BY(mu_);
  Task* queue_head_ ABSL_GUARDED_BY(mu_) = nullptr;  // Waiting for an I/O slot, FIFO.
  Task* queue_tail_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<EvictOp*> free_evict_ops_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<EvictOp>> evict_ops_ ABSL_GUARDED_BY(mu_);
  size_t batches_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

absl::Status FileBackend::Impl::Init() {
  if (options_.root.empty()) return absl::InvalidArgumentError("root: empty");
  if (options_.max_inflight_objects == 0) {
    return absl::InvalidArgumentError("max_inflight_objects: must be at least 1");
  }
  name_ = absl::StrCat("file:", options_.root);
  host_id_ = options_.host_id.empty() ? LocalHostId() : options_.host_id;
  for (char& c : host_id_) {
    if (c == '/' || c == '\0') c = '_';
  }
  if (host_id_.size() > kMaxHostChars) host_id_.resize(kMaxHostChars);
  direct_ok_.store(options_.direct_io);

  const std::optional<mode_t> mask = ReadProcessUmask();
  chmod_after_create_ = !mask.has_value() || (*mask & (kDirMode | kObjectMode)) != 0;

  // mkdir -p root. Directories that exist keep their mode (an operator's choice); what the tier
  // creates, from the first missing parent down, is kDirMode.
  for (size_t pos = 1; pos <= options_.root.size(); ++pos) {
    if (pos == options_.root.size() || options_.root[pos] == '/') {
      std::string prefix = options_.root.substr(0, pos);
      if (MakeDir(AT_FDCWD, prefix.c_str()) != 0 && errno != EEXIST) {
        return absl::InternalError(
            absl::StrCat("root: mkdir ", prefix, ": ", std::strerror(errno)));
      }
    }
  }
  root_fd_ = ::open(options_.root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat("root: open ", options_.root, ": ", std::strerror(errno)));
  }

  absl::StatusOr<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options_.io);
  if (!engine.ok()) return engine.status();
  engine_ = *std::move(engine);

  const size_t nblocks = options_.max_inflight_objects;
  constexpr uint64_t kSlotBytes = kBlock + kTailProbe;
  blocks_ = static_cast<uint8_t*>(std::aligned_alloc(kBlock, nblocks * kSlotBytes));
  if (blocks_ == nullptr) return absl::ResourceExhaustedError("header buffers");
  {
    absl::MutexLock lock(&mu_);
    free_blocks_.reserve(nblocks);
    for (size_t i = 0; i < nblocks; ++i) free_blocks_.push_back(blocks_ + i * kSlotBytes);
  }

  sweeper_ = std::thread([this] { SweepThread(); });

  // The scan: as much as the budget allows here, the rest in the background.
  const absl::Time start = absl::Now();
  if (ScanUntil(start + options_.startup_scan_budget)) {
    PublishScan();
  } else {
    scanner_ = std::thread([this] { ScanThread(); });
  }
  KVLOG(Info, "file backend open",
        {{"root", options_.root},
         {"engine", engine_->name()},
         {"shared", options_.shared ? "true" : "false"},
         {"capacity_bytes", options_.capacity_bytes},
         {"scan_in_background", scanner_.joinable() ? "true" : "false"}});
  return absl::OkStatus();
}

FileBackend::Impl::~Impl() {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  stop_scan_.store(true);
  if (scanner_.joinable()) scanner_.join();
  {
    // Every batch completes: queued tasks are started as slots free up, or the sweeper fails them
    // at their deadline.
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](size_t* n) { return *n == 0; }, &batches_in_flight_));
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
  // Drains what is left (eviction unlinks) and joins the engine's threads.
  engine_.reset();
  if (root_fd_ >= 0) ::close(root_fd_);
  std::free(blocks_);
}

absl::Status FileBackend::Impl::CheckOpen(size_t items) const {
  if (items > options_.max_batch_items) {
    return absl::InvalidArgumentError(absl::StrCat("items: ", items, " exceeds max_batch_items ",
                                                   options_.max_batch_items));
  }
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("file backend is shutting down");
  return absl::OkStatus();
}

FileBackend::Impl::Batch* FileBackend::Impl::NewBatch(OpKind kind, const PageKey& ns,
                                                      absl::Duration timeout, size_t ntasks) {
  auto* b = new Batch;
  b->impl = this;
  b->kind = kind;
  b->ns = ns;
  b->deadline =
      absl::Now() + (timeout > absl::ZeroDuration() ? timeout : options_.default_timeout);
  b->ntasks = ntasks;
  b->tasks.reset(new Task[ntasks]);
  b->remaining.store(ntasks, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  ++batches_in_flight_;
  return b;
}

void FileBackend::Impl::InitTask(Batch* b, Task* t, uint32_t index, const PageKey& key,
                                 uint32_t shard) {
  t->batch = b;
  t->index = index;
  t->id = ObjKey{NsPrefix(b->ns), key, shard};
  t->op.context = t;
  t->op.done = &Impl::OnOpDone;
  FormatObjectPath(t->id.ns_prefix, key, shard, t->path);
}

// ---- Submission -------------------------------------------------------------------------------

absl::Status FileBackend::Impl::Get(const GetRequest& request, BatchCallback done) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    const GetItem& it = request.items[i];
    if (it.dst == nullptr || it.capacity == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: no destination buffer"));
    }
  }
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  SubmitScope scope;
  Batch* b = NewBatch(OpKind::kGet, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  if (b->ntasks == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  absl::InlinedVector<Task*, 16> misses;
  {
    absl::MutexLock lock(&mu_);
    const bool authoritative = Authoritative();
    for (size_t i = 0; i < b->ntasks; ++i) {
      Task* t = &b->tasks[i];
      const GetItem& it = request.items[i];
      InitTask(b, t, static_cast<uint32_t>(i), it.key, it.shard);
      t->buf = it.dst;
      t->len = it.capacity;
      if (authoritative && !index_.Contains(t->id)) {
        misses.push_back(t);
        continue;
      }
      t->next = nullptr;
      if (queue_tail_ == nullptr) queue_head_ = t; else queue_tail_->next = t;
      queue_tail_ = t;
    }
  }
  for (Task* t : misses) Finish(t, ObjectStatus::kNotFound);
  Pump();
  return absl::OkStatus();
}

absl::Status FileBackend::Impl::Put(const PutRequest& request, BatchCallback done) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    const PutItem& it = request.items[i];
    if (it.src == nullptr || it.size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: empty source buffer"));
    }
  }
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  SubmitScope scope;
  Batch* b = NewBatch(OpKind::kPut, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  if (b->ntasks == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  absl::InlinedVector<Task*, 16> rejected;
  absl::InlinedVector<ObjKey, 8> victims;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < b->ntasks; ++i) {
      Task* t = &b->tasks[i];
      const PutItem& it = request.items[i];
      InitTask(b, t, static_cast<uint32_t>(i), it.key, it.shard);
      t->buf = const_cast<uint8_t*>(it.src);  // Only ever written from.
      t->len = it.size;
      const uint64_t bytes = FileBytes(it.size);
      if (it.size > options_.max_object_bytes || !ReserveLocked(bytes, &victims)) {
        rejected.push_back(t);
        continue;
      }
      t->reserved = bytes;
      t->next = nullptr;
      if (queue_tail_ == nullptr) queue_head_ = t; else queue_tail_->next = t;
      queue_tail_ = t;
    }
  }
  UnlinkVictims(victims);
  for (Task* t : rejected) Finish(t, ObjectStatus::kRejected);
  Pump();
  return absl::OkStatus();
}

absl::Status FileBackend::Impl::Delete(const DeleteRequest& request, BatchCallback done) {
  if (absl::Status s = CheckOpen(request.items.size()); !s.ok()) return s;
  SubmitScope scope;
  Batch* b = NewBatch(OpKind::kDelete, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  if (b->ntasks == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < b->ntasks; ++i) {
      Task* t = &b->tasks[i];
      InitTask(b, t, static_cast<uint32_t>(i), request.items[i].key, request.items[i].shard);
      t->next = nullptr;
      if (queue_tail_ == nullptr) queue_head_ = t; else queue_tail_->next = t;
      queue_tail_ = t;
    }
  }
  Pump();
  return absl::OkStatus();
}

absl::Status FileBackend::Impl::Exists(const ExistsRequest& request, ExistsCallback done) {
  if (request.shards.empty() && !request.keys.empty()) {
    return absl::InvalidArgumentError("shards: empty");
  }
  const size_t nobj = request.keys.size() * request.shards.size();
  if (absl::Status s = CheckOpen(nobj); !s.ok()) return s;
  SubmitScope scope;
  Batch* b = NewBatch(OpKind::kExists, request.ns, request.timeout, nobj);
  b->exists_done = std::move(done);
  b->nkeys = request.keys.size();
  b->nshards = request.shards.size();
  b->presence.assign(nobj, kPending);
  if (nobj == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  // Known objects answer from the index; an unknown one (scan running, or shared directory) costs
  // a statx, unless the index is authoritative.
  absl::InlinedVector<Task*, 16> settled;
  {
    absl::MutexLock lock(&mu_);
    const bool authoritative = Authoritative();
    for (size_t k = 0; k < b->nkeys; ++k) {
      for (size_t s = 0; s < b->nshards; ++s) {
        const size_t i = k * b->nshards + s;
        Task* t = &b->tasks[i];
        InitTask(b, t, static_cast<uint32_t>(i), request.keys[k], request.shards[s]);
        if (index_.Contains(t->id) || authoritative) {
          b->presence[i] = index_.Contains(t->id) ? kPresent : kAbsent;
          settled.push_back(t);
        } else {
          // Unknown to the index: every such object is stat-ed at once (one round, also on a
          // network file system), and the prefix is computed when all have answered.
          t->next = nullptr;
          if (queue_tail_ == nullptr) queue_head_ = t; else queue_tail_->next = t;
          queue_tail_ = t;
        }
      }
    }
  }
  for (Task* t : settled) {
    const Presence p = static_cast<Presence>(b->presence[t->index]);
    Finish(t, p == kPresent ? ObjectStatus::kOk : ObjectStatus::kNotFound);
  }
  Pump();
  return absl::OkStatus();
}

// Starts queued tasks while I/O slots are free. Called after submissions and completions.
void FileBackend::Impl::Pump() {
  constexpr size_t kSubmitBatch = 32;
  IoOp* ops[kSubmitBatch];
  size_t nops = 0;
  const absl::Time now = absl::Now();
  for (;;) {
    Task* t;
    {
      absl::MutexLock lock(&mu_);
      if (queue_head_ == nullptr || free_blocks_.empty()) break;
      t = queue_head_;
      queue_head_ = t->next;
      if (queue_head_ == nullptr) queue_tail_ = nullptr;
      t->next = nullptr;
      t->block = free_blocks_.back();
      free_blocks_.pop_back();
    }
    if (now > t->batch->deadline) {
      FinishExpired(t);
      continue;
    }
    StartTask(t, ops, &nops);
    if (nops == kSubmitBatch) {
      engine_->Submit(absl::MakeConstSpan(ops, nops));
      nops = 0;
    }
  }
  if (nops > 0) engine_->Submit(absl::MakeConstSpan(ops, nops));
}

void FileBackend::Impl::StartTask(Task* t, IoOp** out, size_t* nout) {
  const bool aligned = reinterpret_cast<uintptr_t>(t->buf) % kBlock == 0 && t->len % kBlock == 0;
  t->direct = aligned && direct_ok_.load(std::memory_order_relaxed);
  switch (t->batch->kind) {
    case OpKind::kGet:
      t->stage = kOpen;
      PrepOpen(t, t->path, O_RDONLY);
      break;
    case OpKind::kPut: {
      std::snprintf(t->tmp, sizeof(t->tmp), "%.100s%s%.64s-%d-%llu", t->path, kTempMarker,
                    host_id_.c_str(), static_cast<int>(pid_),
                    static_cast<unsigned long long>(temp_seq_.fetch_add(1)));
      t->stage = kOpen;
      PrepOpen(t, t->tmp, O_WRONLY | O_CREAT | O_EXCL);
      break;
    }
    case OpKind::kDelete:
      t->stage = kUnlink;
      t->op.code = IoOp::Code::kUnlinkAt;
      t->op.fd = root_fd_;
      t->op.path = t->path;
      t->op.flags = 0;
      break;
    case OpKind::kExists:
      t->stage = kStatx;
      t->op.code = IoOp::Code::kStatx;
      t->op.fd = root_fd_;
      t->op.path = t->path;
      t->op.flags = AT_SYMLINK_NOFOLLOW;
      t->op.mode = STATX_SIZE | STATX_TYPE;
      t->op.statx_buf = &t->stx;
      break;
  }
  out[(*nout)++] = &t->op;
}

void FileBackend::Impl::PrepOpen(Task* t, const char* path, int flags) {
  t->op.code = IoOp::Code::kOpenAt;
  t->op.fd = root_fd_;
  t->op.path = path;
  t->op.flags = flags | O_CLOEXEC | (t->direct ? O_DIRECT : 0);
  t->op.mode = kObjectMode;
}

void FileBackend::Impl::PrepSimple(Task* t, IoOp::Code code, Stage stage) {
  t->stage = stage;
  t->op.code = code;
  t->op.fd = t->fd;
  t->op.datasync = true;
}

// The rest of a transfer over [header block][buf, len][tail probe], from io_done to io_total: a
// Get's io_total takes in the probe, a Put's ends with the payload.
void FileBackend::Impl::PrepTransferRest(Task* t, IoOp::Code code) {
  const struct {
    uint8_t* base;
    uint64_t bytes;
  } parts[3] = {{t->block, kBlock}, {t->buf, t->len}, {t->block + kBlock, kTailProbe}};
  int n = 0;
  uint64_t start = 0;  // File offset of the part.
  for (const auto& part : parts) {
    const uint64_t end = std::min(start + part.bytes, t->io_total);
    if (t->io_done < end) {
      const uint64_t from = std::max(t->io_done, start);
      t->iov[n++] = {part.base + (from - start), end - from};
    }
    start += part.bytes;
  }
  t->op.code = code;
  t->op.fd = t->fd;
  t->op.offset = t->io_done;
  t->op.iov = t->iov;
  t->op.iovcnt = n;
}

void FileBackend::Impl::PrepReadRest(Task* t) { PrepTransferRest(t, IoOp::Code::kReadv); }

void FileBackend::Impl::PrepWriteRest(Task* t) { PrepTransferRest(t, IoOp::Code::kWritev); }

void FileBackend::Impl::FinishExpired(Task* t) {
  t->batch->deadline_exceeded.store(true, std::memory_order_relaxed);
  if (t->batch->kind == OpKind::kExists) t->batch->presence[t->index] = kUnknownTimeout;
  Finish(t, ObjectStatus::kRetry);
}

void FileBackend::Impl::Finish(Task* t, ObjectStatus status) {
  Batch* b = t->batch;
  if (t->block != nullptr || t->reserved != 0) {
    absl::MutexLock lock(&mu_);
    if (t->block != nullptr) free_blocks_.push_back(t->block);
    reserved_bytes_ -= t->reserved;
  }
  t->block = nullptr;
  t->reserved = 0;
  if (b->kind == OpKind::kExists) {
    if (b->presence[t->index] == kPending) {
      b->presence[t->index] = status == ObjectStatus::kOk          ? kPresent
                              : status == ObjectStatus::kNotFound ? kAbsent
                                                                  : kUnknownError;
    }
  } else {
    b->results[t->index] = ItemResult{status, status == ObjectStatus::kOk ? t->payload : 0};
  }
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) CompleteBatch(b);
}

void FileBackend::Impl::CompleteBatch(Batch* b) {
  if (tls_submitting > 0) {
    b->hop.code = IoOp::Code::kNop;
    b->hop.context = b;
    b->hop.done = &Impl::OnHop;
    engine_->Submit(&b->hop);
    return;
  }
  Deliver(b);
}

void FileBackend::Impl::OnHop(IoOp* op) {
  auto* b = static_cast<Batch*>(op->context);
  b->impl->Deliver(b);
}

void FileBackend::Impl::Deliver(Batch* b) {
  const bool late = b->deadline_exceeded.load(std::memory_order_relaxed);
  if (b->kind == OpKind::kExists) {
    ExistsResult r;
    r.present_prefix = b->nkeys;
    for (size_t k = 0; k < b->nkeys && r.present_prefix == b->nkeys; ++k) {
      for (size_t s = 0; s < b->nshards; ++s) {
        const uint8_t p = b->presence[k * b->nshards + s];
        if (p == kPresent) continue;
        r.present_prefix = k;
        r.status = p == kAbsent            ? ObjectStatus::kOk
                   : p == kUnknownTimeout ? ObjectStatus::kRetry
                                          : ObjectStatus::kDeviceError;
        if (p != kAbsent) break;  // An unknown shard decides the status; keep looking for one.
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

// ---- Completions ------------------------------------------------------------------------------

void FileBackend::Impl::OnOpDone(IoOp* op) {
  auto* t = static_cast<Task*>(op->context);
  Impl* impl = t->batch->impl;
  impl->Advance(t, op->result);
  impl->Pump();
}

void FileBackend::Impl::Advance(Task* t, int64_t res) {
  switch (t->batch->kind) {
    case OpKind::kGet: return AdvanceGet(t, res);
    case OpKind::kPut: return AdvancePut(t, res);
    case OpKind::kDelete: return AdvanceDelete(t, res);
    case OpKind::kExists: return AdvanceExists(t, res);
  }
}

void FileBackend::Impl::AdvanceGet(Task* t, int64_t res) {
  switch (t->stage) {
    case kOpen:
      if (res < 0) {
        if (res == -EINVAL && t->direct) {
          DisableDirect(EINVAL);
          t->direct = false;
          PrepOpen(t, t->path, O_RDONLY);
          return Submit(t);
        }
        if (res == -ENOENT) Forget(t->id);
        return Finish(t, StatusFromErrno(static_cast<int>(-res)));
      }
      t->fd = static_cast<int>(res);
      t->stage = kRead;
      t->io_done = 0;
      t->io_total = kBlock + t->len + kTailProbe;
      PrepReadRest(t);
      return Submit(t);

    case kRead: {
      if (res < 0) {
        t->status = StatusFromErrno(static_cast<int>(-res));
        if (t->status == ObjectStatus::kNotFound) t->status = ObjectStatus::kDeviceError;
        PrepSimple(t, IoOp::Code::kClose, kClose);
        return Submit(t);
      }
      t->io_done += static_cast<uint64_t>(res);
      // A short read before EOF (network file systems may return one) continues, but only as far
      // as the header says the object goes: a slot larger than the object must not cost a
      // second read just to see EOF. (So bytes after the payload go unseen only when a short
      // read happens to end exactly where the payload does.)
      if (res > 0 && t->io_done >= kBlock && t->io_done < t->io_total &&
          (!t->direct || t->io_done % kBlock == 0)) {
        ObjectHeader h;
        if (DecodeObjectHeader(t->block, kBlock, &h) == ObjectDefect::kNone &&
            h.payload_bytes <= t->len && t->io_done < kBlock + h.payload_bytes) {
          PrepReadRest(t);
          return Submit(t);
        }
      }
      // Everything read past the header block counts as payload, the probe included: bytes
      // after the payload are a size mismatch like any other (VerifyObject).
      const uint64_t header_bytes = std::min<uint64_t>(t->io_done, kBlock);
      const uint64_t payload_bytes = t->io_done > kBlock ? t->io_done - kBlock : 0;
      ExpectedObject expected;
      expected.ns = &t->batch->ns;
      expected.key = &t->id.key;
      expected.shard = t->id.shard;
      expected.capacity = t->len;
      ObjectHeader h;
      t->defect = VerifyObject(t->block, header_bytes, expected, t->buf, payload_bytes, &h);
      if (t->defect == ObjectDefect::kNone) {
        t->status = ObjectStatus::kOk;
        t->payload = h.payload_bytes;
      } else {
        t->status = ObjectStatus::kChecksumError;
      }
      PrepSimple(t, IoOp::Code::kClose, kClose);
      return Submit(t);
    }

    case kClose:
      t->fd = -1;
      if (t->status == ObjectStatus::kChecksumError) {
        t->stage = kUnlinkCorrupt;
        t->op.code = IoOp::Code::kUnlinkAt;
        t->op.fd = root_fd_;
        t->op.path = t->path;
        t->op.flags = 0;
        return Submit(t);
      }
      if (t->status == ObjectStatus::kOk) {
        absl::InlinedVector<ObjKey, 8> victims;
        {
          absl::MutexLock lock(&mu_);
          if (Authoritative()) {
            // Absent from a complete index means evicted or deleted while we read: keep it out.
            index_.Touch(t->id);
          } else {
            // Found on disk (written by another node, or not scanned yet): now we know it.
            const uint64_t bytes = FileBytes(t->payload);
            const uint64_t old = index_.UpsertHot(t->id, bytes);
            used_bytes_ += bytes;
            used_bytes_ -= old;
            EvictOverCapacityLocked(&victims);
          }
        }
        UnlinkVictims(victims);
      }
      return Finish(t, t->status);

    case kUnlinkCorrupt:
      CountCorrupt(t);
      return Finish(t, ObjectStatus::kChecksumError);

    default:
      return Finish(t, ObjectStatus::kDeviceError);
  }
}

void FileBackend::Impl::AdvancePut(Task* t, int64_t res) {
  switch (t->stage) {
    case kOpen:
      if (res < 0) {
        if (res == -EINVAL && t->direct) {
          DisableDirect(EINVAL);
          t->direct = false;
          PrepOpen(t, t->tmp, O_WRONLY | O_CREAT | O_EXCL);
          return Submit(t);
        }
        if (res == -ENOENT && !t->made_dirs) {
          EnsureDirs(t);  // First write of this namespace or leaf: two mkdirs, once.
          t->made_dirs = true;
          return Submit(t);
        }
        ObjectStatus s = StatusFromErrno(static_cast<int>(-res));
        if (s == ObjectStatus::kNotFound) s = ObjectStatus::kDeviceError;
        return Finish(t, s);
      }
      t->fd = static_cast<int>(res);
      // Only where the umask took the owner's bits (never by default): a synchronous fchmod.
      if (chmod_after_create_) ::fchmod(t->fd, kObjectMode);
      std::memset(t->block, 0, kBlock);
      EncodeObjectHeader(MakeObjectHeader(t->batch->ns, t->id.key, t->id.shard, t->buf, t->len,
                                          static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()))),
                         t->block);
      t->stage = kWrite;
      t->io_done = 0;
      t->io_total = kBlock + t->len;
      PrepWriteRest(t);
      return Submit(t);

    case kWrite:
      if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
      t->io_done += static_cast<uint64_t>(res);
      if (t->io_done < t->io_total) {
        // A short write means the device filled up, unless a network file system split it; go
        // on while progress is possible and the offset suits the file's mode.
        if (res > 0 && (!t->direct || t->io_done % kBlock == 0)) {
          PrepWriteRest(t);
          return Submit(t);
        }
        return CleanupPut(t, ObjectStatus::kRejected);
      }
      if (options_.fsync != FsyncPolicy::kNone) {
        PrepSimple(t, IoOp::Code::kFsync, kSync);
      } else {
        PrepSimple(t, IoOp::Code::kClose, kClose);
      }
      return Submit(t);

    case kSync:
      if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
      PrepSimple(t, IoOp::Code::kClose, kClose);
      return Submit(t);

    case kClose:
      t->fd = -1;
      // NFS reports write-back errors at close.
      if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
      t->stage = kRename;
      t->op.code = IoOp::Code::kRenameAt;
      t->op.fd = root_fd_;
      t->op.path = t->tmp;
      t->op.path2 = t->path;
      return Submit(t);

    case kRename:
      if (res < 0) {
        ObjectStatus s = StatusFromErrno(static_cast<int>(-res));
        return CleanupPut(t, s == ObjectStatus::kNotFound ? ObjectStatus::kDeviceError : s);
      }
      if (options_.fsync == FsyncPolicy::kDataAndDirectory) {
        FormatLeafDir(t->id.ns_prefix, t->id.key, t->tmp);  // The temp name is spent.
        t->stage = kDirOpen;
        t->op.code = IoOp::Code::kOpenAt;
        t->op.fd = root_fd_;
        t->op.path = t->tmp;
        t->op.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
        return Submit(t);
      }
      Publish(t);
      return Finish(t, ObjectStatus::kOk);

    case kDirOpen:
      // The object is in place either way; a failed directory sync only weakens durability.
      if (res < 0) {
        Publish(t);
        return Finish(t, ObjectStatus::kOk);
      }
      t->fd = static_cast<int>(res);
      PrepSimple(t, IoOp::Code::kFsync, kDirSync);
      t->op.datasync = false;
      return Submit(t);

    case kDirSync:
      PrepSimple(t, IoOp::Code::kClose, kDirClose);
      return Submit(t);

    case kDirClose:
      t->fd = -1;
      Publish(t);
      return Finish(t, ObjectStatus::kOk);

    case kCleanupClose:
      t->fd = -1;
      t->stage = kCleanupUnlink;
      t->op.code = IoOp::Code::kUnlinkAt;
      t->op.fd = root_fd_;
      t->op.path = t->tmp;
      t->op.flags = 0;
      return Submit(t);

    case kCleanupUnlink:
      return Finish(t, t->status);

    default:
      return Finish(t, ObjectStatus::kDeviceError);
  }
}

// Closes (if open) and removes the temp file, then finishes with `status`.
void FileBackend::Impl::CleanupPut(Task* t, ObjectStatus status) {
  t->status = status;
  if (t->fd >= 0) {
    PrepSimple(t, IoOp::Code::kClose, kCleanupClose);
  } else {
    t->stage = kCleanupUnlink;
    t->op.code = IoOp::Code::kUnlinkAt;
    t->op.fd = root_fd_;
    t->op.path = t->tmp;
    t->op.flags = 0;
  }
  Submit(t);
}

void FileBackend::Impl::AdvanceDelete(Task* t, int64_t res) {
  if (res == 0 || res == -ENOENT) Forget(t->id);
  if (res == 0) return Finish(t, ObjectStatus::kOk);
  Finish(t, StatusFromErrno(static_cast<int>(-res)));
}

void FileBackend::Impl::AdvanceExists(Task* t, int64_t res) {
  Batch* b = t->batch;
  if (res == 0) {
    // A file shorter than a header block is a torn object: not present for Match.
    b->presence[t->index] =
        S_ISREG(t->stx.stx_mode) && t->stx.stx_size >= kBlock ? kPresent : kAbsent;
  } else {
    b->presence[t->index] = res == -ENOENT ? kAbsent : kUnknownError;
  }
  Finish(t, ObjectStatus::kOk);  // Presence carries the answer.
}

void FileBackend::Impl::DisableDirect(int err) {
  if (direct_ok_.exchange(false)) {
    KVLOG(Warn, "file system refused O_DIRECT, using buffered I/O",
          {{"root", options_.root}, {"errno", err}});
  }
}

void FileBackend::Impl::EnsureDirs(Task* t) {
  char dir[kMaxRelPath];
  char* end = FormatLeafDir(t->id.ns_prefix, t->id.key, dir);
  end[-3] = '\0';  // "<ns16>"
  MakeDir(root_fd_, dir);
  end[-3] = '/';
  MakeDir(root_fd_, dir);
}

// mkdirat with kDirMode exactly, whatever the umask. Returns mkdirat's result, errno with it.
int FileBackend::Impl::MakeDir(int dirfd, const char* path) const {
  if (::mkdirat(dirfd, path, kDirMode) != 0) return -1;
  if (chmod_after_create_) ::fchmodat(dirfd, path, kDirMode, 0);
  return 0;
}

void FileBackend::Impl::Publish(Task* t) {
  absl::MutexLock lock(&mu_);
  const uint64_t bytes = t->reserved;
  const uint64_t old = index_.UpsertHot(t->id, bytes);
  reserved_bytes_ -= bytes;
  used_bytes_ += bytes;
  used_bytes_ -= old;
  t->reserved = 0;
  t->payload = t->len;
  removed_during_scan_.erase(t->id);
}

void FileBackend::Impl::Forget(const ObjKey& id) {
  absl::MutexLock lock(&mu_);
  if (std::optional<uint64_t> bytes = index_.Remove(id)) used_bytes_ -= *bytes;
  NoteRemovedLocked(id);
}

void FileBackend::Impl::NoteRemovedLocked(const ObjKey& id) {
  if (!index_complete_) removed_during_scan_.insert(id);
}

void FileBackend::Impl::CountCorrupt(Task* t) {
  Forget(t->id);
  stats_.corrupt_removed.fetch_add(1, std::memory_order_relaxed);
  // Rare and important: one line per object found bad.
  KVLOG(Warn, "l3 object corrupt, removed",
        {{"backend", name_}, {"path", t->path}, {"defect", ObjectDefectName(t->defect)}});
}

// ---- Capacity ---------------------------------------------------------------------------------

bool FileBackend::Impl::ReserveLocked(uint64_t bytes, absl::InlinedVector<ObjKey, 8>* victims) {
  const uint64_t cap = options_.capacity_bytes;
  if (cap != 0) {
    if (bytes > cap) return false;
    while (used_bytes_ + reserved_bytes_ + bytes > cap) {
      ObjKey id;
      uint64_t b;
      // Everything left is being written: the tier is full of in-flight writes.
      if (!index_.PopColdest(&id, &b)) return false;
      used_bytes_ -= b;
      NoteRemovedLocked(id);
      victims->push_back(id);
      stats_.evicted_objects.fetch_add(1, std::memory_order_relaxed);
      stats_.evicted_bytes.fetch_add(b, std::memory_order_relaxed);
    }
  }
  reserved_bytes_ += bytes;
  return true;
}

void FileBackend::Impl::EvictOverCapacityLocked(absl::InlinedVector<ObjKey, 8>* victims) {
  const uint64_t cap = options_.capacity_bytes;
  if (cap == 0) return;
  while (used_bytes_ + reserved_bytes_ > cap) {
    ObjKey id;
    uint64_t b;
    if (!index_.PopColdest(&id, &b)) return;
    used_bytes_ -= b;
    NoteRemovedLocked(id);
    victims->push_back(id);
    stats_.evicted_objects.fetch_add(1, std::memory_order_relaxed);
    stats_.evicted_bytes.fetch_add(b, std::memory_order_relaxed);
  }
}

void FileBackend::Impl::UnlinkVictims(const absl::InlinedVector<ObjKey, 8>& victims) {
  for (const ObjKey& id : victims) {
    EvictOp* e;
    {
      absl::MutexLock lock(&mu_);
      if (free_evict_ops_.empty()) {
        evict_ops_.push_back(std::make_unique<EvictOp>());
        free_evict_ops_.push_back(evict_ops_.back().get());
      }
      e = free_evict_ops_.back();
      free_evict_ops_.pop_back();
    }
    e->impl = this;
    FormatObjectPath(id.ns_prefix, id.key, id.shard, e->path);
    e->op = IoOp{};
    e->op.code = IoOp::Code::kUnlinkAt;
    e->op.fd = root_fd_;
    e->op.path = e->path;
    e->op.context = e;
    e->op.done = &Impl::OnEvicted;
    engine_->Submit(&e->op);
  }
}

void FileBackend::Impl::OnEvicted(IoOp* op) {
  auto* e = static_cast<EvictOp*>(op->context);
  absl::MutexLock lock(&e->impl->mu_);
  e->impl->free_evict_ops_.push_back(e);
}

// ---- Startup scan -----------------------------------------------------------------------------

bool FileBackend::Impl::ScanUntil(absl::Time until) {
  ScanState& s = scan_;
  if (!s.listed_root) {
    DIR* d = ::fdopendir(::openat(root_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d != nullptr) {
      while (dirent* de = ::readdir(d)) {
        absl::string_view n = de->d_name;
        uint8_t ns8[8];
        if (n.size() == 16 && ParseHex(n, ns8)) s.ns_dirs.emplace_back(n);
      }
      ::closedir(d);
    }
    s.listed_root = true;
  }
  for (;;) {
    if (stop_scan_.load(std::memory_order_relaxed)) return false;
    if (s.leaves.empty()) {
      if (s.ns_next == s.ns_dirs.size()) return true;
      const std::string& ns_dir = s.ns_dirs[s.ns_next++];
      int fd = ::openat(root_fd_, ns_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      DIR* d = fd >= 0 ? ::fdopendir(fd) : nullptr;
      if (d == nullptr) {
        if (fd >= 0) ::close(fd);
        continue;
      }
      while (dirent* de = ::readdir(d)) {
        absl::string_view n = de->d_name;
        uint8_t kk;
        if (n.size() == 2 && ParseHex(n, &kk)) s.leaves.emplace_back(n);
      }
      ::closedir(d);
      continue;
    }
    const std::string& ns_dir = s.ns_dirs[s.ns_next - 1];
    uint8_t ns8[8];
    ParseHex(ns_dir, ns8);
    uint64_t ns_prefix;
    std::memcpy(&ns_prefix, ns8, sizeof(ns_prefix));
    ScanLeaf(ns_dir, ns_prefix, s.leaves.back());
    s.leaves.pop_back();
    if (absl::Now() >= until) return false;
  }
}

void FileBackend::Impl::ScanLeaf(const std::string& ns_dir, uint64_t ns_prefix,
                                 const std::string& leaf) {
  const std::string rel = absl::StrCat(ns_dir, "/", leaf);
  int fd = ::openat(root_fd_, rel.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = fd >= 0 ? ::fdopendir(fd) : nullptr;
  if (d == nullptr) {
    if (fd >= 0) ::close(fd);
    return;
  }
  const int dfd = ::dirfd(d);
  while (dirent* de = ::readdir(d)) {
    absl::string_view n = de->d_name;
    if (n.size() < 66 || n[64] != '.') continue;
    ++scan_.entries_seen;
    struct stat st;
    if (::fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
      continue;
    }
    const int64_t mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
    const size_t marker = n.find(kTempMarker);
    if (marker != absl::string_view::npos) {
      if (IsStaleTemp(n.substr(marker + sizeof(kTempMarker) - 1), mtime_ns) &&
          ::unlinkat(dfd, de->d_name, 0) == 0) {
        ++scan_.temps_removed;
      }
      continue;
    }
    ScanState::Found f;
    f.id.ns_prefix = ns_prefix;
    uint32_t shard;
    if (!ParseHex(n.substr(0, 64), f.id.key.bytes.data()) || !ParseU32(n.substr(65), &shard)) {
      continue;
    }
    f.id.shard = shard;
    f.bytes = RoundUp(static_cast<uint64_t>(st.st_size), kBlock);
    f.mtime_ns = mtime_ns;
    scan_.found.push_back(f);
  }
  ::closedir(d);
}

// `suffix` is "<host>-<pid>-<seq>" from a temp file name.
bool FileBackend::Impl::IsStaleTemp(absl::string_view suffix, int64_t mtime_ns) const {
  const int64_t age_ns = absl::GetCurrentTimeNanos() - mtime_ns;
  if (age_ns > absl::ToInt64Nanoseconds(options_.stale_temp_age)) return true;
  const size_t seq_dash = suffix.rfind('-');
  if (seq_dash == absl::string_view::npos || seq_dash == 0) return false;
  const size_t pid_dash = suffix.rfind('-', seq_dash - 1);
  if (pid_dash == absl::string_view::npos) return false;
  const absl::string_view host = suffix.substr(0, pid_dash);
  uint32_t pid;
  if (host != host_id_ || !ParseU32(suffix.substr(pid_dash + 1, seq_dash - pid_dash - 1), &pid)) {
    return false;  // Another node's writer: only age can tell it is gone.
  }
  if (static_cast<pid_t>(pid) == pid_) return false;  // Ours, maybe in flight.
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// Indexes what the scan found, oldest coldest, then enforces the capacity.
void FileBackend::Impl::PublishScan() {
  std::vector<ScanState::Found>& found = scan_.found;
  std::sort(found.begin(), found.end(),
            [](const ScanState::Found& a, const ScanState::Found& b) {
              return a.mtime_ns > b.mtime_ns;
            });
  size_t indexed = 0;
  for (size_t i = 0; i < found.size(); i += kScanInsertChunk) {
    absl::MutexLock lock(&mu_);
    const size_t end = std::min(found.size(), i + kScanInsertChunk);
    for (size_t j = i; j < end; ++j) {
      // Newest first, each to the cold end: the oldest ends up coldest. Skips what this process
      // wrote (newer) or removed since the scan listed it.
      if (removed_during_scan_.contains(found[j].id)) continue;
      if (index_.InsertCold(found[j].id, found[j].bytes)) {
        used_bytes_ += found[j].bytes;
        ++indexed;
      }
    }
  }
  absl::InlinedVector<ObjKey, 8> victims;
  {
    absl::MutexLock lock(&mu_);
    index_complete_ = true;
    removed_during_scan_.clear();
    EvictOverCapacityLocked(&victims);
  }
  UnlinkVictims(victims);
  KVLOG(Info, "file backend index rebuilt",
        {{"root", options_.root},
         {"objects", indexed},
         {"temps_removed", scan_.temps_removed},
         {"evicted", victims.size()}});
  found.clear();
  found.shrink_to_fit();
}

void FileBackend::Impl::ScanThread() {
  if (ScanUntil(absl::InfiniteFuture())) PublishScan();
}

bool FileBackend::Impl::WaitForIndex(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&index_complete_), timeout);
}

// ---- Deadlines --------------------------------------------------------------------------------

// Queued tasks whose batch deadline passed are failed here, so that a batch stuck behind slow
// I/O still completes on time (up to the I/O it already has in flight, see backend.h).
void FileBackend::Impl::SweepThread() {
  for (;;) {
    Task* expired = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Impl::SweepWake));
      if (stopping_) return;
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), kSweepPeriod);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      Task** link = &queue_head_;
      Task* prev = nullptr;
      while (*link != nullptr) {
        Task* t = *link;
        if (now > t->batch->deadline) {
          *link = t->next;
          t->next = expired;
          expired = t;
        } else {
          prev = t;
          link = &t->next;
        }
      }
      queue_tail_ = prev;
    }
    while (expired != nullptr) {
      Task* t = expired;
      expired = t->next;
      t->next = nullptr;
      FinishExpired(t);
    }
  }
}

BackendStats FileBackend::Impl::Stats() const {
  BackendStats s;
  stats_.Snapshot(&s);
  absl::MutexLock lock(&mu_);
  s.used_bytes = used_bytes_;
  s.capacity_bytes = options_.capacity_bytes;
  s.indexed_objects = index_.size();
  s.index_complete = index_complete_;
  return s;
}

// ---- FileBackend ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FileBackend>> FileBackend::Open(const FileBackendOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<FileBackend>(new FileBackend(std::move(impl)));
}

FileBackend::FileBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FileBackend::~FileBackend() = default;

absl::string_view FileBackend::name() const { return impl_->name(); }

Capabilities FileBackend::capabilities() const {
  Capabilities c;
  c.shared_across_nodes = impl_->options().shared;
  c.max_object_bytes = impl_->options().max_object_bytes;
  c.persistent = true;
  c.max_batch_items = impl_->options().max_batch_items;
  return c;
}

absl::Status FileBackend::Exists(const ExistsRequest& request, ExistsCallback done) {
  return impl_->Exists(request, std::move(done));
}
absl::Status FileBackend::Get(const GetRequest& request, BatchCallback done) {
  return impl_->Get(request, std::move(done));
}
absl::Status FileBackend::Put(const PutRequest& request, BatchCallback done) {
  return impl_->Put(request, std::move(done));
}
absl::Status FileBackend::Delete(const DeleteRequest& request, BatchCallback done) {
  return impl_->Delete(request, std::move(done));
}
BackendStats FileBackend::Stats() const { return impl_->Stats(); }
bool FileBackend::WaitForIndex(absl::Duration timeout) const {
  return impl_->WaitForIndex(timeout);
}
absl::string_view FileBackend::io_engine_name() const { return impl_->engine_name(); }

std::string FileBackend::ObjectPath(const PageKey& ns, const PageKey& key, uint32_t shard) {
  char buf[kMaxRelPath];
  FormatObjectPath(NsPrefix(ns), key, shard, buf);
  return buf;
}

}  // namespace kvcellar::storage
