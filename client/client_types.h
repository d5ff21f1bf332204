// The value types of libkvcellar-client's C++ API: options, the registration of an engine rank,
// and the results of Match, Load, Backup, WaitOps and Release.
//
// These mirror kvcellar.v1 (proto/kvcellar/v1/*.proto; docs/api.md) without exposing generated
// protobuf types, so an engine links against this header and the library alone. Enum values equal
// the proto's numbers. Every result carries an absl::Status saying why it is a miss when the cache
// could not serve it; the result itself is always usable (a miss, never garbage).
#ifndef KVCELLAR_CLIENT_CLIENT_TYPES_H_
#define KVCELLAR_CLIENT_CLIENT_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/channel.h"
#include "core/kv_layout.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"

namespace kvcellar::client {

// The kvcellar.v1 revision this library was built against (RegisterEngineRequest).
inline constexpr uint32_t kClientApiRevision = 1;
inline constexpr char kClientVersion[] = "libkvcellar-client 0.2.0";

struct ClientOptions {
  // Socket path or HOST:PORT (channel.h). Empty: platform::DefaultSocketPath().
  std::string addr;
  ChannelOptions channel;
  // Deadline of every unary RPC. A daemon that is slow answers a miss within this (plus WaitOps'
  // own timeout for WaitOps). 250 ms: two orders of magnitude above a healthy call (tens of us)
  // and still short next to a prefill that the miss makes the engine recompute.
  absl::Duration rpc_timeout = absl::Milliseconds(250);
  // Deadline of RegisterEngine, which does more (the daemon maps the engine's memory, and
  // replacing a lost session waits for that session's copies). Only Client::Register waits for
  // it; re-registrations run on the heartbeat thread.
  absl::Duration register_timeout = absl::Seconds(2);
  // Delays between reconnection attempts (re-registration, probes of a suspect daemon): from
  // min, doubling, to max. Also given to gRPC as its subchannel reconnect backoff.
  absl::Duration reconnect_backoff_min = absl::Milliseconds(100);
  absl::Duration reconnect_backoff_max = absl::Seconds(5);
  // Run the background thread that renews leases and re-registers after a daemon restart.
  // Without it sessions expire after lease_ms (tests only).
  bool heartbeat = true;
  // Heartbeat period; zero uses the daemon's heartbeat_interval_ms.
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  // Per session: tokens and keys of recently keyed sequences, so that the next turn of a
  // conversation hashes only its new pages (key_chain_cache.h). 0 turns the cache off. 16 MiB
  // holds about 100 conversations of 2048 pages at page size 16.
  size_t key_cache_bytes = size_t{16} << 20;
};

enum class DeviceKind : uint32_t { kUnspecified = 0, kCuda = 1, kSim = 2 };

// How the daemon signals per-layer Load completion and waits for Backup readiness
// (CompletionChannel in cache_service.proto). All zero: no channel (Loads complete through
// WaitOps only; Backups carry no ready signal).
struct CompletionChannelSpec {
  uint32_t num_load_slots = 0;
  uint32_t num_ready_slots = 0;
  // SIM: the counters region (client/sim_signals.h creates one).
  std::string sim_shm_name;
  uint64_t sim_size_bytes = 0;
  // CUDA: 64-byte cudaIpcEventHandle_t's, load slot-major then ready.
  std::string cuda_load_event_handles;
  std::string cuda_ready_event_handles;
};

// One engine rank (WORKER) or scheduler process (SCHEDULER) to register.
struct EngineRegistration {
  std::string instance_id;
  uint32_t rank = 0;
  bool scheduler = false;
  // Includes tp_size and the page size. Keys are computed from it locally.
  core::NamespaceSpec ns;
  DeviceKind device_kind = DeviceKind::kSim;
  std::string device_uuid;  // 16 raw bytes (SIM: any); empty: 16 zero bytes.
  std::string device_name;
  // Regions' handles: SIM shm names, or CUDA 64-byte IPC handles (by device_kind).
  core::KvLayout layout;
  CompletionChannelSpec completion;
  // For the first registration only: end a live session holding (instance_id, rank) first.
  // Re-registrations after a lost session always replace.
  bool replace_existing = false;
  std::string engine_name;
};

// What the daemon answered at the current registration.
struct SessionInfo {
  uint64_t session_id = 0;  // 0 while not registered.
  uint64_t generation = 0;  // Registrations of this Session so far (1 after the first).
  uint64_t daemon_epoch = 0;
  uint32_t lease_ms = 0;
  uint32_t heartbeat_interval_ms = 0;
  uint32_t shard_index = 0;
  uint32_t num_shards = 0;
  bool is_shard_writer = false;
  uint64_t page_object_bytes = 0;
  uint32_t api_revision = 0;
  uint32_t max_batch_pages = 0;
  uint32_t max_batch_sequences = 0;
  uint32_t max_wait_ms = 0;
  // The daemon's KV events carry each page's tokens: send them in BackupSequence::tokens.
  bool page_tokens = false;
  std::string daemon_version;
  // The daemon's L3 tiers in lookup order; MatchResult::l3_hit_pages_by_tier is indexed alike.
  std::vector<std::string> l3_tier_names;
  core::PageKey ns_digest;  // Computed locally; equal to the daemon's when usable.
  // The policies the daemon's UNSPECIFIED means.
  uint32_t default_write_policy = 0;     // WritePolicy value.
  uint32_t default_prefetch_policy = 0;  // PrefetchPolicy value.
};

enum class SessionState {
  kConnecting,  // Not registered yet, or lost and re-registering with backoff.
  kActive,      // Registered; data calls go to the daemon.
  kSuspect,     // Registered, but the last call failed in transport: calls miss until a probe
                // succeeds (so a slow daemon costs one deadline, not one per step).
  kRefused,     // The daemon's ns_digest differs from ours: the cache is never used (logged once).
  kClosed,      // Close() was called.
};
const char* SessionStateName(SessionState state);

enum class PrefetchPolicy : uint32_t {
  kUnspecified = 0,
  kNone = 1,
  kBestEffort = 2,
  kWaitComplete = 3,
  kTimeout = 4,
};

enum class WritePolicy : uint32_t {
  kUnspecified = 0,
  kWriteThrough = 1,
  kWriteThroughSelective = 2,
  kWriteBack = 3,
  kL2Only = 4,
};

// PageStatus of common.proto, same numbers. Values the library does not know arrive as
// kInternalError (a failed page).
enum class PageStatus : uint8_t {
  kUnspecified = 0,
  kOk = 1,
  kPending = 2,
  kMiss = 3,
  kAlreadyPresent = 4,
  kInFlight = 5,
  kSkipped = 6,
  kNoSpace = 7,
  kThrottled = 8,
  kParentMissing = 9,
  kTimeout = 10,
  kCancelled = 11,
  kL3Error = 12,
  kChecksumError = 13,
  kDeviceError = 14,
  kInternalError = 15,
};
const char* PageStatusName(PageStatus status);

enum class OpState : uint8_t {
  kUnspecified = 0,
  kPending = 1,
  kDone = 2,
  kFailed = 3,
  kCancelled = 4,
  kUnknown = 5,
};
const char* OpStateName(OpState state);
inline bool IsTerminal(OpState s) { return s != OpState::kPending && s != OpState::kUnspecified; }

enum class OpKind : uint8_t { kUnspecified = 0, kPrefetch = 1, kLoad = 2, kBackup = 3 };

// Names one op across re-registrations: op ids are unique within one registration (generation)
// of one daemon only.
struct OpRef {
  uint64_t op_id = 0;  // 0: the submission never reached the daemon, or its outcome is unknown.
  uint64_t generation = 0;
};

struct SequenceResult {
  std::vector<PageStatus> page_status;  // Empty when WaitOps omitted them.
  uint32_t leading_ok_pages = 0;
};

// An op's state as of submission or as of a WaitOps.
struct OpResult {
  OpRef ref;
  OpKind kind = OpKind::kUnspecified;
  // kPending: still running, or (with !status.ok()) its outcome is not known yet: the submission
  // or the session was lost in transport and the daemon may still touch the op's device blocks
  // until the session is confirmed ended (re-registration or lease expiry). kFailed: the daemon
  // no longer touches the blocks; nothing usable landed beyond leading_ok_pages.
  OpState state = OpState::kFailed;
  std::vector<SequenceResult> sequences;
  uint64_t elapsed_us = 0;
  std::string error_message;  // The daemon's, for FAILED/CANCELLED.
  // OK when the daemon answered; else why this is a miss (transport, session lost, refused).
  absl::Status status;

  bool done() const { return state == OpState::kDone; }
  bool terminal() const { return IsTerminal(state); }
  // The usable prefix of sequence i (0 when the op is not DONE).
  uint32_t usable_pages(size_t i) const {
    return state == OpState::kDone && i < sequences.size() ? sequences[i].leading_ok_pages : 0;
  }
};

// ---- Match -------------------------------------------------------------------------------------

struct MatchSequence {
  // Either every token of the sequence from position 0 (keys are computed locally from the
  // namespace digest) ...
  absl::Span<const uint32_t> tokens;
  // ... or the keys of pages num_computed_pages, num_computed_pages + 1, ... (opaque namespaces
  // must use keys).
  absl::Span<const core::PageKey> keys;
  // Leading pages the engine already holds; not looked up.
  uint32_t num_computed_pages = 0;
  std::string request_id;
};

struct MatchOptions {
  bool pin = false;
  uint32_t pin_lease_ms = 0;
  PrefetchPolicy prefetch_policy = PrefetchPolicy::kNone;
  uint32_t prefetch_timeout_ms = 0;
  uint64_t step_id = 0;
  uint32_t l3_lookup_timeout_ms = 0;
};

struct MatchResult {
  uint32_t l2_hit_pages = 0;  // From num_computed_pages.
  uint32_t l3_hit_pages = 0;
  // l3_hit_pages split by the first L3 tier holding each page (SessionInfo::l3_tier_names
  // order); empty when l3_hit_pages is 0.
  std::vector<uint32_t> l3_hit_pages_by_tier;
  uint32_t total_pages = 0;
  uint32_t prefetch_pages = 0;
  uint64_t pin_id = 0;
  // With tokens: the keys of every full page from page 0 (computed locally), so the engine
  // Loads keys[ncp, ncp + l2_hit_pages) and Backs up what follows. With keys: empty.
  std::vector<core::PageKey> keys;
};

struct MatchReply {
  std::vector<MatchResult> results;  // One per sequence, always (misses on failure).
  OpRef prefetch_op;
  bool memoized = false;
  absl::Status status;  // Why everything is a miss, when not OK.
};

// ---- Load / Backup ----------------------------------------------------------------------------

// In a hybrid namespace's blocks: this group's object of this page is not moved.
using core::kNoBlock;

struct LoadSequence {
  absl::Span<const core::PageKey> keys;
  // blocks[i] receives keys[i]. In a hybrid namespace (NamespaceSpec::groups): N x G blocks,
  // page-major, kNoBlock where group g of page i is not loaded.
  absl::Span<const uint32_t> blocks;
  uint64_t pin_id = 0;
  bool release_pin = false;
  std::string request_id;
};

struct LoadOptions {
  bool signal_layers = false;
  uint32_t completion_slot = 0;
};

struct BackupSequence {
  // Key of the page before keys[0]; nullopt-like: all-zero with has_parent false for page 0.
  core::PageKey parent;
  bool has_parent = false;
  absl::Span<const core::PageKey> keys;
  absl::Span<const uint32_t> blocks;  // As LoadSequence::blocks.
  std::string request_id;
  // The pages' tokens, page_size each, page 0 first; or empty. Sent only to a daemon that wants
  // them for its KV events (SessionInfo::page_tokens); in a chained namespace they must hash to
  // `keys`, else the daemon refuses the Backup (INVALID_ARGUMENT).
  absl::Span<const uint32_t> tokens;
};

struct BackupOptions {
  // Ready signal: the daemon gathers after ready word `ready_slot` reaches ready_token (SIM) or
  // ready event `ready_slot` completes (CUDA). !has_ready: the blocks are ready now.
  bool has_ready = false;
  uint32_t ready_slot = 0;
  uint64_t ready_token = 0;  // SIM: strictly increasing per slot, > 0. CUDA: 0.
  WritePolicy write_policy = WritePolicy::kUnspecified;
  uint32_t ready_timeout_ms = 0;
};

// ---- WaitOps / Release ------------------------------------------------------------------------

struct WaitOptions {
  absl::Duration timeout = absl::ZeroDuration();  // 0 polls.
  bool any = false;                               // Return when one op is terminal.
  bool omit_page_status = false;
};

enum class ReleaseOutcome : uint8_t {
  kUnspecified = 0,
  kReleased = 1,
  kCancelled = 2,
  kAlreadyDone = 3,
  kNotCancellable = 4,
  kUnknown = 5,
};

struct ReleaseReply {
  std::vector<ReleaseOutcome> pin_outcomes;
  std::vector<ReleaseOutcome> op_outcomes;
  absl::Status status;
};

// What Session::Close's UnregisterEngine did (its reply). `unregistered` is false when there was
// no live session to unregister or the call failed (`status`).
struct CloseReply {
  bool unregistered = false;
  uint32_t ops_completed = 0;  // Ops that ended within the drain.
  uint32_t ops_cancelled = 0;  // Ops still pending at its end, cancelled.
  uint32_t pins_released = 0;
  absl::Status status;
};

// ---- Stats ------------------------------------------------------------------------------------

// Counters over the client's lifetime (all sessions). Failures are cache events, not errors: each
// is a step the engine recomputed.
struct ClientStats {
  uint64_t rpcs_ok = 0;
  uint64_t rpcs_failed = 0;             // Any non-OK RPC, including those counted below.
  uint64_t rpcs_unavailable = 0;        // Daemon down or unreachable.
  uint64_t rpcs_deadline_exceeded = 0;  // Daemon slow.
  uint64_t rpcs_unimplemented = 0;      // Daemon without CacheService.
  // Data calls (Match, Load, Backup) answered as a miss without the daemon's answer: not
  // registered, suspect, refused, or the RPC failed.
  uint64_t degraded_calls = 0;
  uint64_t match_calls = 0;
  uint64_t match_pages = 0;
  uint64_t match_l2_hit_pages = 0;
  // Page keys computed from tokens (Match, ComputeKeys), and of those taken from the key cache
  // instead of hashed (a conversation's earlier turns).
  uint64_t keyed_pages = 0;
  uint64_t keyed_pages_reused = 0;
  uint64_t registrations = 0;    // Successful RegisterEngine, first ones included.
  uint64_t reregistrations = 0;  // Of which after a lost session.
  uint64_t registration_failures = 0;
  uint64_t sessions_lost = 0;  // Session unknown, daemon restarted, lease lapsed, or forced.
  uint64_t heartbeats_ok = 0;
  uint64_t heartbeats_failed = 0;
  uint64_t ns_digest_mismatches = 0;
  // Ops reported FAILED because their session ended (daemon restart, lease).
  uint64_t ops_failed_session_lost = 0;
  // Load/Backup submissions whose outcome the transport lost (the session is then replaced).
  uint64_t uncertain_submissions = 0;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_CLIENT_TYPES_H_
