#include "client/backoff.h"

#include <algorithm>

namespace kvcellar::client {
namespace {

// +-20%: the spread gRPC itself uses for its reconnect backoff.
constexpr double kJitter = 0.2;

}  // namespace

Backoff::Backoff(absl::Duration min, absl::Duration max, uint64_t seed)
    : min_(std::max(min, absl::Milliseconds(1))),
      max_(std::max(max, min_)),
      current_(min_),
      rng_(seed != 0 ? seed : std::random_device{}()) {}

absl::Duration Backoff::Next() {
  const absl::Duration base = current_;
  current_ = std::min(current_ * 2, max_);
  std::uniform_real_distribution<double> jitter(1.0 - kJitter, 1.0 + kJitter);
  return std::clamp(base * jitter(rng_), min_, max_);
}

}  // namespace kvcellar::client
