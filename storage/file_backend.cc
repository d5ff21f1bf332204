#include "storage/file_backend.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "storage/backend_batch.h"
#include "storage/file_capacity.h"
#include "storage/file_layout.h"
#include "storage/file_modes.h"
#include "storage/file_startup_scan.h"
#include "storage/result_handoff.h"

namespace kvcellar::storage {
namespace {

constexpr uint64_t kBlock = kFileHeaderBlockBytes;
// Scanned objects enter the index in chunks, so the lock is never held for a whole directory tree.
constexpr size_t kScanInsertChunk = 4096;
// How often the sweeper looks for queued objects past their deadline while the queue is not empty.
constexpr absl::Duration kSweepPeriod = absl::Milliseconds(2);
// Ops handed to the engine in one Submit by Pump.
constexpr size_t kSubmitBatch = 32;

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

class FileBackendImpl final : public FileBackend, private FileObjectIo::Listener {
 public:
  explicit FileBackendImpl(const FileBackendOptions& options)
      : options_(options), capacity_(options.capacity_bytes, options.shared, &stats_) {}
  ~FileBackendImpl() override;

  absl::Status Init();

  absl::string_view name() const override { return name_; }
  Capabilities capabilities() const override;
  absl::Status Exists(const ExistsRequest& request, ExistsCallback done) override;
  absl::Status Get(const GetRequest& request, BatchCallback done) override;
  absl::Status Put(const PutRequest& request, BatchCallback done) override;
  absl::Status Delete(const DeleteRequest& request, BatchCallback done) override;
  BackendStats Stats() const override;
  bool WaitForIndex(absl::Duration timeout) const override;
  void SetScanSink(FileScanSink sink) override;
  void SetRemovalSink(FileRemovalSink sink) override;
  absl::string_view io_engine_name() const override { return engine_->name(); }

 private:
  struct Batch;

  // One object of a batch: its I/O, and its place in the batch and in the queue for I/O slots.
  struct Task : FileIoTask {
    Batch* batch = nullptr;
    uint32_t index = 0;     // Request item (Exists: key * shards + shard).
    uint64_t reserved = 0;  // Put: bytes reserved against capacity until published.
    Task* next = nullptr;   // Queue link.
  };

  struct Batch : BatchState {
    FileBackendImpl* impl = nullptr;
    std::unique_ptr<Task[]> tasks;
    size_t ntasks = 0;
    std::atomic<size_t> remaining{0};  // Tasks not finished.
    IoOp hop;  // Carries the callback onto an engine thread when needed.
  };

  // An unlink of an evicted object, in flight.
  struct EvictOp {
    IoOp op;
    FileBackendImpl* impl = nullptr;
    char path[kMaxRelPath];
  };

  // Open.
  absl::Status MakeRoot(const FileModes& modes);
  absl::Status AllocateSlots();
  void StartScan();

  // Submission.
  template <typename Request>
  absl::Status Admit(const Request& request) const;
  Batch* NewBatch(OpKind kind, const PageKey& ns, absl::Duration timeout, size_t ntasks);
  void InitTask(Batch* b, Task* t, uint32_t index, const PageKey& key, uint32_t shard);
  // Get, Put and Delete: each item is admitted by AdmitLocked, then queued for I/O or settled.
  template <typename RequestItem>
  absl::Status SubmitItems(OpKind kind, const ItemsRequest<RequestItem>& request,
                           BatchCallback done);
  // Prepares a task for I/O; kOk to queue it, or the status it is settled with at once.
  ObjectStatus AdmitLocked(Task* t, const GetItem& item, FileVictims* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ObjectStatus AdmitLocked(Task* t, const PutItem& item, FileVictims* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ObjectStatus AdmitLocked(Task* t, const ObjectRef& item, FileVictims* victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueLocked(Task* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Pump();

  // Completion.
  static void OnOpDone(IoOp* op);
  void OnObjectDone(FileIoTask* io, ObjectStatus status) override;
  void Finish(Task* t, ObjectStatus status);
  void FinishExpired(Task* t);
  void CompleteBatch(Batch* b);
  static void OnHop(IoOp* op);
  void Deliver(Batch* b);

  // What the I/O found, into the index.
  void NoteRead(const Task* t);
  void Publish(Task* t);
  void Forget(const FileObjectId& id);
  void CountCorrupt(const Task* t);
  // Unlinks objects evicted for the capacity; `announce`: tells the removal sink (not for the
  // startup scan's, which never reached the daemon's index).
  void UnlinkVictims(const FileVictims& victims, bool announce = true);
  void AnnounceRemoved(absl::Span<const FileObjectId> removed);
  static void OnEvicted(IoOp* op);

  // Startup scan.
  void PublishScan();
  void ScanThread();

  void SweepThread();
  bool SweepWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || queue_head_ != nullptr;
  }

  const FileBackendOptions options_;
  std::string name_;
  std::string host_id_;
  int root_fd_ = -1;
  const pid_t pid_ = getpid();
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<FileObjectIo> io_;
  StatsCounters stats_;
  // max_inflight_objects slots of kFileIoSlotBytes, 4 KiB-aligned.
  uint8_t* blocks_ = nullptr;
  std::thread scanner_;
  std::thread sweeper_;
  std::atomic<bool> stop_scan_{false};
  // Owned by Init's thread, then by the scanner thread alone.
  std::unique_ptr<FileStartupScan> scan_;
  InFlightBatches in_flight_{"file backend"};
  absl::Time opened_at_;

  // The scan's result until a sink takes it. Apart from mu_: the sink inserts into the daemon's
  // index, and SetScanSink(nullptr) waits it out without stalling I/O.
  ResultHandoff<FileScanResult> scan_handoff_;
  // Apart from mu_ too: the sink updates the daemon's index. Held while the sink runs, so that
  // SetRemovalSink(nullptr) returns once no call is under way.
  absl::Mutex removal_mu_;
  FileRemovalSink removal_sink_ ABSL_GUARDED_BY(removal_mu_);

  mutable absl::Mutex mu_;
  FileCapacity capacity_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> free_blocks_ ABSL_GUARDED_BY(mu_);
  Task* queue_head_ ABSL_GUARDED_BY(mu_) = nullptr;  // Waiting for an I/O slot, FIFO.
  Task* queue_tail_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<EvictOp*> free_evict_ops_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<EvictOp>> evict_ops_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// ---- Open and close ---------------------------------------------------------------------------

absl::Status FileBackendImpl::Init() {
  opened_at_ = absl::Now();
  if (options_.root.empty()) return absl::InvalidArgumentError("root: empty");
  if (options_.max_inflight_objects == 0) {
    return absl::InvalidArgumentError("max_inflight_objects: must be at least 1");
  }
  name_ = absl::StrCat("file:", options_.root);
  host_id_ = TempHostId(options_.host_id.empty() ? LocalHostId() : options_.host_id);
  const FileModes modes = FileModes::ForProcessUmask();
  if (absl::Status s = MakeRoot(modes); !s.ok()) return s;

  absl::StatusOr<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options_.io);
  if (!engine.ok()) return engine.status();
  engine_ = *std::move(engine);
  FileObjectIo::Options io;
  io.root = options_.root;
  io.root_fd = root_fd_;
  io.fsync = options_.fsync;
  io.direct_io = options_.direct_io;
  io.host_id = host_id_;
  io.pid = pid_;
  FileObjectIo::Listener* listener = this;  // A private base: converted here, inside the class.
  io_ = std::make_unique<FileObjectIo>(std::move(io), modes, engine_.get(), listener);
  if (absl::Status s = AllocateSlots(); !s.ok()) return s;

  sweeper_ = std::thread([this] { SweepThread(); });
  StartScan();
  KVLOG(Info, "file backend open",
        {{"root", options_.root},
         {"engine", engine_->name()},
         {"shared", options_.shared ? "true" : "false"},
         {"capacity_bytes", options_.capacity_bytes},
         {"scan_in_background", scanner_.joinable() ? "true" : "false"}});
  return absl::OkStatus();
}

// mkdir -p root, then opens it. Directories that exist keep their mode (an operator's choice);
// what the tier creates, from the first missing parent down, gets FileModes::kDirMode.
absl::Status FileBackendImpl::MakeRoot(const FileModes& modes) {
  for (size_t pos = 1; pos <= options_.root.size(); ++pos) {
    if (pos == options_.root.size() || options_.root[pos] == '/') {
      std::string prefix = options_.root.substr(0, pos);
      if (modes.MakeDir(AT_FDCWD, prefix.c_str()) != 0 && errno != EEXIST) {
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
  return absl::OkStatus();
}

absl::Status FileBackendImpl::AllocateSlots() {
  const size_t nblocks = options_.max_inflight_objects;
  blocks_ = static_cast<uint8_t*>(std::aligned_alloc(kBlock, nblocks * kFileIoSlotBytes));
  if (blocks_ == nullptr) return absl::ResourceExhaustedError("header buffers");
  absl::MutexLock lock(&mu_);
  free_blocks_.reserve(nblocks);
  for (size_t i = 0; i < nblocks; ++i) free_blocks_.push_back(blocks_ + i * kFileIoSlotBytes);
  return absl::OkStatus();
}

// As much of the scan as the budget allows here, the rest in the background.
void FileBackendImpl::StartScan() {
  scan_ = std::make_unique<FileStartupScan>(root_fd_, host_id_, pid_, options_.stale_temp_age,
                                            &stop_scan_);
  const absl::Time start = absl::Now();
  if (scan_->ScanUntil(start + options_.startup_scan_budget)) {
    PublishScan();
  } else {
    scanner_ = std::thread([this] { ScanThread(); });
  }
}

FileBackendImpl::~FileBackendImpl() {
  in_flight_.Close();
  stop_scan_.store(true);
  if (scanner_.joinable()) scanner_.join();
  // Every batch completes: queued tasks are started as slots free up, or the sweeper fails them
  // at their deadline.
  in_flight_.WaitIdle();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
  // Drains what is left (eviction unlinks) and joins the engine's threads.
  engine_.reset();
  if (root_fd_ >= 0) ::close(root_fd_);
  std::free(blocks_);
}

Capabilities FileBackendImpl::capabilities() const {
  Capabilities c;
  c.shared_across_nodes = options_.shared;
  c.max_object_bytes = options_.max_object_bytes;
  c.persistent = true;
  c.max_batch_items = options_.max_batch_items;
  return c;
}

// ---- Submission -------------------------------------------------------------------------------

template <typename Request>
absl::Status FileBackendImpl::Admit(const Request& request) const {
  if (absl::Status s = CheckRequest(request, options_.max_batch_items); !s.ok()) return s;
  return in_flight_.CheckOpen();
}

FileBackendImpl::Batch* FileBackendImpl::NewBatch(OpKind kind, const PageKey& ns,
                                                  absl::Duration timeout, size_t ntasks) {
  auto* b = new Batch;
  b->impl = this;
  b->kind = kind;
  b->ns = ns;
  b->deadline = BatchDeadline(timeout, options_.default_timeout);
  b->ntasks = ntasks;
  b->tasks.reset(new Task[ntasks]);
  b->remaining.store(ntasks, std::memory_order_relaxed);
  in_flight_.Add();
  return b;
}

void FileBackendImpl::InitTask(Batch* b, Task* t, uint32_t index, const PageKey& key,
                               uint32_t shard) {
  t->batch = b;
  t->index = index;
  t->kind = b->kind;
  t->ns = &b->ns;
  t->id = FileObjectId{NamespacePrefix(b->ns), key, shard};
  t->op.context = t;
  t->op.done = &FileBackendImpl::OnOpDone;
  FormatObjectPath(t->id.ns_prefix, key, shard, t->path);
}

void FileBackendImpl::EnqueueLocked(Task* t) {
  t->next = nullptr;
  if (queue_tail_ == nullptr) queue_head_ = t; else queue_tail_->next = t;
  queue_tail_ = t;
}

absl::Status FileBackendImpl::Get(const GetRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kGet, request, std::move(done));
}
absl::Status FileBackendImpl::Put(const PutRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kPut, request, std::move(done));
}
absl::Status FileBackendImpl::Delete(const DeleteRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kDelete, request, std::move(done));
}

template <typename RequestItem>
absl::Status FileBackendImpl::SubmitItems(OpKind kind, const ItemsRequest<RequestItem>& request,
                                          BatchCallback done) {
  if (absl::Status s = Admit(request); !s.ok()) return s;
  SubmitScope scope;
  Batch* b = NewBatch(kind, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  if (b->ntasks == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  absl::InlinedVector<std::pair<Task*, ObjectStatus>, 16> settled;
  FileVictims victims;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < b->ntasks; ++i) {
      Task* t = &b->tasks[i];
      const RequestItem& it = request.items[i];
      InitTask(b, t, static_cast<uint32_t>(i), it.key, it.shard);
      const ObjectStatus s = AdmitLocked(t, it, &victims);
      if (s == ObjectStatus::kOk) {
        EnqueueLocked(t);
      } else {
        settled.emplace_back(t, s);
      }
    }
  }
  UnlinkVictims(victims);
  for (const auto& [t, s] : settled) Finish(t, s);
  Pump();
  return absl::OkStatus();
}

// Once the index is authoritative, a miss costs no system call.
ObjectStatus FileBackendImpl::AdmitLocked(Task* t, const GetItem& item, FileVictims*) {
  t->buf = item.dst;
  t->len = item.capacity;
  const bool miss = capacity_.Authoritative() && !capacity_.Knows(t->id);
  return miss ? ObjectStatus::kNotFound : ObjectStatus::kOk;
}

// A write reserves its footprint first; one that does not fit is rejected.
ObjectStatus FileBackendImpl::AdmitLocked(Task* t, const PutItem& item, FileVictims* victims) {
  t->buf = const_cast<uint8_t*>(item.src);  // Only ever written from.
  t->len = item.size;
  t->parent = item.parent;
  const uint64_t bytes = FileFootprint(item.size);
  if (item.size > options_.max_object_bytes || !capacity_.Reserve(bytes, victims)) {
    return ObjectStatus::kRejected;
  }
  t->reserved = bytes;
  return ObjectStatus::kOk;
}

ObjectStatus FileBackendImpl::AdmitLocked(Task*, const ObjectRef&, FileVictims*) {
  return ObjectStatus::kOk;
}

absl::Status FileBackendImpl::Exists(const ExistsRequest& request, ExistsCallback done) {
  if (absl::Status s = Admit(request); !s.ok()) return s;
  const size_t nobj = ExistsObjectCount(request);
  SubmitScope scope;
  Batch* b = NewBatch(OpKind::kExists, request.ns, request.timeout, nobj);
  b->exists_done = std::move(done);
  b->nkeys = request.keys.size();
  b->nshards = request.shards.size();
  b->presence.assign(nobj, Presence::kPending);
  if (nobj == 0) {
    CompleteBatch(b);
    return absl::OkStatus();
  }
  // Known objects answer from the index; an unknown one (scan running, or shared directory) costs
  // a statx, unless the index is authoritative.
  absl::InlinedVector<Task*, 16> settled;
  {
    absl::MutexLock lock(&mu_);
    const bool authoritative = capacity_.Authoritative();
    for (size_t k = 0; k < b->nkeys; ++k) {
      for (size_t s = 0; s < b->nshards; ++s) {
        const size_t i = k * b->nshards + s;
        Task* t = &b->tasks[i];
        InitTask(b, t, static_cast<uint32_t>(i), request.keys[k], request.shards[s]);
        if (capacity_.Knows(t->id) || authoritative) {
          b->presence[i] = capacity_.Knows(t->id) ? Presence::kPresent : Presence::kAbsent;
          settled.push_back(t);
        } else {
          // Unknown to the index: every such object is stat-ed at once (one round, also on a
          // network file system), and the prefix is computed when all have answered.
          EnqueueLocked(t);
        }
      }
    }
  }
  for (Task* t : settled) {
    const bool present = b->presence[t->index] == Presence::kPresent;
    Finish(t, present ? ObjectStatus::kOk : ObjectStatus::kNotFound);
  }
  Pump();
  return absl::OkStatus();
}

// Starts queued tasks while I/O slots are free. Called after submissions and completions.
void FileBackendImpl::Pump() {
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
    io_->Start(t);
    ops[nops++] = &t->op;
    if (nops == kSubmitBatch) {
      engine_->Submit(absl::MakeConstSpan(ops, nops));
      nops = 0;
    }
  }
  if (nops > 0) engine_->Submit(absl::MakeConstSpan(ops, nops));
}

// ---- Completion -------------------------------------------------------------------------------

void FileBackendImpl::OnOpDone(IoOp* op) {
  auto* t = static_cast<Task*>(op->context);
  FileBackendImpl* impl = t->batch->impl;  // The batch may be gone after Advance.
  impl->io_->Advance(t, op->result);
  impl->Pump();
}

void FileBackendImpl::OnObjectDone(FileIoTask* io, ObjectStatus status) {
  auto* t = static_cast<Task*>(io);
  switch (t->kind) {
    case OpKind::kGet:
      if (status == ObjectStatus::kOk) NoteRead(t);
      if (status == ObjectStatus::kNotFound) Forget(t->id);
      if (status == ObjectStatus::kChecksumError) CountCorrupt(t);
      break;
    case OpKind::kPut:
      if (status == ObjectStatus::kOk) Publish(t);
      break;
    case OpKind::kDelete:
      if (status == ObjectStatus::kOk || status == ObjectStatus::kNotFound) Forget(t->id);
      break;
    case OpKind::kExists:
      break;
  }
  Finish(t, status);
}

void FileBackendImpl::FinishExpired(Task* t) {
  t->batch->deadline_exceeded.store(true, std::memory_order_relaxed);
  if (t->batch->kind == OpKind::kExists) t->batch->presence[t->index] = Presence::kUnknownTransient;
  Finish(t, ObjectStatus::kRetry);
}

void FileBackendImpl::Finish(Task* t, ObjectStatus status) {
  Batch* b = t->batch;
  if (t->block != nullptr || t->reserved != 0) {
    absl::MutexLock lock(&mu_);
    if (t->block != nullptr) free_blocks_.push_back(t->block);
    capacity_.Unreserve(t->reserved);
  }
  t->block = nullptr;
  t->reserved = 0;
  if (b->kind == OpKind::kExists) {
    if (b->presence[t->index] == Presence::kPending) {
      b->presence[t->index] = status == ObjectStatus::kOk         ? Presence::kPresent
                              : status == ObjectStatus::kNotFound ? Presence::kAbsent
                                                                  : Presence::kUnknownError;
    }
  } else {
    b->results[t->index] = ItemResult{status, status == ObjectStatus::kOk ? t->payload : 0};
  }
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) CompleteBatch(b);
}

void FileBackendImpl::CompleteBatch(Batch* b) {
  if (tls_submitting > 0) {
    b->hop.code = IoOp::Code::kNop;
    b->hop.context = b;
    b->hop.done = &FileBackendImpl::OnHop;
    engine_->Submit(&b->hop);
    return;
  }
  Deliver(b);
}

void FileBackendImpl::OnHop(IoOp* op) {
  auto* b = static_cast<Batch*>(op->context);
  b->impl->Deliver(b);
}

void FileBackendImpl::Deliver(Batch* b) {
  b->BatchState::Deliver(stats_);
  delete b;
  in_flight_.Remove();
}

// ---- What the I/O found, into the index -------------------------------------------------------

void FileBackendImpl::NoteRead(const Task* t) {
  FileVictims victims;
  {
    absl::MutexLock lock(&mu_);
    capacity_.Read(t->id, FileFootprint(t->payload), &victims);
  }
  UnlinkVictims(victims);
}

void FileBackendImpl::Publish(Task* t) {
  absl::MutexLock lock(&mu_);
  capacity_.Written(t->id, t->reserved);
  t->reserved = 0;
  t->payload = t->len;
}

void FileBackendImpl::Forget(const FileObjectId& id) {
  absl::MutexLock lock(&mu_);
  capacity_.Forget(id);
}

void FileBackendImpl::CountCorrupt(const Task* t) {
  Forget(t->id);
  AnnounceRemoved(absl::MakeConstSpan(&t->id, 1));
  stats_.corrupt_removed.fetch_add(1, std::memory_order_relaxed);
  // Rare and important: one line per object found bad.
  KVLOG(Warn, "l3 object corrupt, removed",
        {{"backend", name_}, {"path", t->path}, {"defect", ObjectDefectName(t->defect)}});
}

void FileBackendImpl::AnnounceRemoved(absl::Span<const FileObjectId> removed) {
  if (removed.empty()) return;
  absl::MutexLock lock(&removal_mu_);
  if (removal_sink_) removal_sink_(removed);
}

void FileBackendImpl::UnlinkVictims(const FileVictims& victims, bool announce) {
  // Gone from the tier's index already: announced before the unlinks land, a Match stops
  // naming them at once (a Get meanwhile misses, as for any object evicted).
  if (announce) AnnounceRemoved(victims);
  for (const FileObjectId& id : victims) {
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
    e->op.done = &FileBackendImpl::OnEvicted;
    engine_->Submit(&e->op);
  }
}

void FileBackendImpl::OnEvicted(IoOp* op) {
  auto* e = static_cast<EvictOp*>(op->context);
  absl::MutexLock lock(&e->impl->mu_);
  e->impl->free_evict_ops_.push_back(e);
}

// ---- Startup scan -----------------------------------------------------------------------------

// Indexes what the scan found, oldest coldest, then enforces the capacity, and hands what it
// indexed to the sink (the daemon's radix index).
void FileBackendImpl::PublishScan() {
  std::vector<FileStartupScan::Found> found = scan_->TakeFoundNewestFirst();
  std::vector<bool> indexed(found.size());
  size_t nindexed = 0;
  for (size_t i = 0; i < found.size(); i += kScanInsertChunk) {
    absl::MutexLock lock(&mu_);
    const size_t end = std::min(found.size(), i + kScanInsertChunk);
    for (size_t j = i; j < end; ++j) {
      // Newest first, each to the cold end: the oldest ends up coldest. Skips what this process
      // wrote (newer) or removed since the scan listed it.
      indexed[j] = capacity_.AddScanned(found[j].id, found[j].bytes);
      if (indexed[j]) ++nindexed;
    }
  }
  FileVictims victims;
  {
    absl::MutexLock lock(&mu_);
    capacity_.CompleteScan(&victims);
  }
  UnlinkVictims(victims, /*announce=*/false);

  FileScanResult r;
  r.namespaces = scan_->namespaces();
  r.entries = scan_->entries_seen();
  r.found = scan_->objects_found();
  r.legacy = scan_->objects_legacy();
  r.newer = scan_->objects_newer();
  r.dropped = scan_->objects_dropped();
  r.temps_removed = scan_->temps_removed();
  r.evicted = victims.size();
  r.payload_bytes = scan_->payload_bytes();
  const absl::flat_hash_set<FileObjectId> evicted(victims.begin(), victims.end());
  r.objects.reserve(nindexed);
  for (size_t j = found.size(); j-- > 0;) {  // Oldest first.
    if (indexed[j] && !evicted.contains(found[j].id)) r.objects.push_back(found[j]);
  }
  r.elapsed = absl::Now() - opened_at_;
  KVLOG(Info, "file backend index rebuilt",
        {{"root", options_.root},
         {"objects", nindexed},
         {"found", r.found},
         {"legacy", r.legacy},
         {"newer", r.newer},
         {"dropped", r.dropped},
         {"temps_removed", r.temps_removed},
         {"evicted", victims.size()},
         {"bytes", r.payload_bytes},
         {"seconds", absl::StrFormat("%.3f", absl::ToDoubleSeconds(r.elapsed))}});
  scan_handoff_.Deliver(std::move(r));
}

void FileBackendImpl::SetScanSink(FileScanSink sink) { scan_handoff_.SetSink(std::move(sink)); }

void FileBackendImpl::SetRemovalSink(FileRemovalSink sink) {
  absl::MutexLock lock(&removal_mu_);
  removal_sink_ = std::move(sink);
}

void FileBackendImpl::ScanThread() {
  if (scan_->ScanUntil(absl::InfiniteFuture())) PublishScan();
}

bool FileBackendImpl::WaitForIndex(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&capacity_, &FileCapacity::complete), timeout);
}

// ---- Deadlines --------------------------------------------------------------------------------

// Queued tasks whose batch deadline passed are failed here, so that a batch stuck behind slow
// I/O still completes on time (up to the I/O it already has in flight, see backend.h).
void FileBackendImpl::SweepThread() {
  for (;;) {
    Task* expired = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &FileBackendImpl::SweepWake));
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

BackendStats FileBackendImpl::Stats() const {
  BackendStats s;
  stats_.Snapshot(&s);
  absl::MutexLock lock(&mu_);
  s.used_bytes = capacity_.used_bytes();
  s.capacity_bytes = options_.capacity_bytes;
  s.indexed_objects = capacity_.objects();
  s.index_complete = capacity_.complete();
  return s;
}

}  // namespace

// ---- FileBackend ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FileBackend>> FileBackend::Open(const FileBackendOptions& options) {
  auto impl = std::make_unique<FileBackendImpl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<FileBackend>(std::move(impl));
}

std::string FileBackend::ObjectPath(const PageKey& ns, const PageKey& key, uint32_t shard) {
  char buf[kMaxRelPath];
  FormatObjectPath(NamespacePrefix(ns), key, shard, buf);
  return buf;
}

}  // namespace kvcellar::storage
