// What every backend does the same for a batch, from its submission to its callback
// (storage/backend.h "Calling convention"): the checks a request passes before anything starts,
// the per-object outcomes kept while its objects settle, and the delivery that turns them into
// the BatchResult or ExistsResult its caller gets, counted in the backend's stats.
//
// Each backend derives its own batch from BatchState, adding how it tracks the objects still in
// flight, and deletes it after Deliver.
//
// Threads: the checks are pure. A BatchState's per-object slots are written by the backend's
// threads as objects settle, each slot by one thread; Deliver runs once, on the thread that
// settled the last object (or a backend thread standing in for it).
#ifndef KVCELLAR_STORAGE_BACKEND_BATCH_H_
#define KVCELLAR_STORAGE_BACKEND_BATCH_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/backend.h"

namespace kvcellar::storage {

// ---- Checks at submission: InvalidArgument naming the field, nothing started ------------------

absl::Status CheckBatchSize(size_t items, size_t max_batch_items);
// Every item has a destination buffer.
absl::Status CheckGetItems(const GetRequest& request);
// Every item has a non-empty source buffer.
absl::Status CheckPutItems(const PutRequest& request);
// Keys come with shards.
absl::Status CheckExistsShards(const ExistsRequest& request);

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
