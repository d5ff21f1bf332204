// Backend: one L3 storage tier (DESIGN.md "Tiers"), behind one asynchronous batch interface.
//
// An object is one page of one shard of one namespace: (namespace digest, page key, shard). Its
// bytes live in a host slot (core/host_pool.h) on the daemon side; a backend moves them between
// that slot and its medium in one I/O, wrapped in the header of storage/object_format.h so that a
// corrupt, torn or foreign object is detected on every read, removed and counted, and never served
// (DESIGN.md "Failure semantics"). Implementations live beside this header:
//   file_backend.h   one file per object on a local or shared file system (io_uring, O_DIRECT)
//   redis_backend.h  Redis/Valkey, standalone or cluster (hiredis, pipelined)
// and what they share about a batch (its checks, outcomes and delivery) in backend_batch.h.
//
// Calling convention, the same for every operation:
//  - Every call takes a batch (one namespace, many objects) and returns absl::Status at once.
//    A non-OK status (InvalidArgument naming the field, FailedPrecondition once shut down) means
//    nothing was started and `done` will never run.
//  - With OK, `done` runs exactly once, on a backend thread, never inside the submitting call
//    (a caller may hold its own lock while submitting). It runs on the thread that completes I/O,
//    so it must not block: it may submit more work to the backend, but must never wait for it
//    (that would wait on its own thread).
//  - The request is copied; the host buffers it names must stay valid (and a Get's must not be
//    read) until `done` runs. After `done` the backend never touches them again, even when the
//    batch timed out: a deadline fails the objects that had not been started with kRetry, and
//    `done` comes once nothing touches a caller buffer any more.
//  - Every object gets an ObjectStatus. Errors are values, per object; a batch never fails as a
//    whole after submission. Any error is a miss to the layer above.
//
// Threads: every method may be called from any thread concurrently. Stats() is a relaxed snapshot.
#ifndef KVCELLAR_STORAGE_BACKEND_H_
#define KVCELLAR_STORAGE_BACKEND_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/page_key.h"
#include "storage/object_format.h"

namespace kvcellar::storage {

using core::PageKey;

// What happened to one object. Names what went wrong, CacheLib style; the layer above treats
// every value but kOk as a miss (or a dropped write) and counts it by name.
enum class ObjectStatus : uint8_t {
  kOk = 0,
  kNotFound,       // Not stored (never written, evicted, expired, removed).
  kRejected,       // Not admitted: tier full, object larger than the tier takes, server OOM.
  kRetry,          // Transient: timeout, connection lost, server loading or resharding. May work
                   // if tried again later; the object itself is not known to be bad.
  kDeviceError,    // I/O error from the medium or an unexpected server error.
  kChecksumError,  // Corrupt, torn or foreign object (magic, version, namespace, key, shard, size
                   // or CRC mismatch). The backend removed it and counted it; never served.
};
inline constexpr size_t kObjectStatusCount = 6;

constexpr absl::string_view ObjectStatusName(ObjectStatus s) {
  switch (s) {
    case ObjectStatus::kOk: return "ok";
    case ObjectStatus::kNotFound: return "not_found";
    case ObjectStatus::kRejected: return "rejected";
    case ObjectStatus::kRetry: return "retry";
    case ObjectStatus::kDeviceError: return "device_error";
    case ObjectStatus::kChecksumError: return "checksum_error";
  }
  return "unknown";
}

// ---- Requests ---------------------------------------------------------------------------------

// One object to read into a host slot. The payload lands in dst[0, size) (size reported in the
// result); bytes of dst past it are unspecified. An object whose stored payload is larger than
// `capacity` is a size mismatch (the namespace fixes the object size, so it is foreign): it gets
// kChecksumError and is removed.
// O_DIRECT backends use direct I/O when dst is 4 KiB-aligned and capacity a multiple of 4 KiB (host
// pool slots are both), buffered I/O otherwise.
struct GetItem {
  PageKey key;
  uint32_t shard = 0;
  uint8_t* dst = nullptr;
  uint64_t capacity = 0;
};

// One object to write from a host slot: src[0, size). Direct I/O needs src 4 KiB-aligned and size a
// multiple of 4 KiB; other objects are written buffered. Overwriting an existing object is allowed
// (objects are content-addressed: same key, same bytes); the last complete write wins.
// `parent` is recorded in the object's header so that a tier scanned after a restart can put the
// page back in the index under its parent (storage/object_format.h); kUnknown when the writer does
// not know it (the object is then found only by lookups).
struct PutItem {
  PageKey key;
  uint32_t shard = 0;
  const uint8_t* src = nullptr;
  uint64_t size = 0;
  ParentLink parent;
};

// One object named, for Delete.
struct ObjectRef {
  PageKey key;
  uint32_t shard = 0;
};

// Every batch belongs to one namespace (a session serves one) and has one deadline.
// timeout == ZeroDuration means the backend's default (its options say which).
template <typename Item>
struct ItemsRequest {
  PageKey ns;
  absl::Span<const Item> items;
  absl::Duration timeout = absl::ZeroDuration();
};
using GetRequest = ItemsRequest<GetItem>;
using PutRequest = ItemsRequest<PutItem>;
using DeleteRequest = ItemsRequest<ObjectRef>;
// A page is present when every listed shard of it is (MHA/GQA with TP size T: shards 0..T-1; MLA:
// shard 0). Exists answers the longest present prefix of `keys`, the question Match asks.
struct ExistsRequest {
  PageKey ns;
  absl::Span<const PageKey> keys;
  absl::Span<const uint32_t> shards;
  absl::Duration timeout = absl::ZeroDuration();
};

// ---- Results ----------------------------------------------------------------------------------

struct ItemResult {
  ObjectStatus status = ObjectStatus::kRetry;
  uint64_t bytes = 0;  // Payload bytes read (Get) or written (Put); 0 otherwise.
};

struct BatchResult {
  std::vector<ItemResult> items;  // One per request item, in request order.
  bool deadline_exceeded = false;  // Some objects got kRetry because the deadline passed.
};

struct ExistsResult {
  // Leading keys whose every shard is present. A presence answer, not a promise: a later Get can
  // still miss (evicted meanwhile, found corrupt).
  size_t present_prefix = 0;
  // kOk when present_prefix is exact. Otherwise why the scan stopped early (kRetry: timeout or
  // backend unreachable; kDeviceError): keys past present_prefix are unknown, not absent.
  ObjectStatus status = ObjectStatus::kOk;
};

using BatchCallback = absl::AnyInvocable<void(BatchResult result) &&>;
using ExistsCallback = absl::AnyInvocable<void(ExistsResult result) &&>;

// ---- Capabilities and stats -------------------------------------------------------------------

struct Capabilities {
  // Several daemons (nodes) may use the same store at once and see each other's objects.
  bool shared_across_nodes = false;
  // Largest payload Put accepts; larger objects get kRejected.
  uint64_t max_object_bytes = 0;
  // Objects survive a restart of the daemon (and of the store, for a file system).
  bool persistent = false;
  // Largest number of items in one request; more is InvalidArgument.
  size_t max_batch_items = 0;
};

enum class OpKind : uint8_t { kExists = 0, kGet, kPut, kDelete };
inline constexpr size_t kOpKindCount = 4;

constexpr absl::string_view OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kExists: return "exists";
    case OpKind::kGet: return "get";
    case OpKind::kPut: return "put";
    case OpKind::kDelete: return "delete";
  }
  return "unknown";
}

struct OpStats {
  uint64_t batches = 0;
  uint64_t objects = 0;
  uint64_t bytes = 0;  // Payload bytes of kOk objects.
  std::array<uint64_t, kObjectStatusCount> by_status{};  // Objects by final status.
  uint64_t deadline_exceeded = 0;  // Batches that hit their deadline.
};

struct BackendStats {
  std::array<OpStats, kOpKindCount> ops{};  // Indexed by OpKind.
  // Corrupt, torn or foreign objects found and removed (also in by_status[kChecksumError]).
  uint64_t corrupt_removed = 0;
  uint64_t evicted_objects = 0;
  uint64_t evicted_bytes = 0;
  // Backend-specific gauges; 0 where meaningless.
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t indexed_objects = 0;
  bool index_complete = true;  // False while a file backend's startup scan runs.
  uint64_t redirects = 0;      // Redis Cluster MOVED + ASK followed.
  uint64_t topology_refreshes = 0;
  uint64_t reconnects = 0;
  // False while the backend fails: its latest batch (or Exists) came back with every object
  // kRetry or kDeviceError (unreachable, I/O errors); true again after one that reached it.
  bool healthy = true;
  // The latest failed object (any status but kOk and kNotFound): "<op>: <status>", e.g.
  // "put: rejected", and when (Unix ms); "" and 0 if none since start.
  std::string last_error;
  int64_t last_error_unix_ms = 0;

  const OpStats& op(OpKind k) const { return ops[static_cast<size_t>(k)]; }
};

// Lock-free counters the implementations share. Threads: any.
class StatsCounters {
 public:
  void RecordBatch(OpKind kind, absl::Span<const ItemResult> results, bool deadline_exceeded) {
    Op& op = ops_[static_cast<size_t>(kind)];
    op.batches.fetch_add(1, std::memory_order_relaxed);
    op.objects.fetch_add(results.size(), std::memory_order_relaxed);
    uint64_t bytes = 0;
    std::array<uint64_t, kObjectStatusCount> counts{};
    for (const ItemResult& r : results) {
      ++counts[static_cast<size_t>(r.status)];
      if (r.status == ObjectStatus::kOk) bytes += r.bytes;
    }
    op.bytes.fetch_add(bytes, std::memory_order_relaxed);
    for (size_t i = 0; i < kObjectStatusCount; ++i) {
      if (counts[i] != 0) op.by_status[i].fetch_add(counts[i], std::memory_order_relaxed);
    }
    if (deadline_exceeded) op.deadline_exceeded.fetch_add(1, std::memory_order_relaxed);
    RecordHealth(kind, counts);
  }
  // Exists counts one object per key examined; status per key.
  void RecordExists(size_t keys, const ExistsResult& r) {
    Op& op = ops_[static_cast<size_t>(OpKind::kExists)];
    op.batches.fetch_add(1, std::memory_order_relaxed);
    op.objects.fetch_add(keys, std::memory_order_relaxed);
    op.by_status[static_cast<size_t>(ObjectStatus::kOk)].fetch_add(r.present_prefix,
                                                                   std::memory_order_relaxed);
    std::array<uint64_t, kObjectStatusCount> counts{};
    counts[static_cast<size_t>(ObjectStatus::kOk)] = r.present_prefix;
    if (keys > r.present_prefix) {
      const ObjectStatus s = r.status == ObjectStatus::kOk ? ObjectStatus::kNotFound : r.status;
      op.by_status[static_cast<size_t>(s)].fetch_add(1, std::memory_order_relaxed);
      counts[static_cast<size_t>(s)] = 1;
    }
    RecordHealth(OpKind::kExists, counts);
  }
  std::atomic<uint64_t> corrupt_removed{0};
  std::atomic<uint64_t> evicted_objects{0};
  std::atomic<uint64_t> evicted_bytes{0};
  std::atomic<uint64_t> redirects{0};
  std::atomic<uint64_t> topology_refreshes{0};
  std::atomic<uint64_t> reconnects{0};

  // Fills the counter fields of `out`; gauges are the backend's.
  void Snapshot(BackendStats* out) const {
    for (size_t k = 0; k < kOpKindCount; ++k) {
      const Op& op = ops_[k];
      OpStats& o = out->ops[k];
      o.batches = op.batches.load(std::memory_order_relaxed);
      o.objects = op.objects.load(std::memory_order_relaxed);
      o.bytes = op.bytes.load(std::memory_order_relaxed);
      o.deadline_exceeded = op.deadline_exceeded.load(std::memory_order_relaxed);
      for (size_t i = 0; i < kObjectStatusCount; ++i) {
        o.by_status[i] = op.by_status[i].load(std::memory_order_relaxed);
      }
    }
    out->corrupt_removed = corrupt_removed.load(std::memory_order_relaxed);
    out->evicted_objects = evicted_objects.load(std::memory_order_relaxed);
    out->evicted_bytes = evicted_bytes.load(std::memory_order_relaxed);
    out->redirects = redirects.load(std::memory_order_relaxed);
    out->topology_refreshes = topology_refreshes.load(std::memory_order_relaxed);
    out->reconnects = reconnects.load(std::memory_order_relaxed);
    out->healthy = !failing_.load(std::memory_order_relaxed);
    const uint64_t e = last_error_.load(std::memory_order_relaxed);
    if (e != 0) {
      out->last_error_unix_ms = static_cast<int64_t>(e >> 16);
      out->last_error =
          absl::StrCat(OpKindName(static_cast<OpKind>((e >> 8) & 0xff)), ": ",
                       ObjectStatusName(static_cast<ObjectStatus>(e & 0xff)));
    }
  }

 private:
  struct Op {
    std::atomic<uint64_t> batches{0};
    std::atomic<uint64_t> objects{0};
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> deadline_exceeded{0};
    std::array<std::atomic<uint64_t>, kObjectStatusCount> by_status{};
  };
  // Health from one batch's outcome counts: failing when it reached nothing (every object
  // kRetry or kDeviceError), healthy once one reached the backend; the latest failure noted.
  void RecordHealth(OpKind kind, const std::array<uint64_t, kObjectStatusCount>& counts) {
    const auto n = [&](ObjectStatus st) { return counts[static_cast<size_t>(st)]; };
    const uint64_t reached = n(ObjectStatus::kOk) + n(ObjectStatus::kNotFound) +
                             n(ObjectStatus::kRejected) + n(ObjectStatus::kChecksumError);
    const uint64_t unreached = n(ObjectStatus::kRetry) + n(ObjectStatus::kDeviceError);
    if (reached + unreached == 0) return;
    failing_.store(reached == 0, std::memory_order_relaxed);
    for (ObjectStatus st : {ObjectStatus::kRejected, ObjectStatus::kRetry,
                            ObjectStatus::kDeviceError, ObjectStatus::kChecksumError}) {
      if (n(st) == 0) continue;
      const uint64_t ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
      last_error_.store((ms << 16) | (uint64_t{static_cast<uint8_t>(kind)} << 8) |
                            static_cast<uint8_t>(st),
                        std::memory_order_relaxed);
      break;
    }
  }

  std::array<Op, kOpKindCount> ops_{};
  std::atomic<bool> failing_{false};
  // (Unix ms << 16) | (OpKind << 8) | ObjectStatus of the latest failure; 0: none.
  std::atomic<uint64_t> last_error_{0};
};

// ---- Future-like handle -----------------------------------------------------------------------

// The result of one batch, for callers that would rather wait than be called back (tests, tools,
// a mover thread that blocks). Threads: Wait/WaitFor/Ready from any thread; the backend fills it
// from one of its threads.
template <typename T>
class Future {
 public:
  Future() : state_(std::make_shared<State>()) {}

  bool Ready() const { return state_->done.HasBeenNotified(); }
  // Blocks until the backend completed the batch. The callback guarantee makes this bounded by
  // the batch deadline plus the I/O already issued.
  const T& Wait() const {
    state_->done.WaitForNotification();
    return state_->value;
  }
  // nullptr when not ready within `timeout`.
  const T* WaitFor(absl::Duration timeout) const {
    if (!state_->done.WaitForNotificationWithTimeout(timeout)) return nullptr;
    return &state_->value;
  }

  // The callback that completes this future; pass it to the backend.
  absl::AnyInvocable<void(T) &&> Callback() const {
    return [state = state_](T value) mutable {
      state->value = std::move(value);
      state->done.Notify();
    };
  }

 private:
  struct State {
    absl::Notification done;
    T value;
  };
  std::shared_ptr<State> state_;
};

using BatchFuture = Future<BatchResult>;
using ExistsFuture = Future<ExistsResult>;

// ---- The interface ----------------------------------------------------------------------------

class Backend {
 public:
  virtual ~Backend() = default;

  // Kind and location, for logs and metrics labels: "file:/mnt/nvme/kv", "redis:unix:/run/r.sock".
  virtual absl::string_view name() const = 0;
  virtual Capabilities capabilities() const = 0;

  virtual absl::Status Exists(const ExistsRequest& request, ExistsCallback done) = 0;
  virtual absl::Status Get(const GetRequest& request, BatchCallback done) = 0;
  virtual absl::Status Put(const PutRequest& request, BatchCallback done) = 0;
  virtual absl::Status Delete(const DeleteRequest& request, BatchCallback done) = 0;

  virtual BackendStats Stats() const = 0;

  // Future-returning forms (tests, tools, a mover that would rather block). A submission error
  // comes back as the error.
  absl::StatusOr<ExistsFuture> ExistsAsync(const ExistsRequest& request) {
    return Start<ExistsFuture>([&](auto cb) { return Exists(request, std::move(cb)); });
  }
  absl::StatusOr<BatchFuture> GetAsync(const GetRequest& request) {
    return Start<BatchFuture>([&](auto cb) { return Get(request, std::move(cb)); });
  }
  absl::StatusOr<BatchFuture> PutAsync(const PutRequest& request) {
    return Start<BatchFuture>([&](auto cb) { return Put(request, std::move(cb)); });
  }
  absl::StatusOr<BatchFuture> DeleteAsync(const DeleteRequest& request) {
    return Start<BatchFuture>([&](auto cb) { return Delete(request, std::move(cb)); });
  }

 private:
  template <typename F, typename Submit>
  static absl::StatusOr<F> Start(Submit submit) {
    F future;
    absl::Status s = submit(future.Callback());
    if (!s.ok()) return s;
    return future;
  }
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_BACKEND_H_
