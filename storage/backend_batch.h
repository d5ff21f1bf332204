// What every backend does the same for a batch, from its submission to its callback
// (storage/backend.h "Calling convention"): the checks a request passes before anything starts,
// the count of batches in flight that closing waits for, the per-object outcomes kept while its
// objects settle, and the delivery that turns them into the BatchResult or ExistsResult its
// caller gets, counted in the backend's stats.
//
// Each backend derives its own batch from BatchState, adding how it tracks the objects still in
// flight, and deletes it after Deliver.
//
// Threads: the checks are pure; InFlightBatches from any thread. A BatchState's per-object slots
// are written by the backend's threads as objects settle, each slot by one thread; Deliver runs
// once, on the thread that settled the last object (or a backend thread standing in for it).
#ifndef KVCELLAR_STORAGE_BACKEND_BATCH_H_
#define KVCELLAR_STORAGE_BACKEND_BATCH_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/backend.h"

namespace kvcellar::storage {

// ---- Submission -------------------------------------------------------------------------------

// The checks a request passes before anything starts, in this order: each item's buffer (Get,
// Put) or the shards (Exists), then the batch size. InvalidArgument naming the field.
absl::Status CheckRequest(const GetRequest& request, size_t max_batch_items);
absl::Status CheckRequest(const PutRequest& request, size_t max_batch_items);
absl::Status CheckRequest(const DeleteRequest& request, size_t max_batch_items);
absl::Status CheckRequest(const ExistsRequest& request, size_t max_batch_items);

// The objects an Exists request names: one per (key, shard).
inline size_t ExistsObjectCount(const ExistsRequest& request) {
  return request.keys.size() * request.shards.size();
}

// When a batch submitted now with `timeout` (zero: the backend's default) is due.
absl::Time BatchDeadline(absl::Duration timeout, absl::Duration default_timeout);

// ---- Outcomes ---------------------------------------------------------------------------------

// What an Exists found for one object. Unknown: transient (timeout, connection, no route) or
// an error.
enum class Presence : uint8_t { kPending = 0, kPresent, kAbsent, kUnknownTransient, kUnknownError };

// The answer to an Exists: the longest prefix of keys whose every shard is present, and, where it
// stopped at an object not known absent, why (kRetry: transient; kDeviceError). `presence` holds
// nkeys * nshards entries, key-major.
ExistsResult ExistsAnswer(absl::Span<const Presence> presence, size_t nkeys, size_t nshards);

// The batches a backend has accepted and not yet delivered. Closing refuses new ones; the
// backend's destructor then waits for the rest (backend.h: destroying a backend completes every
// batch in flight). Threads: any; its own mutex, never held while calling out.
class InFlightBatches {
 public:
  // `backend` names the backend in the refusal: "file backend is shutting down".
  explicit InFlightBatches(absl::string_view backend) : backend_(backend) {}

  // FailedPrecondition once closed.
  absl::Status CheckOpen() const;
  void Add();
  void Remove();
  void Close();
  // Waits until every batch added has been removed.
  void WaitIdle();

 private:
  const std::string backend_;
  mutable absl::Mutex mu_;
  size_t count_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

struct BatchState {
  OpKind kind = OpKind::kGet;
  core::PageKey ns;
  absl::Time deadline;
  std::vector<ItemResult> results;  // Get, Put, Delete: one per request item.
  std::vector<Presence> presence;   // Exists: one per (key, shard), key-major.
  size_t nkeys = 0;                 // Exists.
  size_t nshards = 0;               // Exists.
  std::atomic<bool> deadline_exceeded{false};
  BatchCallback done;          // Get, Put, Delete.
  ExistsCallback exists_done;  // Exists.

  // Counts the batch in `stats` and runs its callback with the results (moved out). Once.
  void Deliver(StatsCounters& stats);
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_BACKEND_BATCH_H_
