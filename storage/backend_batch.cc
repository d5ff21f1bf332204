#include "storage/backend_batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::storage {

absl::Status CheckBatchSize(size_t items, size_t max_batch_items) {
  if (items > max_batch_items) {
    return absl::InvalidArgumentError(
        absl::StrCat("items: ", items, " exceeds max_batch_items ", max_batch_items));
  }
  return absl::OkStatus();
}

absl::Status CheckGetItems(const GetRequest& request) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    const GetItem& it = request.items[i];
    if (it.dst == nullptr || it.capacity == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: no destination buffer"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPutItems(const PutRequest& request) {
  for (size_t i = 0; i < request.items.size(); ++i) {
    const PutItem& it = request.items[i];
    if (it.src == nullptr || it.size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: empty source buffer"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckExistsShards(const ExistsRequest& request) {
  if (request.shards.empty() && !request.keys.empty()) {
    return absl::InvalidArgumentError("shards: empty");
  }
  return absl::OkStatus();
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
