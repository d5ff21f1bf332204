#include "storage/io_engine.h"

#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "platform/log.h"

namespace kvcellar::storage {
namespace {

// Intrusive FIFO of IoOps (next_ links): queuing allocates nothing.
class OpQueue {
 public:
  bool empty() const { return head_ == nullptr; }
  void Push(IoOp* op) {
    op->next_ = nullptr;
    if (tail_ == nullptr) {
      head_ = tail_ = op;
    } else {
      tail_->next_ = op;
      tail_ = op;
    }
  }
  IoOp* Pop() {
    IoOp* op = head_;
    if (op != nullptr) {
      head_ = op->next_;
      if (head_ == nullptr) tail_ = nullptr;
      op->next_ = nullptr;
    }
    return op;
  }

 private:
  IoOp* head_ = nullptr;
  IoOp* tail_ = nullptr;
};

// ---- Thread pool ------------------------------------------------------------------------------

int64_t Execute(IoOp* op) {
  long rc = 0;
  switch (op->code) {
    case IoOp::Code::kNop:
      return 0;
    case IoOp::Code::kOpenAt:
      rc = ::openat(op->fd, op->path, op->flags, static_cast<mode_t>(op->mode));
      break;
    case IoOp::Code::kReadv:
      rc = ::preadv(op->fd, op->iov, static_cast<int>(op->iovcnt), static_cast<off_t>(op->offset));
      break;
    case IoOp::Code::kWritev:
      rc = ::pwritev(op->fd, op->iov, static_cast<int>(op->iovcnt), static_cast<off_t>(op->offset));
      break;
    case IoOp::Code::kFsync:
      rc = op->datasync ? ::fdatasync(op->fd) : ::fsync(op->fd);
      break;
    case IoOp::Code::kClose:
      rc = ::close(op->fd);
      break;
    case IoOp::Code::kRenameAt:
      rc = ::renameat(op->fd, op->path, op->fd, op->path2);
      break;
    case IoOp::Code::kUnlinkAt:
      rc = ::unlinkat(op->fd, op->path, op->flags);
      break;
    case IoOp::Code::kStatx:
      rc = ::statx(op->fd, op->path, op->flags, op->mode, op->statx_buf);
      break;
  }
  return rc < 0 ? -errno : rc;
}

// Threads: `pool_threads` workers, each running one blocking call at a time.
class ThreadPoolEngine final : public IoEngine {
 public:
  ThreadPoolEngine(int threads, std::string fallback_reason) {
    fallback_reason_ = std::move(fallback_reason);
    if (threads < 1) threads = 1;
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Run(); });
  }
  ~ThreadPoolEngine() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

  void Submit(IoOp* op) override {
    absl::MutexLock lock(&mu_);
    queue_.Push(op);
  }
  void Submit(absl::Span<IoOp* const> ops) override {
    absl::MutexLock lock(&mu_);
    for (IoOp* op : ops) queue_.Push(op);
  }
  absl::string_view name() const override { return "thread_pool"; }

 private:
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; }

  void Run() {
    for (;;) {
      IoOp* op;
      {
        absl::MutexLock lock(&mu_, absl::Condition(this, &ThreadPoolEngine::HasWork));
        op = queue_.Pop();
        if (op == nullptr) return;  // Stopping and drained.
      }
      op->result = Execute(op);
      op->done(op);
    }
  }

  absl::Mutex mu_;
  OpQueue queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// ---- io_uring ---------------------------------------------------------------------------------

// The engine whose reaper thread this is, if any: Submit from a completion callback only queues
// SQEs, and the reaper submits them all in one io_uring_enter after the pass.
thread_local const void* tls_reaper_of = nullptr;

// Threads: one reaper thread waits for completions and runs callbacks; submitters (any thread)
// fill the submission queue under mu_. liburing allows one submitter and one completer at once,
// which mu_ and the single reaper provide.
class UringEngine final : public IoEngine {
 public:
  // Returns 0 or -errno (the refusal); on 0 the engine is running.
  int Init(uint32_t entries, uint32_t blocking_workers) {
    if (entries < 8) entries = 8;
    int rc = io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0) return rc;
    ring_ready_ = true;
    // Every opcode the file backend uses; kernels before 5.11 lack renameat/unlinkat.
    io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
    if (probe == nullptr) return -ENOSYS;
    const int needed[] = {IORING_OP_NOP,    IORING_OP_OPENAT,   IORING_OP_READV,
                          IORING_OP_WRITEV, IORING_OP_FSYNC,    IORING_OP_CLOSE,
                          IORING_OP_RENAMEAT, IORING_OP_UNLINKAT, IORING_OP_STATX};
    bool all = true;
    for (int code : needed) all = all && io_uring_opcode_supported(probe, code);
    io_uring_free_probe(probe);
    if (!all) return -EOPNOTSUPP;
    if (blocking_workers > 0) {
      // [bounded, unbounded]; 0 leaves a limit unchanged. Kernels before 5.15 refuse: harmless.
      unsigned int limits[2] = {blocking_workers, 0};
      io_uring_register_iowq_max_workers(&ring_, limits);
    }
    // The in-flight cap keeps the completion queue (2x entries) from ever overflowing.
    max_inflight_ = ring_.sq.ring_entries;
    reaper_ = std::thread([this] { Reap(); });
    return 0;
  }

  ~UringEngine() override {
    if (reaper_.joinable()) {
      stop_op_.code = IoOp::Code::kNop;
      Submit(&stop_op_);
      reaper_.join();
    }
    if (ring_ready_) io_uring_queue_exit(&ring_);
  }

  void Submit(IoOp* op) override { Submit(absl::MakeConstSpan(&op, 1)); }
  void Submit(absl::Span<IoOp* const> ops) override {
    const bool from_reaper = tls_reaper_of == this;
    absl::MutexLock lock(&mu_);
    for (IoOp* op : ops) pending_.Push(op);
    FillLocked();
    if (!from_reaper) FlushLocked();
  }
  absl::string_view name() const override { return "io_uring"; }

 private:
  // Moves queued ops into SQEs while the in-flight cap allows.
  void FillLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!pending_.empty() && inflight_ < max_inflight_) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {
        FlushLocked();
        sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) return;  // Kernel still owns every entry; the reaper refills.
      }
      IoOp* op = pending_.Pop();
      Prep(sqe, op);
      io_uring_sqe_set_data(sqe, op);
      ++inflight_;
      ++unsubmitted_;
    }
  }

  void FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (unsubmitted_ > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc >= 0) {
        unsubmitted_ -= std::min<uint32_t>(unsubmitted_, static_cast<uint32_t>(rc));
        if (rc == 0) break;
        continue;
      }
      if (rc == -EINTR) continue;
      // -EAGAIN/-EBUSY: the kernel is short of resources or the CQ is backed up; the SQEs stay
      // queued in the ring and the reaper submits them after its next pass.
      break;
    }
  }

  static void Prep(io_uring_sqe* sqe, IoOp* op) {
    switch (op->code) {
      case IoOp::Code::kNop:
        io_uring_prep_nop(sqe);
        break;
      case IoOp::Code::kOpenAt:
        io_uring_prep_openat(sqe, op->fd, op->path, op->flags, op->mode);
        break;
      case IoOp::Code::kReadv:
        io_uring_prep_readv(sqe, op->fd, op->iov, op->iovcnt, op->offset);
        break;
      case IoOp::Code::kWritev:
        io_uring_prep_writev(sqe, op->fd, op->iov, op->iovcnt, op->offset);
        break;
      case IoOp::Code::kFsync:
        io_uring_prep_fsync(sqe, op->fd, op->datasync ? IORING_FSYNC_DATASYNC : 0);
        break;
      case IoOp::Code::kClose:
        io_uring_prep_close(sqe, op->fd);
        break;
      case IoOp::Code::kRenameAt:
        io_uring_prep_renameat(sqe, op->fd, op->path, op->fd, op->path2, 0);
        break;
      case IoOp::Code::kUnlinkAt:
        io_uring_prep_unlinkat(sqe, op->fd, op->path, op->flags);
        break;
      case IoOp::Code::kStatx:
        io_uring_prep_statx(sqe, op->fd, op->path, op->flags, op->mode, op->statx_buf);
        break;
    }
  }

  void Reap() {
    tls_reaper_of = this;
    constexpr unsigned kMaxPerPass = 256;
    IoOp* done[kMaxPerPass];
    bool stopping = false;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0) {
        if (rc == -EINTR || rc == -EAGAIN) continue;
        KVLOG(Error, "io_uring wait failed", {{"errno", -rc}, {"error", std::strerror(-rc)}});
        continue;
      }
      unsigned head;
      unsigned seen = 0;
      unsigned n = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        auto* op = static_cast<IoOp*>(io_uring_cqe_get_data(cqe));
        ++seen;
        if (op == &stop_op_) {
          stopping = true;
        } else {
          op->result = cqe->res;
          done[n++] = op;
        }
        if (seen == kMaxPerPass) break;
      }
      io_uring_cq_advance(&ring_, seen);
      {
        absl::MutexLock lock(&mu_);
        inflight_ -= seen;
      }
      for (unsigned i = 0; i < n; ++i) done[i]->done(done[i]);
      absl::MutexLock lock(&mu_);
      FillLocked();
      FlushLocked();
      if (stopping && inflight_ == 0 && pending_.empty()) return;
    }
  }

  io_uring ring_{};
  bool ring_ready_ = false;
  uint32_t max_inflight_ = 0;
  IoOp stop_op_;
  std::thread reaper_;

  absl::Mutex mu_;
  OpQueue pending_ ABSL_GUARDED_BY(mu_);  // Submitted, not yet in the ring.
  uint32_t inflight_ ABSL_GUARDED_BY(mu_) = 0;     // In the ring, not yet reaped.
  uint32_t unsubmitted_ ABSL_GUARDED_BY(mu_) = 0;  // SQEs filled but not yet handed to the kernel.
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> IoEngine::Create(const IoEngineOptions& options) {
  if (options.kind == IoEngineKind::kThreadPool) {
    return std::unique_ptr<IoEngine>(new ThreadPoolEngine(options.pool_threads, ""));
  }
  auto uring = std::make_unique<UringEngine>();
  int rc = options.fail_uring_init_with != 0 ? -options.fail_uring_init_with
                                             : uring->Init(options.ring_entries, options.uring_blocking_workers);
  if (rc == 0) return std::unique_ptr<IoEngine>(std::move(uring));
  uring.reset();
  std::string reason = absl::StrCat("io_uring_queue_init: ", std::strerror(-rc));
  if (options.kind == IoEngineKind::kUring) {
    return absl::UnavailableError(absl::StrCat("io_uring unavailable (", reason, ")"));
  }
  // One line per engine created (once per backend at startup), never per op.
  KVLOG(Warn, "io_uring refused, using thread pool",
        {{"errno", -rc}, {"reason", reason}, {"threads", options.pool_threads}});
  return std::unique_ptr<IoEngine>(new ThreadPoolEngine(options.pool_threads, std::move(reason)));
}

}  // namespace kvcellar::storage
