// The revision of kvcellar.v1 this daemon implements (docs/api.md, compatibility): reported in
// RegisterEngineResponse and GetStatusResponse, bumped when RPCs or fields gain behaviour.
//   1: the first stable revision.
//   2: AdminService.WatchEvents (KV events, docs/events.md).
//   3: RegisterEngine maps only memory the registering engine owns; refusals are
//      ERROR_REASON_MEMORY_NOT_OWNED (docs/security.md). GetStatusResponse.tenants
//      (tenants.quotas). UnregisterEngine replies once the drain is over without holding a server
//      thread.
//   4: hybrid models: NamespaceSpec.groups, LayerLayout.group, Load/BackupSequence.group_blocks
//      (docs/api.md "Groups").
//   5: KvLayout.group_num_blocks: each KV group of a hybrid layout with a block pool of its own
//      (SGLang's host pools per KV kind).
//   6: self-describing KV events: BackupSequence.token_ids, ServerLimits.page_tokens; block hashes
//      in events are vLLM's integers by default (events.block_hashes).
#ifndef KVCELLAR_SERVER_RPC_API_REVISION_H_
#define KVCELLAR_SERVER_RPC_API_REVISION_H_

#include <cstdint>

namespace kvcellar::server {

inline constexpr uint32_t kApiRevision = 6;

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_RPC_API_REVISION_H_
