#include "storage/file_object_io.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/time/clock.h"
#include "platform/log.h"

namespace kvcellar::storage {
namespace {

constexpr uint64_t kBlock = kFileHeaderBlockBytes;

}  // namespace

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

void FileObjectIo::Start(FileIoTask* t) {
  const bool aligned = reinterpret_cast<uintptr_t>(t->buf) % kBlock == 0 && t->len % kBlock == 0;
  t->direct = aligned && direct_ok_.load(std::memory_order_relaxed);
  switch (t->kind) {
    case OpKind::kGet:
      t->stage = FileIoTask::kOpen;
      PrepOpen(t, t->path, O_RDONLY);
      break;
    case OpKind::kPut:
      FormatTempPath(t->path, options_.host_id, options_.pid, temp_seq_.fetch_add(1), t->tmp);
      t->stage = FileIoTask::kOpen;
      PrepOpen(t, t->tmp, O_WRONLY | O_CREAT | O_EXCL);
      break;
    case OpKind::kDelete:
      PrepUnlink(t, t->path, FileIoTask::kUnlink);
      break;
    case OpKind::kExists:
      t->stage = FileIoTask::kStatx;
      t->op.code = IoOp::Code::kStatx;
      t->op.fd = options_.root_fd;
      t->op.path = t->path;
      t->op.flags = AT_SYMLINK_NOFOLLOW;
      t->op.mode = STATX_SIZE | STATX_TYPE;
      t->op.statx_buf = &t->stx;
      break;
  }
}

void FileObjectIo::Advance(FileIoTask* t, int64_t res) {
  switch (t->kind) {
    case OpKind::kGet: return AdvanceGet(t, res);
    case OpKind::kPut: return AdvancePut(t, res);
    case OpKind::kDelete: return AdvanceDelete(t, res);
    case OpKind::kExists: return AdvanceExists(t, res);
  }
}

// ---- Ops --------------------------------------------------------------------------------------

void FileObjectIo::PrepOpen(FileIoTask* t, const char* path, int flags) {
  t->op.code = IoOp::Code::kOpenAt;
  t->op.fd = options_.root_fd;
  t->op.path = path;
  t->op.flags = flags | O_CLOEXEC | (t->direct ? O_DIRECT : 0);
  t->op.mode = FileModes::kObjectMode;
}

void FileObjectIo::PrepSimple(FileIoTask* t, IoOp::Code code, FileIoTask::Stage stage) {
  t->stage = stage;
  t->op.code = code;
  t->op.fd = t->fd;
  t->op.datasync = true;
}

void FileObjectIo::PrepUnlink(FileIoTask* t, const char* path, FileIoTask::Stage stage) {
  t->stage = stage;
  t->op.code = IoOp::Code::kUnlinkAt;
  t->op.fd = options_.root_fd;
  t->op.path = path;
  t->op.flags = 0;
}

// The rest of a transfer over [header block][buf, len][tail probe], from io_done to io_total: a
// Get's io_total takes in the probe, a Put's ends with the payload.
void FileObjectIo::PrepTransferRest(FileIoTask* t, IoOp::Code code) {
  const struct {
    uint8_t* base;
    uint64_t bytes;
  } parts[3] = {{t->block, kBlock}, {t->buf, t->len}, {t->block + kBlock, kTailProbeBytes}};
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

// An O_DIRECT open the file system refused (EINVAL): O_DIRECT goes off for the tier, logged once,
// and the open is resubmitted buffered. False (nothing done) for any other failure.
bool FileObjectIo::RetryBuffered(FileIoTask* t, int64_t res, const char* path, int flags) {
  if (res != -EINVAL || !t->direct) return false;
  if (direct_ok_.exchange(false)) {
    KVLOG(Warn, "file system refused O_DIRECT, using buffered I/O",
          {{"root", options_.root}, {"errno", EINVAL}});
  }
  t->direct = false;
  PrepOpen(t, path, flags);
  Submit(t);
  return true;
}

// ---- Get --------------------------------------------------------------------------------------

void FileObjectIo::AdvanceGet(FileIoTask* t, int64_t res) {
  switch (t->stage) {
    case FileIoTask::kOpen:
      return GetOpened(t, res);
    case FileIoTask::kRead:
      return GetRead(t, res);
    case FileIoTask::kClose:
      return GetClosed(t);
    case FileIoTask::kUnlinkCorrupt:
      return Done(t, ObjectStatus::kChecksumError);
    default:
      return Done(t, ObjectStatus::kDeviceError);
  }
}

void FileObjectIo::GetOpened(FileIoTask* t, int64_t res) {
  if (res < 0) {
    if (RetryBuffered(t, res, t->path, O_RDONLY)) return;
    return Done(t, StatusFromErrno(static_cast<int>(-res)));
  }
  t->fd = static_cast<int>(res);
  t->stage = FileIoTask::kRead;
  t->io_done = 0;
  t->io_total = kBlock + t->len + kTailProbeBytes;
  PrepTransferRest(t, IoOp::Code::kReadv);
  return Submit(t);
}

void FileObjectIo::GetRead(FileIoTask* t, int64_t res) {
  if (res < 0) {
    t->status = StatusFromErrno(static_cast<int>(-res));
    if (t->status == ObjectStatus::kNotFound) t->status = ObjectStatus::kDeviceError;
    PrepSimple(t, IoOp::Code::kClose, FileIoTask::kClose);
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
      PrepTransferRest(t, IoOp::Code::kReadv);
      return Submit(t);
    }
  }
  // Everything read past the header block counts as payload, the probe included: bytes
  // after the payload are a size mismatch like any other (VerifyObject).
  const uint64_t header_bytes = std::min<uint64_t>(t->io_done, kBlock);
  const uint64_t payload_bytes = t->io_done > kBlock ? t->io_done - kBlock : 0;
  ExpectedObject expected;
  expected.ns = t->ns;
  expected.key = &t->id.key;
  expected.shard = t->id.shard;
  expected.capacity = t->len;
  ObjectHeader h;
  t->defect = VerifyObject(t->block, header_bytes, expected, t->buf, payload_bytes, &h);
  if (t->defect == ObjectDefect::kNone) {
    t->status = ObjectStatus::kOk;
    t->payload = h.payload_bytes;
  } else if (t->defect == ObjectDefect::kNewerVersion) {
    t->status = ObjectStatus::kNotFound;  // A newer daemon's object: a miss, kept for it.
  } else {
    t->status = ObjectStatus::kChecksumError;
  }
  PrepSimple(t, IoOp::Code::kClose, FileIoTask::kClose);
  return Submit(t);
}

void FileObjectIo::GetClosed(FileIoTask* t) {
  t->fd = -1;
  if (t->status == ObjectStatus::kChecksumError) {
    PrepUnlink(t, t->path, FileIoTask::kUnlinkCorrupt);
    return Submit(t);
  }
  return Done(t, t->status);
}

// ---- Put --------------------------------------------------------------------------------------

void FileObjectIo::AdvancePut(FileIoTask* t, int64_t res) {
  switch (t->stage) {
    case FileIoTask::kOpen:
      return PutOpened(t, res);

    case FileIoTask::kWrite:
      return PutWrote(t, res);

    case FileIoTask::kSync:
      if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
      PrepSimple(t, IoOp::Code::kClose, FileIoTask::kClose);
      return Submit(t);

    case FileIoTask::kClose:
      t->fd = -1;
      // NFS reports write-back errors at close.
      if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
      t->stage = FileIoTask::kRename;
      t->op.code = IoOp::Code::kRenameAt;
      t->op.fd = options_.root_fd;
      t->op.path = t->tmp;
      t->op.path2 = t->path;
      return Submit(t);

    case FileIoTask::kRename:
      return PutRenamed(t, res);

    case FileIoTask::kDirOpen:
      // The object is in place either way; a failed directory sync only weakens durability.
      if (res < 0) return Done(t, ObjectStatus::kOk);
      t->fd = static_cast<int>(res);
      PrepSimple(t, IoOp::Code::kFsync, FileIoTask::kDirSync);
      t->op.datasync = false;
      return Submit(t);

    case FileIoTask::kDirSync:
      PrepSimple(t, IoOp::Code::kClose, FileIoTask::kDirClose);
      return Submit(t);

    case FileIoTask::kDirClose:
      t->fd = -1;
      return Done(t, ObjectStatus::kOk);

    case FileIoTask::kCleanupClose:
      t->fd = -1;
      PrepUnlink(t, t->tmp, FileIoTask::kCleanupUnlink);
      return Submit(t);

    case FileIoTask::kCleanupUnlink:
      return Done(t, t->status);

    default:
      return Done(t, ObjectStatus::kDeviceError);
  }
}

void FileObjectIo::PutOpened(FileIoTask* t, int64_t res) {
  if (res < 0) {
    if (RetryBuffered(t, res, t->tmp, O_WRONLY | O_CREAT | O_EXCL)) return;
    if (res == -ENOENT && !t->made_dirs) {
      EnsureDirs(t);  // First write of this namespace or leaf: two mkdirs, once.
      t->made_dirs = true;
      return Submit(t);
    }
    ObjectStatus s = StatusFromErrno(static_cast<int>(-res));
    if (s == ObjectStatus::kNotFound) s = ObjectStatus::kDeviceError;
    return Done(t, s);
  }
  t->fd = static_cast<int>(res);
  modes_.FixObject(t->fd);
  std::memset(t->block, 0, kBlock);
  EncodeObjectHeader(
      MakeObjectHeader(*t->ns, t->id.key, t->id.shard, t->buf, t->len,
                       static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())), t->parent),
      t->block);
  t->stage = FileIoTask::kWrite;
  t->io_done = 0;
  t->io_total = kBlock + t->len;
  PrepTransferRest(t, IoOp::Code::kWritev);
  return Submit(t);
}

void FileObjectIo::PutWrote(FileIoTask* t, int64_t res) {
  if (res < 0) return CleanupPut(t, StatusFromErrno(static_cast<int>(-res)));
  t->io_done += static_cast<uint64_t>(res);
  if (t->io_done < t->io_total) {
    // A short write means the device filled up, unless a network file system split it; go
    // on while progress is possible and the offset suits the file's mode.
    if (res > 0 && (!t->direct || t->io_done % kBlock == 0)) {
      PrepTransferRest(t, IoOp::Code::kWritev);
      return Submit(t);
    }
    return CleanupPut(t, ObjectStatus::kRejected);
  }
  if (options_.fsync != FsyncPolicy::kNone) {
    PrepSimple(t, IoOp::Code::kFsync, FileIoTask::kSync);
  } else {
    PrepSimple(t, IoOp::Code::kClose, FileIoTask::kClose);
  }
  return Submit(t);
}

void FileObjectIo::PutRenamed(FileIoTask* t, int64_t res) {
  if (res < 0) {
    ObjectStatus s = StatusFromErrno(static_cast<int>(-res));
    return CleanupPut(t, s == ObjectStatus::kNotFound ? ObjectStatus::kDeviceError : s);
  }
  if (options_.fsync == FsyncPolicy::kDataAndDirectory) {
    FormatLeafDir(t->id.ns_prefix, t->id.key, t->tmp);  // The temp name is spent.
    t->stage = FileIoTask::kDirOpen;
    t->op.code = IoOp::Code::kOpenAt;
    t->op.fd = options_.root_fd;
    t->op.path = t->tmp;
    t->op.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
    return Submit(t);
  }
  return Done(t, ObjectStatus::kOk);
}

// Closes (if open) and removes the temp file, then finishes with `status`.
void FileObjectIo::CleanupPut(FileIoTask* t, ObjectStatus status) {
  t->status = status;
  if (t->fd >= 0) {
    PrepSimple(t, IoOp::Code::kClose, FileIoTask::kCleanupClose);
  } else {
    PrepUnlink(t, t->tmp, FileIoTask::kCleanupUnlink);
  }
  Submit(t);
}

// Makes the object's namespace and leaf directories (either may exist); the open is resubmitted.
void FileObjectIo::EnsureDirs(const FileIoTask* t) {
  char dir[kMaxRelPath];
  char* end = FormatLeafDir(t->id.ns_prefix, t->id.key, dir);
  end[-3] = '\0';  // "<ns16>"
  modes_.MakeDir(options_.root_fd, dir);
  end[-3] = '/';
  modes_.MakeDir(options_.root_fd, dir);
}

// ---- Delete, Exists ---------------------------------------------------------------------------

void FileObjectIo::AdvanceDelete(FileIoTask* t, int64_t res) {
  if (res == 0) return Done(t, ObjectStatus::kOk);
  Done(t, StatusFromErrno(static_cast<int>(-res)));
}

void FileObjectIo::AdvanceExists(FileIoTask* t, int64_t res) {
  if (res == 0) {
    // A file shorter than a header block is a torn object: not present for Match.
    const bool present = S_ISREG(t->stx.stx_mode) && t->stx.stx_size >= kBlock;
    return Done(t, present ? ObjectStatus::kOk : ObjectStatus::kNotFound);
  }
  Done(t, res == -ENOENT ? ObjectStatus::kNotFound : ObjectStatus::kDeviceError);
}

}  // namespace kvcellar::storage
