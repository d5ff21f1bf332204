// ResultHandoff<T>: a result a backend produces once on a background thread (a file tier's
// startup scan, a Redis tier's index readback) and the daemon takes once through a sink it sets
// (server/l3/l3_recovery.h), whichever of the two comes second. Deliver runs the sink if one is
// set, else keeps the result; SetSink runs a new sink at once on a kept result. SetSink(nullptr)
// removes a sink that has not run, and returns only once no sink is running (the mutex is held
// while a sink runs, so a sink must not call back into its handoff). After a sink ran, later
// calls do nothing.
#ifndef KVCELLAR_STORAGE_RESULT_HANDOFF_H_
#define KVCELLAR_STORAGE_RESULT_HANDOFF_H_

#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace kvcellar::storage {

template <typename T>
class ResultHandoff {
 public:
  using Sink = absl::AnyInvocable<void(T result)>;

  void Deliver(T result) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (taken_) return;
    if (sink_ == nullptr) {
      result_ = std::move(result);
      return;
    }
    taken_ = true;
    std::move(sink_)(std::move(result));
    sink_ = nullptr;
  }

  void SetSink(Sink sink) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (taken_) return;
    if (!result_.has_value() || sink == nullptr) {
      sink_ = std::move(sink);
      return;
    }
    taken_ = true;
    T result = *std::move(result_);
    result_.reset();
    std::move(sink)(std::move(result));
  }

 private:
  absl::Mutex mu_;
  Sink sink_ ABSL_GUARDED_BY(mu_);
  std::optional<T> result_ ABSL_GUARDED_BY(mu_);
  bool taken_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_RESULT_HANDOFF_H_
