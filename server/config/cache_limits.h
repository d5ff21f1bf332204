// CacheLimits: the bounds CacheService enforces and reports (v1.ServerLimits), and the session
// timings, derived once from the configuration.
//
// Limits the configuration does not expose yet are named constants here, each with where its
// value comes from. Clients read them from RegisterEngineResponse.limits and size their batches
// instead of discovering limits by error (docs/api.md, "Limits").
//
// Plain value type; thread-compatible.
#ifndef KVCELLAR_SERVER_CONFIG_CACHE_LIMITS_H_
#define KVCELLAR_SERVER_CONFIG_CACHE_LIMITS_H_

#include <cstdint>

#include "kvcellar/v1/common.pb.h"
#include "server/config/config.h"

namespace kvcellar::server {

// A scheduler step carries at most a few hundred running requests (vLLM's max_num_seqs defaults to
// 256, SGLang's to a few hundred); 4096 leaves room and bounds per-request bookkeeping.
inline constexpr uint32_t kMaxBatchSequences = 4096;
// Pins live from Match to Load, one or a few steps; an hour bounds what a client may ask for.
inline constexpr uint32_t kMaxPinLeaseMs = 3600 * 1000;
// WaitOps and Unregister drains block a client, never a daemon thread; 10 s is far longer than any
// copy of one step and short enough that a stuck client notices.
inline constexpr uint32_t kMaxWaitMs = 10000;
// Unfinished ops per session: a rank keeps a Load and a Backup or two per step in flight; 1024 is
// generous and bounds the memory a misbehaving client can tie up in op records.
inline constexpr uint32_t kMaxInflightOps = 1024;
// Prefetch deadlines and the SIM ready-signal wait default and bound: 10 s.
inline constexpr uint32_t kMaxPrefetchTimeoutMs = 10000;
// Terminal op results stay queryable for a minute: far more than the step or two between a
// submission and the WaitOps that confirms it, and bounded memory.
inline constexpr uint32_t kOpResultRetentionMs = 60000;
// How long a step_id's Match answer is kept for the other ranks of the instance: ranks of one
// step call Match within milliseconds of each other; 5 s absorbs a stalled rank.
inline constexpr uint32_t kGroupMatchWindowMs = 5000;
// Heartbeat interval = lease / 3 (common.proto: "about a third of lease_ms"), so two beats may be
// lost before the lease lapses.
inline constexpr uint32_t kHeartbeatsPerLease = 3;

struct CacheLimits {
  uint32_t max_batch_pages = 0;
  uint32_t max_batch_sequences = kMaxBatchSequences;
  uint64_t max_message_bytes = 0;
  uint32_t default_pin_lease_ms = 0;
  uint32_t max_pin_lease_ms = kMaxPinLeaseMs;
  uint32_t max_wait_ms = kMaxWaitMs;
  uint32_t max_inflight_ops = kMaxInflightOps;
  uint32_t max_prefetch_timeout_ms = kMaxPrefetchTimeoutMs;
  uint32_t op_result_retention_ms = kOpResultRetentionMs;
  uint32_t max_completion_slots = 0;
  uint32_t max_layers = 0;
  uint32_t max_regions = 0;
  uint32_t group_match_window_ms = kGroupMatchWindowMs;
  // Backup's token_ids are kept for the events (events.endpoint set and events.page_tokens), up
  // to max_token_bytes per namespace.
  bool page_tokens = false;
  uint64_t max_token_bytes = 0;
  // Events publish (events.endpoint set): a Backup labels its pages with what events say of
  // them (core::PageLabel: tokens, an opaque-key engine's own hash).
  bool label_pages = false;

  // Session lease and heartbeat interval (sessions.lease_ms).
  uint32_t lease_ms = 0;
  uint32_t heartbeat_interval_ms = 0;

  static CacheLimits FromConfig(const Config& config);
  void ToProto(v1::ServerLimits* out) const;

  // A requested pin lease: 0 = the default; clamped to the maximum.
  uint32_t PinLeaseMs(uint32_t requested) const;
};

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_CONFIG_CACHE_LIMITS_H_
