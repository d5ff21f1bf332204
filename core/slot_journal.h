// SlotJournal: what the L2 pool holds, recorded in memory that outlives the daemon, so that a
// restarted daemon can make the surviving bytes reachable again (warm restart, DESIGN.md "Restart
// and fleet").
//
// The pool's bytes live in a named shared memory object (platform/host_memory.h); this journal
// lives in a second, small one beside it. It holds:
//   - a header: format version and the pool geometry it was written for (capacity, region size,
//     region count, slot sizes). A journal of another geometry is refused at Attach, with the
//     difference named, and the daemon starts empty.
//   - a namespace log: an append-only list of entries, one when a namespace is created (its spec)
//     and one each time its page geometry is fixed (the per-layer buffer sizes, run-length
//     coded). Namespace ids are the registry's (dense, from 1, in creation order), so a restarted
//     daemon that creates the logged namespaces in order gives them the same ids and every record
//     below still names the right one.
//   - one 96-byte record per slot position: region r, slot i is record r * max_slots_per_region
//     + i, where max_slots_per_region is what the smallest size class fits in a region. A record
//     names the namespace, page key, parent key, shard, size class, object length and the
//     CRC-32C of the object's bytes, plus a CRC-32C of the record itself.
//
// Record lifecycle, and why a crash never makes a wrong page visible:
//   MarkWriting  when a write into the slot begins (a Backup's gather, an L3 prefetch): state
//                WRITING with the page's identity. A restart drops it: the bytes may be partial.
//   MarkLanded   once every byte has landed, before the index makes the page visible: state
//                LANDED. A restart drops it too (`unsealed`): its bytes are whole but unchecked.
//   BeginSeal/EndSeal  later, off the data path (server/l2/l2_sealer.h): the CRC-32C of the
//                slot's bytes, then state COMMITTED. While a slot is being sealed, Clear waits, so
//                the bytes the checksum reads cannot be freed and rewritten under it.
//   MarkCommitted  LANDED and sealed in one step, for callers that have the checksum already.
//   Clear        before the slot goes back to the allocator (HostPool::Free calls it): state
//                EMPTY, one byte, so the slot can be reused without a stale record.
// Every step rewrites the whole record and stores the record checksum last, after a release
// fence. A process crash keeps every store it made (the memory is the kernel's, not the
// process's), so at restart each record is EMPTY, WRITING, LANDED, COMMITTED and whole, or torn
// mid-update (its record checksum fails): only whole COMMITTED records whose payload checksum
// verifies against the slot's bytes are trusted. A node reboot clears /dev/shm and so both
// objects: nothing survives it.
//
// Why sealing is deferred: a CRC-32C pass over every page at commit, on the op's completion path,
// cost Backup 31-39% of its throughput on the sim device (BM_BackupJournal, 0.61-0.69x), where
// the rule is that recording for a restart must cost none measurable. Sealed a moment later by a
// low-priority thread, a page is recovered after a SIGKILL once it was sealed (the lag is the
// sealer's queue: milliseconds when it keeps up) and always after a SIGTERM, which seals
// everything before the daemon exits.
//
// Cost: 96 bytes per slot position, 0.15% of the pool with 64 KiB slots (the smallest default
// class), plus the 4 KiB header and the namespace log (kNamespaceLogBytes).
//
// Threads: a record is written only by whoever holds its slot (one writer at a time, handed over
// by the op machinery), so the record calls take no lock. Namespace appends take mu_.
// Read/Namespaces are for recovery, before the journal is shared. The memory is this machine's
// only, so fields are stored in native byte order.
#ifndef KVCELLAR_CORE_SLOT_JOURNAL_H_
#define KVCELLAR_CORE_SLOT_JOURNAL_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/host_pool.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/slot_ref.h"

namespace kvcellar::core {

// The pool geometry a journal is written for (HostPool's, after validation).
struct SlotJournalGeometry {
  uint64_t capacity_bytes = 0;
  uint64_t region_bytes = 0;
  uint32_t region_count = 0;
  std::vector<uint64_t> slot_sizes;  // Strictly increasing; slot_sizes[0] is the smallest.

  static SlotJournalGeometry Of(const HostPool& pool) {
    return {pool.capacity_bytes(), pool.region_bytes(), pool.region_count(), pool.slot_sizes()};
  }
};

// One logged namespace: its spec, and its page geometry when one was fixed (per layer, the bytes
// per block of K or the MLA latent, then of V: 0 for MLA) with that geometry's epoch: the number
// of times the namespace's geometry was fixed. A namespace whose geometry is fixed anew (nothing
// held the old one) gets the next epoch, and records carry the epoch they were written under, so
// a page of the old geometry (a slot a write-back still held) is never read as one of the new.
struct JournalNamespace {
  uint32_t id = 0;
  NamespaceSpec spec;
  std::optional<std::vector<std::pair<uint64_t, uint64_t>>> buffers;
  uint16_t geometry_epoch = 0;
};

enum class SlotRecordState : uint8_t {
  kEmpty = 0,
  kWriting = 1,
  kCommitted = 2,
  kTorn = 3,    // Read only: the record's own checksum fails (a crash mid-update).
  kLanded = 4,  // Bytes whole, checksum not computed yet.
};

// A record as Read returns it.
struct SlotRecord {
  SlotRecordState state = SlotRecordState::kEmpty;
  uint32_t ns = 0;
  uint16_t shard = 0;
  uint16_t size_class = 0;
  uint16_t geometry_epoch = 0;
  uint64_t length = 0;
  uint32_t payload_crc = 0;
  PageKey key;
  std::optional<PageKey> parent;
};

class SlotJournal {
 public:
  // Bytes of the namespace log: thousands of namespaces of a few hundred bytes each (specs are
  // short; geometry is run-length coded, so 80 equal layers are one run). Namespaces past it are
  // not logged, and their pages do not survive a restart (AppendNamespace says so).
  static constexpr uint64_t kNamespaceLogBytes = 1 << 20;
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kRecordBytes = 96;
  static constexpr uint32_t kFormatVersion = 1;

  // Bytes of memory a journal for `geometry` needs. InvalidArgument for an empty geometry.
  static absl::StatusOr<uint64_t> Bytes(const SlotJournalGeometry& geometry);

  // An empty journal for `geometry` over `memory` (at least Bytes(geometry), 64-byte aligned):
  // every byte of it is cleared first.
  static absl::StatusOr<std::unique_ptr<SlotJournal>> Format(const SlotJournalGeometry& geometry,
                                                             std::span<uint8_t> memory);
  // The journal an earlier process left in `memory`. FailedPrecondition naming what differs (the
  // format version, a geometry field, a damaged header) when it cannot be used for `geometry`;
  // the caller then Formats it and starts empty.
  static absl::StatusOr<std::unique_ptr<SlotJournal>> Attach(const SlotJournalGeometry& geometry,
                                                             std::span<uint8_t> memory);

  SlotJournal(const SlotJournal&) = delete;
  SlotJournal& operator=(const SlotJournal&) = delete;

  // The namespace log. A namespace's spec when it is created, its geometry when fixed.
  // ResourceExhausted when the log is full (nothing is written).
  absl::Status AppendNamespace(uint32_t id, const NamespaceSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AppendGeometry(uint32_t id, uint16_t geometry_epoch,
                              std::span<const std::pair<uint64_t, uint64_t>> buffers)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The logged namespaces by id (the last geometry of each wins); entries whose checksum fails
  // are skipped.
  std::vector<JournalNamespace> Namespaces() const ABSL_LOCKS_EXCLUDED(mu_);

  // Records; `slot` must be inside the geometry (unchecked: hot path).
  void MarkWriting(SlotRef slot, uint32_t ns, uint16_t geometry_epoch, uint16_t shard,
                   const PageKey& key, const std::optional<PageKey>& parent);
  void MarkCommitted(SlotRef slot, uint64_t length, uint32_t payload_crc);
  // LANDED with its length; returns the record's page key (what BeginSeal checks).
  PageKey MarkLanded(SlotRef slot, uint64_t length);
  // Sealing, one slot at a time. BeginSeal: true when the slot's record is LANDED for `key` (not
  // freed and reused since); Clear of that slot then waits until EndSeal, which stores the
  // checksum and COMMITTED.
  bool BeginSeal(SlotRef slot, const PageKey& key);
  void EndSeal(SlotRef slot, uint32_t payload_crc);
  void Clear(SlotRef slot);
  // The record at (region, index), index < max_slots_per_region().
  SlotRecord Read(uint32_t region, uint32_t index) const;
  void ClearAt(uint32_t region, uint32_t index);

  uint32_t region_count() const { return region_count_; }
  uint32_t max_slots_per_region() const { return max_slots_per_region_; }

 private:
  SlotJournal(const SlotJournalGeometry& geometry, std::span<uint8_t> memory);
  uint8_t* RecordAt(uint32_t region, uint32_t index) const {
    return records_ + (uint64_t{region} * max_slots_per_region_ + index) * kRecordBytes;
  }
  absl::Status Append(uint32_t id, uint8_t kind, const std::string& payload)
      ABSL_LOCKS_EXCLUDED(mu_);

  uint8_t* const base_;
  uint32_t region_count_ = 0;
  uint32_t max_slots_per_region_ = 0;
  uint8_t* log_ = nullptr;
  uint8_t* records_ = nullptr;
  mutable absl::Mutex mu_;  // Serializes namespace appends (rare: namespace creation).
  // The slot being sealed (SlotRef::Packed), or kNotSealing; Clear of it waits on seal_cv_.
  // std::mutex: Clear runs on every Free (absl::Mutex's debug-build deadlock detection costs
  // ~75 ns a lock here; see core/host_pool.h).
  static constexpr uint64_t kNotSealing = ~uint64_t{0};
  std::mutex seal_mu_;
  std::condition_variable seal_cv_;
  uint64_t sealing_ = kNotSealing;  // Guarded by seal_mu_.
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_SLOT_JOURNAL_H_
