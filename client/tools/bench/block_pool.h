// BlockPool: the free list of the simulated engine's "GPU" KV blocks. Every rank of the engine
// group has the same number of blocks, and a request takes the same block indices on every rank,
// as an engine's block manager does for a TP group.
//
// A request takes the blocks for all its KV pages (loaded and computed) for its lifetime and gives
// them back when its Load and Backup ops are terminal. Blocks of an op whose outcome never became
// known (the daemon may still write them) are quarantined: they never return to the pool.
//
// Threading: thread-safe; Acquire blocks until enough blocks are free.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_BLOCK_POOL_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_BLOCK_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvcellar::bench {

class BlockPool {
 public:
  explicit BlockPool(uint32_t num_blocks);

  // n free blocks, waiting for them. ResourceExhausted when n exceeds every block not
  // quarantined (it would wait forever).
  absl::StatusOr<std::vector<uint32_t>> Acquire(uint32_t n);
  void Release(const std::vector<uint32_t>& blocks);
  void Quarantine(const std::vector<uint32_t>& blocks);
  uint64_t quarantined() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  uint32_t usable_ ABSL_GUARDED_BY(mu_);  // Blocks not quarantined.
  uint64_t quarantined_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_BLOCK_POOL_H_
