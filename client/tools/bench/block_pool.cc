#include "client/tools/bench/block_pool.h"

#include "absl/strings/str_cat.h"

namespace kvcellar::bench {

BlockPool::BlockPool(uint32_t num_blocks) : usable_(num_blocks) {
  free_.reserve(num_blocks);
  // Highest first, so pops hand out low indices first (easier to read in a debugger).
  for (uint32_t b = num_blocks; b > 0; --b) free_.push_back(b - 1);
}

absl::StatusOr<std::vector<uint32_t>> BlockPool::Acquire(uint32_t n) {
  absl::MutexLock lock(&mu_);
  // Blocks quarantined while waiting can make n unreachable: wake up for that too.
  auto ready = [this, n]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return free_.size() >= n || n > usable_; };
  mu_.Await(absl::Condition(&ready));
  if (n > usable_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a request needs ", n, " engine blocks but only ", usable_, " are usable (",
                     quarantined_, " quarantined after ops whose outcome stayed unknown)"));
  }
  std::vector<uint32_t> out(free_.end() - n, free_.end());
  free_.resize(free_.size() - n);
  return out;
}

void BlockPool::Release(const std::vector<uint32_t>& blocks) {
  absl::MutexLock lock(&mu_);
  free_.insert(free_.end(), blocks.begin(), blocks.end());
}

void BlockPool::Quarantine(const std::vector<uint32_t>& blocks) {
  absl::MutexLock lock(&mu_);
  usable_ -= static_cast<uint32_t>(blocks.size());
  quarantined_ += blocks.size();
}

uint64_t BlockPool::quarantined() const {
  absl::MutexLock lock(&mu_);
  return quarantined_;
}

}  // namespace kvcellar::bench
