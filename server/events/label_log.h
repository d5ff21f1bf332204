// LabelLog: the pages' labels (core::PageLabel: their tokens, an opaque-key engine's own hash)
// kept in a file, so that a restarted daemon announces the pages it recovers with their tokens.
//
// Why: the index learns a page's tokens only from the Backup that stored it (BackupSequence
// .token_ids), and keeps them in process memory. Routers that hash tokens (NVIDIA Dynamo, llm-d:
// docs/events.md "Routers") drop a BlockStored without them, so without this file every page a
// restart brings back (L2 from the re-attached pool, core/slot_journal.h; L3 from a file tier's
// scan or a Redis tier's readback) would be invisible to them until it is stored again.
//
// Where: events.label_log. "auto" puts it beside the pool, /dev/shm/<pool.shm_name>.labels, with
// the pool's lifetime (a reboot clears both); a path on disk keeps it across reboots too, for
// file tiers that survive them; without a pool name, "auto" keeps none.
//
// Format: a 16-byte header (magic "KVCLABL1", then zero), then records appended as labels are
// attached, each
//   u32 body length | u32 CRC-32C of the body | body
//   body: namespace digest (32) | page key (32) | flags (u8: 1 = has engine hash) | 3 zero bytes
//         | engine hash (u64) | token count (u32) | tokens (u32 each)
// in this machine's byte order (the file is this node's). A record that is cut short or fails
// its CRC ends the log (a crash mid-append): what follows is dropped and the file truncated
// there. A label is never wrong for its page: a key names its bytes (chained keys are the tokens'
// hash, opaque keys the engine's), and the namespace digest scopes it to one tenant and model.
//
// Reading back (Open): every record into memory, by (namespace, key), up to max_recovered_bytes
// of labels (more are skipped and counted). Recovery takes a page's label as it indexes the page
// (Take), before the page's stored event, so the event carries it.
//
// Appending (Append): the attached labels are encoded into a buffer under a mutex and written by
// the log's thread every flush_interval (no fsync: a process crash keeps what was written; a
// machine crash may lose the last moments, and those pages are announced without tokens).
//
// Compaction: the file grows with every label ever attached. Once it has grown by
// max(compact_min_bytes, its size after the last compaction), the thread rewrites it from the
// live labels (the snapshot function: references to every index's labels, encoded after it)
// plus the recovered labels not yet
// taken while `keep_recovered` says recovery may still want them, into a temporary file renamed
// over the log. Labels attached during the snapshot are appended after it, so none is lost.
//
// Threads: Append and Take from any thread; the snapshot function runs on the log's thread.
#ifndef KVCELLAR_SERVER_EVENTS_LABEL_LOG_H_
#define KVCELLAR_SERVER_EVENTS_LABEL_LOG_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/index_events.h"
#include "core/page_key.h"

namespace kvcellar::server {

struct LabelLogOptions {
  std::string path;
  uint64_t max_recovered_bytes = uint64_t{1} << 30;  // Labels read back at most (token bytes).
  uint64_t compact_min_bytes = uint64_t{64} << 20;
  absl::Duration flush_interval = absl::Milliseconds(20);
};

struct LabelLogStats {
  uint64_t recovered = 0;          // Records read back at Open.
  uint64_t recovered_skipped = 0;  // Past max_recovered_bytes.
  uint64_t truncated_bytes = 0;    // Torn tail cut at Open.
  uint64_t taken = 0;              // Recovered labels given to recovery.
  uint64_t appended = 0;           // Records appended since Open.
  uint64_t write_errors = 0;       // Failed writes (the records are lost, counted).
  uint64_t compactions = 0;
  uint64_t file_bytes = 0;
};

class LabelLog {
 public:
  // Emits one live label.
  using Emit = absl::FunctionRef<void(const core::PageKey& ns, const core::PageKey& key,
                                      const std::shared_ptr<const core::PageLabel>& label)>;
  // Calls emit for every live label (every namespace's index).
  using Snapshot = std::function<void(Emit emit)>;

  // Reads the file back (creating it, mode 0600, when absent) and starts the thread. Fails when
  // the file cannot be opened or is not a label log (named in the error).
  static absl::StatusOr<std::unique_ptr<LabelLog>> Open(const LabelLogOptions& options);
  // Writes what is buffered, then stops.
  ~LabelLog();
  LabelLog(const LabelLog&) = delete;
  LabelLog& operator=(const LabelLog&) = delete;

  // Compaction's sources; until set, the log only grows. `keep_recovered`: whether recovered
  // labels not yet taken are still wanted (an L3 scan may yet bring their pages back).
  void SetSnapshot(Snapshot snapshot, std::function<bool()> keep_recovered)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The recovered label of `key` in namespace `ns`, once (nullptr when none).
  std::shared_ptr<const core::PageLabel> Take(const core::PageKey& ns, const core::PageKey& key)
      ABSL_LOCKS_EXCLUDED(recovered_mu_);
  // Records labels[i] of keys[i] where attached[i] (all when attached is empty).
  void Append(const core::PageKey& ns, absl::Span<const core::PageKey> keys,
              absl::Span<const std::shared_ptr<const core::PageLabel>> labels,
              const std::vector<bool>& attached) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes what is buffered now (tests).
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Compacts now, whatever the size (tests).
  void CompactNow() ABSL_LOCKS_EXCLUDED(mu_);
  LabelLogStats Stats() const ABSL_LOCKS_EXCLUDED(mu_, recovered_mu_);
  const std::string& path() const { return options_.path; }

 private:
  struct KeyPair {
    core::PageKey ns;
    core::PageKey key;
    template <typename H>
    friend H AbslHashValue(H h, const KeyPair& k) {
      return H::combine(std::move(h), k.ns, k.key);
    }
    bool operator==(const KeyPair&) const = default;
  };

  LabelLog(LabelLogOptions options, int fd);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `bytes` at the end of the file; false (counted) on failure.
  bool WriteOut(const std::string& bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Compact() ABSL_LOCKS_EXCLUDED(mu_);

  const LabelLogOptions options_;

  absl::Mutex io_mu_;  // Serializes file writes and compaction (the thread and Flush).
  int fd_ ABSL_GUARDED_BY(io_mu_) = -1;

  mutable absl::Mutex mu_;
  std::string buffer_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool compact_now_ ABSL_GUARDED_BY(mu_) = false;
  Snapshot snapshot_ ABSL_GUARDED_BY(mu_);
  std::function<bool()> keep_recovered_ ABSL_GUARDED_BY(mu_);
  uint64_t file_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t compacted_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // Size after the last compaction.
  LabelLogStats stats_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex recovered_mu_;
  absl::flat_hash_map<KeyPair, std::shared_ptr<const core::PageLabel>> recovered_
      ABSL_GUARDED_BY(recovered_mu_);
  uint64_t taken_ ABSL_GUARDED_BY(recovered_mu_) = 0;

  std::thread thread_;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_EVENTS_LABEL_LOG_H_
