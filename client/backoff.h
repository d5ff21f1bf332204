// Backoff: the delays between reconnection attempts to a daemon that is down or restarting.
//
// Exponential from `min` to `max` (doubling), with +-20% jitter so that the engines of a node,
// which all lose the daemon at the same moment, do not reconnect in lockstep. Reset() after a
// success starts again from `min`.
//
// Threading: not thread-safe; each owner (one session's reconnect loop) keeps its own.
#ifndef KVCELLAR_CLIENT_BACKOFF_H_
#define KVCELLAR_CLIENT_BACKOFF_H_

#include <cstdint>
#include <random>

#include "absl/time/time.h"

namespace kvcellar::client {

class Backoff {
 public:
  // min <= 0 is treated as 1 ms; max < min as min.
  Backoff(absl::Duration min, absl::Duration max, uint64_t seed = 0);

  // The delay before the next attempt; each call doubles the base delay up to max.
  absl::Duration Next();
  // The base delay Next() will jitter (for logs and tests).
  absl::Duration current() const { return current_; }
  void Reset() { current_ = min_; }

 private:
  absl::Duration min_;
  absl::Duration max_;
  absl::Duration current_;
  std::mt19937_64 rng_;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_BACKOFF_H_
