// L2Sealer: checksums the pages the slot journal recorded as LANDED and marks them COMMITTED,
// on a low-priority thread of its own, so that recording pages for a warm restart costs the
// data path no CRC pass (core/slot_journal.h "Why sealing is deferred").
//
// Backups and prefetches hand each landed object here (Enqueue) right after the journal's
// MarkLanded, before the page becomes visible; they never wait. The thread takes them in order:
// BeginSeal (skipped if the slot was freed since), CRC-32C of the slot's bytes, EndSeal. A freed
// slot's Clear waits for an EndSeal in progress on it, so the bytes are stable while read.
//
// Bounded: at most kMaxPending objects wait. Past that an object is not queued (counted in
// `overflowed`): it stays LANDED, is dropped by a restart after a crash, and is sealed by the
// sweep at shutdown.
//
// Shutdown (the destructor, on SIGTERM after the data path stopped): the queue is sealed, then
// every LANDED record of an allocated slot (overflowed ones) is swept and sealed too, so a clean
// stop keeps every page.
//
// Threads: Enqueue from any thread (the op completion thread, the prefetcher); the sealer's own
// thread; pending() and the counters from any.
#ifndef KVCELLAR_SERVER_L2_L2_SEALER_H_
#define KVCELLAR_SERVER_L2_L2_SEALER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/host_pool.h"
#include "core/page_key.h"
#include "core/slot_journal.h"

namespace kvcellar::server {

class L2Sealer {
 public:
  // Objects waiting before new ones are left LANDED: at 64 KiB each, 16 GiB of pages.
  static constexpr size_t kMaxPending = 256 * 1024;

  // Both outlive the sealer. Starts the thread.
  L2Sealer(core::HostPool* pool, core::SlotJournal* journal);
  // Seals what is queued, sweeps the journal for LANDED records of allocated slots and seals
  // them, and joins the thread.
  ~L2Sealer();
  L2Sealer(const L2Sealer&) = delete;
  L2Sealer& operator=(const L2Sealer&) = delete;

  // The object in `slot` (page `key`, `length` bytes) landed and is recorded LANDED.
  void Enqueue(core::SlotRef slot, const core::PageKey& key, uint64_t length)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Objects waiting to be sealed now.
  uint64_t pending() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t sealed() const { return sealed_.load(std::memory_order_relaxed); }
  uint64_t overflowed() const { return overflowed_.load(std::memory_order_relaxed); }

 private:
  struct Item {
    core::SlotRef slot;
    core::PageKey key;
    uint64_t length = 0;
  };

  void Run();
  // BeginSeal, CRC, EndSeal. False when the slot was freed meanwhile.
  bool Seal(const Item& item);
  // Seals every LANDED record of an allocated slot (shutdown).
  void Sweep();

  core::HostPool* const pool_;
  core::SlotJournal* const journal_;
  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> sealed_{0};
  std::atomic<uint64_t> overflowed_{0};
  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_L2_L2_SEALER_H_
