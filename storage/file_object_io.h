// FileObjectIo: the I/O of one object of the file tier, as a state machine over IoOps
// (storage/io_engine.h): each completed op advances the object's FileIoTask to its next step.
//
//   Get     open; one readv of [header block][payload][tail probe] (a short read goes on only as
//           far as the header says the object goes); verify (storage/object_format.h); close;
//           unlink it when it is corrupt.
//   Put     open a temp file in the object's directory (making the directories on the first
//           ENOENT); one writev of [header block][payload]; fdatasync per the fsync policy;
//           close; rename over the object; for kDataAndDirectory, fsync the directory. On failure
//           the temp is closed and removed.
//   Delete  unlink.          Exists  statx.
//
// O_DIRECT when the buffer is 4 KiB-aligned and its length a multiple of 4 KiB (host pool slots
// are); the first file system that refuses it (EINVAL at open, tmpfs) turns it off for the
// tier, logged once, and the open is retried buffered.
//
// When an object's I/O is over, the Listener hears its status once, and the status says what
// happened on disk, which the file backend turns into index updates:
//   Get     kOk: read whole (payload bytes in `payload`); kNotFound: no such file;
//           kChecksumError: corrupt, and unlinked (why in `defect`); others: I/O errors.
//   Put     kOk: in place under its name; anything else: nothing left behind.
//   Delete  kOk: removed; kNotFound: was not there.
//   Exists  kOk: a regular file at least a header block long; kNotFound: none (or torn);
//           kDeviceError: could not tell.
//
// Threads: Start on the submitting thread; Advance on IoEngine threads, which also run the
// Listener. A task is advanced by one thread at a time (its ops run one after another); what
// tasks share (whether O_DIRECT works, the temp sequence) is atomic. No lock.
#ifndef KVCELLAR_STORAGE_FILE_OBJECT_IO_H_
#define KVCELLAR_STORAGE_FILE_OBJECT_IO_H_

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "core/page_key.h"
#include "storage/backend.h"
#include "storage/file_layout.h"
#include "storage/file_modes.h"
#include "storage/io_engine.h"
#include "storage/object_format.h"

namespace kvcellar::storage {

enum class FsyncPolicy {
  // No fsync. A daemon crash loses nothing (the page cache survives it); a power loss may leave
  // torn objects, which reads detect, remove and count. The right default for a cache.
  kNone,
  // fdatasync the temp file before the rename: a name never points at undurable data.
  kData,
  // kData, plus fsync of the directory after the rename: the object survives a power loss.
  kDataAndDirectory,
};

// A Get reads this much past the end of its slot, into a buffer of its own, so that bytes after
// the payload reach the verifier even when the object fills the slot exactly (the usual case:
// the namespace fixes the object size). An intact file ends where its payload does, so the probe
// reads nothing and costs no I/O; it is one block so that O_DIRECT accepts it.
inline constexpr uint64_t kTailProbeBytes = kFileHeaderBlockBytes;
// What one task needs besides the caller's buffer: the header block, then the tail probe.
inline constexpr uint64_t kFileIoSlotBytes = kFileHeaderBlockBytes + kTailProbeBytes;

// One object's I/O: what to do (set by the owner before Start) and where it stands.
struct FileIoTask {
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

  // The owner sets op.context and op.done (and passes completions to Advance); Start and Advance
  // set the rest of op.
  IoOp op;
  // What to do, set by the owner.
  OpKind kind = OpKind::kGet;
  const core::PageKey* ns = nullptr;  // The batch's namespace (written and checked in headers).
  FileObjectId id;
  uint8_t* buf = nullptr;  // Get: destination; Put: source.
  uint64_t len = 0;        // Get: capacity; Put: size.
  ParentLink parent;       // Put: recorded in the header.
  // An I/O slot of kFileIoSlotBytes, 4 KiB-aligned, held while the I/O runs: the header block,
  // then the Get's tail probe.
  uint8_t* block = nullptr;
  char path[kMaxRelPath];  // FormatObjectPath of id.

  // What the I/O found.
  uint64_t payload = 0;                       // Get: payload bytes served.
  ObjectDefect defect = ObjectDefect::kNone;  // Get: why it was corrupt.

  // The state machine's own.
  Stage stage = kOpen;
  bool direct = false;
  bool made_dirs = false;
  ObjectStatus status = ObjectStatus::kOk;
  int fd = -1;
  struct iovec iov[3];
  uint64_t io_total = 0;
  uint64_t io_done = 0;
  struct statx stx;
  char tmp[kMaxRelPath];
};

class FileObjectIo {
 public:
  class Listener {
   public:
    virtual ~Listener() = default;
    // The task's I/O is over (see the header comment for what `status` means). Called once per
    // Start, on the thread that ran Advance; the task is the owner's again.
    virtual void OnObjectDone(FileIoTask* t, ObjectStatus status) = 0;
  };

  struct Options {
    std::string root;  // For logs.
    int root_fd = -1;  // Paths are relative to it.
    FsyncPolicy fsync = FsyncPolicy::kNone;
    bool direct_io = true;
    std::string host_id;  // Names this writer in temp names (storage/file_layout.h).
    pid_t pid = 0;
  };

  // `engine` and `listener` outlive this.
  FileObjectIo(Options options, FileModes modes, IoEngine* engine, Listener* listener)
      : options_(std::move(options)),
        modes_(modes),
        engine_(engine),
        listener_(listener),
        direct_ok_(options_.direct_io) {}

  // Prepares the task's first op (t->op); the owner submits it. t->block must be set.
  void Start(FileIoTask* t);
  // Takes the result of the task's latest op: submits the next, or tells the Listener.
  void Advance(FileIoTask* t, int64_t res);

 private:
  void AdvanceGet(FileIoTask* t, int64_t res);
  void GetOpened(FileIoTask* t, int64_t res);
  void GetRead(FileIoTask* t, int64_t res);
  void GetClosed(FileIoTask* t);
  void AdvancePut(FileIoTask* t, int64_t res);
  void PutOpened(FileIoTask* t, int64_t res);
  void PutWrote(FileIoTask* t, int64_t res);
  void PutRenamed(FileIoTask* t, int64_t res);
  void AdvanceDelete(FileIoTask* t, int64_t res);
  void AdvanceExists(FileIoTask* t, int64_t res);

  void Submit(FileIoTask* t) { engine_->Submit(&t->op); }
  void Done(FileIoTask* t, ObjectStatus status) { listener_->OnObjectDone(t, status); }
  void PrepOpen(FileIoTask* t, const char* path, int flags);
  void PrepTransferRest(FileIoTask* t, IoOp::Code code);
  void PrepSimple(FileIoTask* t, IoOp::Code code, FileIoTask::Stage stage);
  void PrepUnlink(FileIoTask* t, const char* path, FileIoTask::Stage stage);
  void CleanupPut(FileIoTask* t, ObjectStatus status);
  bool RetryBuffered(FileIoTask* t, int64_t res, const char* path, int flags);
  void EnsureDirs(const FileIoTask* t);

  const Options options_;
  const FileModes modes_;
  IoEngine* const engine_;
  Listener* const listener_;
  std::atomic<bool> direct_ok_;
  std::atomic<uint64_t> temp_seq_{0};
};

// Which status an errno becomes: full devices and quotas reject; resource shortages and NFS's
// stale handles are transient; ENOENT is kNotFound; everything else is the device's fault.
ObjectStatus StatusFromErrno(int err);

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_OBJECT_IO_H_
