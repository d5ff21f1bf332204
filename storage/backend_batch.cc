#include "storage/backend_batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::storage {

namespace {

absl::Status CheckBatchSize(size_t items, size_t max_batch_items) {
  if (items > max_batch_items) {
    return absl::InvalidArgumentError(
        absl::StrCat("items: ", items, " exceeds max_batch_items ", max_batch_items));
  }
  return absl::OkStatus();
}

// Every item has a buffer (`has_buffer`), then the batch size.
template <typename Item, typename HasBuffer>
absl::Status CheckItems(absl::Span<const Item> items, size_t max_batch_items, HasBuffer has_buffer,
                        absl::string_view problem) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (!has_buffer(items[i])) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: ", problem));
    }
  }
  return CheckBatchSize(items.size(), max_batch_items);
}

}  // namespace

absl::Status CheckRequest(const GetRequest& request, size_t max_batch_items) {
  return CheckItems(
      request.items, max_batch_items,
      [](const GetItem& it) { return it.dst != nullptr && it.capacity != 0; },
      "no destination buffer");
}

absl::Status CheckRequest(const PutRequest& request, size_t max_batch_items) {
  return CheckItems(
      request.items, max_batch_items,
      [](const PutItem& it) { return it.src != nullptr && it.size != 0; }, "empty source buffer");
}

absl::Status CheckRequest(const DeleteRequest& request, size_t max_batch_items) {
  return CheckBatchSize(request.items.size(), max_batch_items);
}

absl::Status CheckRequest(const ExistsRequest& request, size_t max_batch_items) {
  if (request.shards.empty() && !request.keys.empty()) {
    return absl::InvalidArgumentError("shards: empty");
  }
  return CheckBatchSize(ExistsObjectCount(request), max_batch_items);
}

absl::Status InFlightBatches::CheckOpen() const {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError(absl::StrCat(backend_, " is shutting down"));
  return absl::OkStatus();
}

void InFlightBatches::Add() {
  absl::MutexLock lock(&mu_);
  ++count_;
}

void InFlightBatches::Remove() {
  absl::MutexLock lock(&mu_);
  --count_;
}

void InFlightBatches::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

void InFlightBatches::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](size_t* n) { return *n == 0; }, &count_));
}

absl::Time BatchDeadline(absl::Duration timeout, absl::Duration default_timeout) {
  return absl::Now() + (timeout > absl::ZeroDuration() ? timeout : default_timeout);
}

ExistsResult ExistsAnswer(absl::Span<const Presence> presence, size_t nkeys, size_t nshards) {
  ExistsResult r;
  r.present_prefix = nkeys;
  for (size_t k = 0; k < nkeys && r.present_prefix == nkeys; ++k) {
    for (size_t s = 0; s < nshards; ++s) {
      const Presence p = presence[k * nshards + s];
      if (p == Presence::kPresent) continue;
      r.present_prefix = k;
      r.status = p == Presence::kAbsent             ? ObjectStatus::kOk
                 : p == Presence::kUnknownTransient ? ObjectStatus::kRetry
                                                    : ObjectStatus::kDeviceError;
      // An unknown shard decides the status; keep looking for one.
      if (p != Presence::kAbsent) break;
    }
  }
  return r;
}

void BatchState::Deliver(StatsCounters& stats) {
  const bool late = deadline_exceeded.load(std::memory_order_relaxed);
  if (kind == OpKind::kExists) {
    const ExistsResult r = ExistsAnswer(presence, nkeys, nshards);
    stats.RecordExists(nkeys, r);
    std::move(exists_done)(r);
  } else {
    stats.RecordBatch(kind, results, late);
    BatchResult r;
    r.items = std::move(results);
    r.deadline_exceeded = late;
    std::move(done)(std::move(r));
  }
}

}  // namespace kvcellar::storage
