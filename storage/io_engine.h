// IoEngine: asynchronous file system calls for the file backend, through io_uring or, where the
// kernel or a container's seccomp profile refuses io_uring, through a thread pool of plain
// syscalls with the same semantics.
//
// The unit is one IoOp: one system call (openat, preadv, pwritev, fsync, close, renameat,
// unlinkat, statx, or a no-op) described by a caller-owned struct and completed through a
// function pointer, so submitting and completing allocate nothing: the file backend embeds its
// IoOps in per-object state it already has. Whole-object work (open, read, close) is a chain of
// ops: each completion submits the next.
//
// Why io_uring: one submission system call carries a batch of opens, reads and writes, O_DIRECT
// reads and writes complete without a kernel worker thread, and metadata calls (openat, renameat,
// unlinkat, statx) run asynchronously in the kernel's io-wq instead of blocking our threads. Ops
// submitted from a completion callback are batched into one io_uring_enter per reaping pass.
//
// Why a fallback: Docker's and Kubernetes' default seccomp profiles have blocked io_uring_setup
// since 2023 (io_uring_queue_init returns -EPERM, or -ENOSYS where the kernel lacks it). The
// daemon must still serve its file tier there, at some cost: each op blocks one pool thread, so
// `pool_threads` bounds the I/O parallelism.
//
// Threads: Submit may be called from any thread, including from inside a completion callback.
// Callbacks run on the engine's threads (the io_uring reaper thread, or any pool thread), one op
// at a time per thread; they must not block. Destroy the engine only when no op is in flight.
#ifndef KVCELLAR_STORAGE_IO_ENGINE_H_
#define KVCELLAR_STORAGE_IO_ENGINE_H_

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcellar::storage {

struct IoOp {
  enum class Code : uint8_t {
    kNop,       // Completes at once with 0: a hop onto an engine thread.
    kOpenAt,    // openat(fd, path, flags, mode) -> new fd.
    kReadv,     // preadv(fd, iov, iovcnt, offset) -> bytes.
    kWritev,    // pwritev(fd, iov, iovcnt, offset) -> bytes.
    kFsync,     // fsync(fd), or fdatasync(fd) when `datasync`.
    kClose,     // close(fd).
    kRenameAt,  // renameat(fd, path, fd, path2).
    kUnlinkAt,  // unlinkat(fd, path, flags).
    kStatx,     // statx(fd, path, flags, mode as the mask, statx_buf).
  };

  Code code = Code::kNop;
  bool datasync = false;
  int fd = -1;  // The file, or the directory that relative paths start from (or AT_FDCWD).
  const char* path = nullptr;
  const char* path2 = nullptr;
  int flags = 0;
  uint32_t mode = 0;
  const struct iovec* iov = nullptr;
  uint32_t iovcnt = 0;
  uint64_t offset = 0;
  struct statx* statx_buf = nullptr;

  // Set by the engine before `done` runs: the call's return value, or -errno.
  int64_t result = 0;
  // Called exactly once per Submit, on an engine thread. May submit more ops (this one included).
  void (*done)(IoOp* op) = nullptr;
  // The submitter's own pointer, untouched by the engine (typically the object `done` advances).
  void* context = nullptr;

  IoOp* next_ = nullptr;  // Engine-private queue link.
};

enum class IoEngineKind {
  kAuto,        // io_uring; the thread pool (logged once) when io_uring is refused.
  kUring,       // io_uring or fail.
  kThreadPool,  // Always the thread pool (tests; hosts where io_uring misbehaves).
};

struct IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;
  // io_uring submission queue entries (completion queue: twice that). Ops beyond this many in
  // flight wait in a queue inside the engine.
  uint32_t ring_entries = 256;
  // Thread pool size: the most blocking calls in flight at once.
  int pool_threads = 16;
  // io_uring: most kernel io-wq workers for ops that block (openat, renameat, unlinkat, statx,
  // file-extending O_DIRECT writes on ext4, reads that wait for inode I/O). The kernel's default
  // for regular files is min(ring entries, 4 x CPUs): 8 on a 2-CPU VM, which would cap a queue depth
  // of 16 objects at 8 on every metadata step. 0 keeps the kernel default.
  uint32_t uring_blocking_workers = 64;
  // Tests: behave as if io_uring_queue_init had returned -fail_uring_init_with (e.g. EPERM).
  int fail_uring_init_with = 0;
};

class IoEngine {
 public:
  // kAuto never fails for io_uring reasons: it falls back. kUring fails with the reason.
  static absl::StatusOr<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& options);

  virtual ~IoEngine() = default;

  virtual void Submit(IoOp* op) = 0;
  // Several ops in one submission (one system call with io_uring).
  virtual void Submit(absl::Span<IoOp* const> ops) = 0;

  // "io_uring" or "thread_pool".
  virtual absl::string_view name() const = 0;
  // Why this engine was chosen over io_uring; empty when io_uring is in use or was not wanted.
  const std::string& fallback_reason() const { return fallback_reason_; }

 protected:
  std::string fallback_reason_;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_IO_ENGINE_H_
