// NamespaceSpec: what makes KV cache pages interchangeable, and its digest (docs/keys.md).
//
// Two engines may share a page only when everything that determines the page's bytes matches:
// tenant, model and weights revision, KV dtype, page size, attention layout and sharding. The
// namespace digest (SHA-256 of a versioned canonical encoding of those fields) roots every page
// key chain, so keys from different namespaces never collide and a page is never served to an
// engine whose KV bytes would differ. Clients in any language reproduce the encoding byte for byte
// from docs/keys.md; tests/data/keys_golden.json pins it.
//
// Plain value type; all methods are const and thread-compatible.
#ifndef KVCELLAR_CORE_NAMESPACE_SPEC_H_
#define KVCELLAR_CORE_NAMESPACE_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/page_key.h"

namespace kvcellar::core {

// Attention KV layout. The numeric values are part of the canonical encoding: never renumber.
enum class LayoutKind : uint32_t {
  kMha = 0,  // MHA and GQA: KV heads are split across TP ranks, one shard per rank.
  kMla = 1,  // MLA: one latent KV, identical on every rank, stored once.
};

// What a hit at a token boundary needs of one KV group of a hybrid model (docs/keys.md "Groups").
// The numeric values are part of the canonical encoding: never renumber.
enum class GroupKind : uint8_t {
  kFull = 0,    // Every page before the boundary: full attention, and any pool a hit needs whole
                // (SGLang's ALL_PAGES pools, e.g. a sparse-attention indexer).
  kWindow = 1,  // Sliding-window attention of W tokens: the pages of the last W - 1 tokens
                // before the boundary.
  kState = 2,   // Recurrent state (Mamba, Gated DeltaNet, short conv): the state saved at exactly
                // the boundary, stored with the boundary's last page.
};

// "full", "window" or "state".
absl::string_view GroupKindName(GroupKind kind);

struct KvGroup {
  GroupKind kind = GroupKind::kFull;
  uint32_t window_tokens = 0;  // kWindow: W, 1..kMaxWindowTokens; 0 for the other kinds.

  // Pages a hit needs before its boundary for a window of W tokens and pages of P tokens:
  // ceil((W - 1) / P), the pages holding the W - 1 tokens the next token attends to.
  uint32_t WindowPages(uint32_t page_size) const {
    return window_tokens <= 1 ? 0 : (window_tokens - 2) / page_size + 1;
  }
  bool operator==(const KvGroup& other) const {
    return kind == other.kind && window_tokens == other.window_tokens;
  }
};

// "mha" or "mla".
absl::string_view LayoutKindName(LayoutKind layout);
// Accepts "mha", "gqa" (an alias of mha) and "mla", lowercase.
absl::StatusOr<LayoutKind> ParseLayoutKind(absl::string_view name);

// The KV dtypes a namespace may name, exactly as spelled here (lowercase):
// fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8, nvfp4, mxfp4.
absl::Span<const absl::string_view> SupportedKvDtypes();

// Limits enforced by Validate(). Names come from where they bind.
// Far above the page sizes engines use (tens to hundreds of tokens); bounds the work per page.
inline constexpr uint32_t kMaxPageSize = 65536;
// Far above any TP group on one node; guards against garbage from a misconfigured client.
inline constexpr uint32_t kMaxTpSize = 1024;
// Per string field; bounds the encoding and the log lines that print it.
inline constexpr size_t kMaxNamespaceStringBytes = 1024;
// KV groups of one model: hybrids have a few (vLLM makes one group per run of same-kind layers).
inline constexpr size_t kMaxKvGroups = 16;
// Objects of one page, all groups and shards together (the index keeps a page's objects in one
// 64-bit mask: core/radix_index.h kMaxShardsPerPage).
inline constexpr uint32_t kMaxObjectsPerPage = 64;
// Far above any model's window (Gemma 3: 1024 tokens, gpt-oss: 128, Mistral: 4096).
inline constexpr uint32_t kMaxWindowTokens = 1u << 24;

struct NamespaceSpec {
  std::string tenant;          // May be empty (single-tenant deployments).
  std::string model_id;        // e.g. "meta-llama/Llama-3.1-8B-Instruct". Required.
  std::string model_revision;  // Revision or weights fingerprint. Required: KV from different
                               // weights must never be shared.
  std::string kv_dtype;        // One of SupportedKvDtypes(), e.g. "bf16", "fp8_e4m3".
  uint32_t page_size = 0;      // Tokens per page P, 1..kMaxPageSize.
  LayoutKind layout = LayoutKind::kMha;
  uint32_t tp_size = 1;      // Tensor-parallel size of the engine group (the shard spec).
  bool opaque_keys = false;  // Engine supplies its own 32-byte page keys (docs/keys.md).
  // The KV groups of a hybrid model. Empty (or one kFull group, the same namespace): one
  // full-attention group, every model that is not hybrid.
  std::vector<KvGroup> groups;

  // OK, or InvalidArgument naming the first bad field and its value.
  absl::Status Validate() const;

  // Objects stored per page and group: tp_size for MHA/GQA, 1 for MLA.
  uint32_t ShardsPerPage() const { return layout == LayoutKind::kMla ? 1 : tp_size; }
  // True when groups say more than one full-attention group.
  bool Hybrid() const {
    return groups.size() > 1 || (groups.size() == 1 && groups[0].kind != GroupKind::kFull);
  }
  // Groups of a page: groups.size(), or 1.
  uint32_t NumGroups() const { return Hybrid() ? static_cast<uint32_t>(groups.size()) : 1; }
  // Objects stored per page: ShardsPerPage() for each group. Object (g, r) of a page is
  // g * ShardsPerPage() + r.
  uint32_t ObjectsPerPage() const { return NumGroups() * ShardsPerPage(); }

  // The canonical encoding (docs/keys.md): length-prefixed strings and u32 LE integers in a
  // fixed order, "kvcellar-ns-v2" for a model that is not hybrid and "kvcellar-ns-v3" (the same
  // fields, then the groups) for one that is. It encodes ShardsPerPage(), not tp_size, so MLA
  // groups of any TP size share pages (their objects are byte-identical). Meaningful only for a
  // spec that passes Validate().
  std::string CanonicalEncoding() const;

  // SHA-256 of CanonicalEncoding(): ns_digest, the root of the namespace's key chains.
  PageKey Digest() const;
};

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_NAMESPACE_SPEC_H_
