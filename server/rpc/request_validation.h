// Request validation for CacheService: every check that decides whether a request is accepted,
// made before anything is copied or changed (docs/api.md, "Error model": validation is all or
// nothing).
//
// Each function returns OK or an error built with cache_error.h: the gRPC code, the ErrorReason
// and the request field at fault, with a message naming the field and its value
// ("sequences[2].device_blocks[5] (9000) out of range [0, 4096)"). Checks that need mutable
// session state (a block still used by an unfinished op) are made atomically with taking the
// blocks, in Session::Reserve.
//
// Threads: pure functions; call from any thread.
#ifndef KVCELLAR_SERVER_RPC_REQUEST_VALIDATION_H_
#define KVCELLAR_SERVER_RPC_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/namespace_spec.h"
#include "gpu/device_backend.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/config/cache_limits.h"
#include "server/session/session_registry.h"

namespace kvcellar::server {

// Ids, names and request ids: "at most 256 bytes" (cache_service.proto).
inline constexpr size_t kMaxIdBytes = 256;
// In a hybrid namespace's group_blocks: this group's object of this page is not moved.
using core::kNoBlock;

// A RegisterEngineRequest turned into the daemon's types.
struct Registration {
  bool worker = true;
  core::NamespaceSpec spec;
  v1::DeviceKind device_kind = v1::DEVICE_KIND_UNSPECIFIED;
  // Worker only: what the device backend opens. Its completion_region stays empty: the daemon
  // drives the engine's signals itself (sim_counter_channel.h).
  gpu::EngineSpec engine;
  uint32_t num_load_slots = 0;
  uint32_t num_ready_slots = 0;
  // SIM: the engine's KVCSIG01 counters object (completion.sim_counters), or empty.
  std::string sim_counters_name;
  uint64_t sim_counters_bytes = 0;
  std::vector<std::string> cuda_ready_events;  // One 64-byte handle per ready slot.
};

// Validates and converts a registration. `served` are the device kinds the daemon has a backend
// for (DeviceSet::kinds(); empty when it has none); a WORKER of another kind is
// DEVICE_UNAVAILABLE.
absl::StatusOr<Registration> ParseRegistration(const v1::RegisterEngineRequest& request,
                                               const CacheLimits& limits,
                                               absl::Span<const v1::DeviceKind> served);

// The session fields an accepted registration fixes: instance, rank and role, shard and shard
// writer, TP size, device kind, blocks, layers, completion slots and CUDA ready events.
// (CacheServiceImpl::DoRegister adds the id, namespace, owner, mapping and listing fields.)
void FillSessionGeometry(const v1::RegisterEngineRequest& request, const Registration& reg,
                         SessionInfo* info);

// Converts a NamespaceSpec message (fields are checked by core::NamespaceSpec::Validate; errors
// name `namespace_spec.<field>`).
absl::StatusOr<core::NamespaceSpec> ParseNamespaceSpec(const v1::NamespaceSpec& spec);

// A Load or Backup from a session that may not make it (a SCHEDULER): WRONG_ROLE.
absl::Status CheckWorker(const SessionInfo& session, absl::string_view rpc);

absl::Status ValidateMatch(const v1::MatchRequest& request, const core::NamespaceSpec& spec,
                           const CacheLimits& limits);
// Prefetch: policy (NONE is INVALID_ARGUMENT), key blobs, parent keys, request ids and the batch
// limits; any session of the instance may prefetch.
absl::Status ValidatePrefetch(const v1::PrefetchRequest& request, const CacheLimits& limits);
absl::Status ValidateLoad(const v1::LoadRequest& request, const SessionInfo& session,
                          const CacheLimits& limits);
absl::Status ValidateBackup(const v1::BackupRequest& request, const SessionInfo& session,
                            const CacheLimits& limits);
// Backup sequence i's token_ids (part of ValidateBackup): none, or page_size_tokens per page,
// which in a chained namespace hash to its page keys from its parent.
absl::Status CheckBackupTokens(const v1::BackupSequence& seq, int i, const SessionInfo& session);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_REQUEST_VALIDATION_H_
