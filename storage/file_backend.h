// FileBackend: the L3 tier on a file system, one file per object. Local NVMe, or a directory that
// several daemons on several nodes share (NFS, CephFS, Lustre).
//
// Layout under `root`:
//   <root>/<ns>/<kk>/<key>.<shard>                     an object (storage/object_format.h)
//   <root>/<ns>/<kk>/<key>.<shard>.tmp-<host>-<pid>-<seq>   being written
// <ns> is the first 8 bytes of the namespace digest in hex (16 characters), <key> the page key in
// hex (64), <kk> its first two characters: 256 leaf directories per namespace keep directories
// small (a million objects: ~4000 per directory). The header inside each file carries the full
// namespace digest, so a prefix collision is caught on read like any foreign object. What the tier
// creates is owner-only whatever the umask: directories 0700, objects 0600 (a page is the prompt
// in another form); daemons sharing a directory run as one user.
//
// Writes: a temp file in the object's own directory (same directory: rename is atomic on every
// POSIX and network file system that matters, and cross-directory renames are expensive on
// distributed metadata servers), written in one writev, then renamed over the final name. A
// reader therefore sees either the old object, nothing, or the whole new object: never a partial
// write from a live writer. After a crash or power loss without fsync a renamed file can still be
// torn; the header's size and CRC catch that on read (the fsync policy trades write latency for
// never having to). Temp names carry host and pid so that a restarted daemon removes only temps
// whose writer is dead (same host, no such pid) or that are older than `stale_temp_age` (any
// host: a node that never came back).
//
// I/O: through IoEngine (io_uring, or a thread pool where io_uring is refused). O_DIRECT when the
// buffer is 4 KiB-aligned and its length a multiple of 4 KiB (host pool slots are): writing
// objects that are read back rarely should not evict the page cache the host pool lives beside,
// and reads go straight into the slot. Where the file system refuses O_DIRECT (tmpfs) the backend
// logs once and uses buffered I/O.
//
// Index and capacity: an in-memory index of the objects this daemon knows (its own writes, plus
// what the startup scan and its reads found) with their sizes, in recency order: a write or a hit
// moves an object to the hot end; eviction unlinks from the cold end when a write would exceed
// `capacity_bytes`. The startup scan lists the directories (no reads) within
// `startup_scan_budget`, then finishes on a background thread; the objects it found enter the cold
// end in file mtime order (oldest coldest), since every one predates this process's writes.
//
// While the index is incomplete (scan running), or always when `shared` (other nodes add objects
// the index never hears of), a key missing from the index is not an answer: Exists stats the file
// and Get tries to open it. Once a private directory's scan completes the index is authoritative:
// misses cost no system call. Answering "unknown" during the scan instead would turn every L3 hit
// into a miss right after each restart, which is when the cache is most valuable; a stat is
// cheap next to recomputing a prefill.
//
// The parts, one file each: the layout of names (file_layout.h), the object index
// (file_object_index.h) and the capacity accounting over it (file_capacity.h), the startup scan
// (file_startup_scan.h), one object's I/O (file_object_io.h), the modes of what the tier creates
// (file_modes.h). This backend composes them: it checks and queues the objects of a batch, gives
// each an I/O slot, turns what the I/O found into index updates, and delivers the batch.
//
// Threads: all Backend methods from any thread. Completions run on the IoEngine's threads; a
// sweeper thread fails queued objects whose batch deadline passed; a scanner thread finishes the
// startup scan. One mutex guards the index, the accounting and the queue of objects waiting for
// an I/O slot; it is never held across a system call.
#ifndef KVCELLAR_STORAGE_FILE_BACKEND_H_
#define KVCELLAR_STORAGE_FILE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/backend.h"
#include "storage/file_object_io.h"
#include "storage/file_startup_scan.h"
#include "storage/io_engine.h"

namespace kvcellar::storage {

struct FileBackendOptions {
  std::string root;  // Created (with parents) if missing.
  // Bytes of files this daemon keeps (header block included); 0 = no limit.
  uint64_t capacity_bytes = 0;
  // Other daemons use the same root; the index is never authoritative for misses.
  bool shared = false;
  FsyncPolicy fsync = FsyncPolicy::kNone;
  bool direct_io = true;
  IoEngineOptions io;
  // Objects with I/O in flight at once (each holds 8 KiB: a header buffer, and a block a read
  // probes past its slot with to see bytes after the payload); the rest of a batch waits in a
  // queue. 64 keeps an NVMe device's queues busy with large objects.
  uint32_t max_inflight_objects = 64;
  size_t max_batch_items = 8192;
  uint64_t max_object_bytes = uint64_t{1} << 30;
  absl::Duration default_timeout = absl::Seconds(10);
  // Part of the startup scan done inside Open; the rest runs in the background.
  absl::Duration startup_scan_budget = absl::Seconds(1);
  // Temp files older than this are removed whoever wrote them.
  absl::Duration stale_temp_age = absl::Hours(1);
  // Names this node in temp files; empty: the host name.
  std::string host_id;
};

// What the startup scan found, for the daemon's index (server/l3/l3_recovery.h): every object
// with a good header that the tier's own index took (so not evicted to fit the capacity, nor
// removed or rewritten since it was listed), with its parent link, and the scan's counts.
struct FileScanResult {
  std::vector<core::PageKey> namespaces;        // Digests; Found::ns indexes it.
  std::vector<FileStartupScan::Found> objects;  // Oldest first.
  uint64_t entries = 0;        // Object and temp names looked at.
  uint64_t found = 0;          // Objects with a good header.
  uint64_t legacy = 0;         // Of those, version 1 objects (no parent link).
  uint64_t newer = 0;          // A later format's objects (a newer daemon's): kept, not indexed.
  uint64_t dropped = 0;        // Torn or foreign objects unlinked.
  uint64_t temps_removed = 0;  // Temps of dead writers unlinked.
  uint64_t evicted = 0;        // Objects found but over the tier's capacity, unlinked.
  uint64_t payload_bytes = 0;  // Of the objects found.
  absl::Duration elapsed;      // From Open to the end of the scan.
};
using FileScanSink = absl::AnyInvocable<void(FileScanResult result)>;
// Objects the tier removed by itself: evicted to fit its capacity, or found corrupt.
using FileRemovalSink = absl::AnyInvocable<void(absl::Span<const FileObjectId> removed)>;

// Open returns the implementation (file_backend.cc); this class adds what only the file tier
// answers. Destroying it stops accepting work and waits for every batch in flight to complete
// (callbacks included).
class FileBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<FileBackend>> Open(const FileBackendOptions& options);

  // True once the startup scan has finished (waits up to `timeout`).
  virtual bool WaitForIndex(absl::Duration timeout) const = 0;
  // Hands the startup scan's result to `sink`, once: at once on this thread when the scan has
  // finished (later calls get nothing), else on the scanner thread when it finishes. nullptr
  // removes a sink that has not run; once that call returns, the old sink is not running and
  // never will. The result waits in the backend until a sink takes it.
  virtual void SetScanSink(FileScanSink sink) = 0;
  // Tells `sink` of every object the tier removes by itself from now on (capacity evictions,
  // objects found corrupt; not Deletes, which the caller knows of), right after the removal, on
  // the thread that removed them. nullptr: none; once a call returns, the old sink is not running
  // and never will.
  virtual void SetRemovalSink(FileRemovalSink sink) = 0;
  // "io_uring" or "thread_pool".
  virtual absl::string_view io_engine_name() const = 0;
  // Where an object lives, relative to root (tests and tools).
  static std::string ObjectPath(const PageKey& ns, const PageKey& key, uint32_t shard);
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_BACKEND_H_
