// Fixtures shared by the server's unit tests (tests/server/<room>/<name>_test.cc test
// server/<room>/<name>.h): the test engines' geometry, namespace specs, KV layouts, a small real
// host pool, and L2World, the L2 side of a CacheService (pool, namespace registry, metrics,
// L2Space) without the service, its threads or gRPC. cache_test_harness.h builds the whole
// service on the same pieces.
#ifndef KVCELLAR_TESTS_SERVER_COMPONENT_FIXTURES_H_
#define KVCELLAR_TESTS_SERVER_COMPONENT_FIXTURES_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/eviction_policy.h"
#include "core/host_pool.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/radix_index.h"
#include "gpu/kv_layout.h"
#include "gtest/gtest.h"
#include "kvcellar/v1/common.pb.h"
#include "server/l2/l2_space.h"
#include "server/metrics/cache_metrics.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "server/status_util.h"

namespace kvcellar::server::testing {

namespace v1 = ::kvcellar::v1;

// Geometry of the test engines: 2 layers, K and V of 4 KiB per block: 16 KiB page objects, and
// the pool has a 16 KiB size class so that slot counts are exact.
inline constexpr uint32_t kLayers = 2;
inline constexpr uint64_t kBytesPerBlock = 4096;
inline constexpr uint64_t kObjectBytes = kLayers * 2 * kBytesPerBlock;
inline constexpr uint32_t kPageSize = 4;  // Tokens per page.
inline constexpr uint64_t kRegionBytes = 1 << 20;
inline constexpr uint64_t kSlotsPerRegion = kRegionBytes / kObjectBytes;  // 64

inline v1::NamespaceSpec Spec(uint32_t tp = 1, bool mla = false, bool opaque = false,
                              const std::string& model = "test-model") {
  v1::NamespaceSpec s;
  s.set_tenant("team-a");
  s.set_model_id(model);
  s.set_model_revision("rev1");
  s.set_kv_dtype("bf16");
  s.set_page_size_tokens(kPageSize);
  s.set_layout_kind(mla ? v1::LAYOUT_KIND_MLA : v1::LAYOUT_KIND_MHA_GQA);
  s.set_tp_size(tp);
  s.set_opaque_keys(opaque);
  return s;
}

// Whether `status` is the error `code` carrying ErrorReason `reason` and naming request field
// `field` ("" = no field), as status_util.h builds them: EXPECT_TRUE(IsCacheError(...)).
inline ::testing::AssertionResult IsCacheError(const absl::Status& status, absl::StatusCode code,
                                               v1::ErrorReason reason, absl::string_view field) {
  if (status.code() == code && ErrorReasonOf(status) == reason && ErrorFieldOf(status) == field) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << status << " (reason " << v1::ErrorReason_Name(ErrorReasonOf(status)) << ", field '"
         << ErrorFieldOf(status) << "'); want " << absl::StatusCodeToString(code) << ", "
         << v1::ErrorReason_Name(reason) << ", field '" << field << "'";
}

// The daemon's form of a NamespaceSpec message (the fields copied, no validation).
inline core::NamespaceSpec CoreSpec(const v1::NamespaceSpec& spec) {
  core::NamespaceSpec s;
  s.tenant = spec.tenant();
  s.model_id = spec.model_id();
  s.model_revision = spec.model_revision();
  s.kv_dtype = spec.kv_dtype();
  s.page_size = spec.page_size_tokens();
  s.layout =
      spec.layout_kind() == v1::LAYOUT_KIND_MLA ? core::LayoutKind::kMla : core::LayoutKind::kMha;
  s.tp_size = spec.tp_size();
  s.opaque_keys = spec.opaque_keys();
  return s;
}

// Spec(...) in the daemon's form, with its tenant.
inline core::NamespaceSpec NsSpec(uint32_t tp = 1, bool mla = false,
                                  const std::string& model = "test-model",
                                  const std::string& tenant = "team-a") {
  core::NamespaceSpec s = CoreSpec(Spec(tp, mla, /*opaque=*/false, model));
  s.tenant = tenant;
  return s;
}

// Tokens of a prompt: `pages` full pages, distinct per `prompt`.
inline std::vector<uint32_t> Tokens(uint32_t prompt, uint32_t pages) {
  std::vector<uint32_t> t(pages * kPageSize);
  for (size_t i = 0; i < t.size(); ++i) t[i] = prompt * 100000 + static_cast<uint32_t>(i);
  return t;
}

// Device blocks first, first + 1, ..., n of them.
inline std::vector<uint32_t> Blocks(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

inline std::string KeyBlob(const std::vector<core::PageKey>& keys, size_t begin = 0,
                           size_t end = ~size_t{0}) {
  std::string out;
  for (size_t i = begin; i < std::min(end, keys.size()); ++i) {
    out.append(keys[i].AsBytes().data(), core::kPageKeyBytes);
  }
  return out;
}

// The chained page keys of prompt `prompt` (`pages` pages) in the namespace of `spec`.
inline std::vector<core::PageKey> PromptKeys(const core::NamespaceSpec& spec, uint32_t prompt,
                                             uint32_t pages) {
  return core::ComputePageKeys(spec.Digest(), Tokens(prompt, pages), spec.page_size);
}

// A valid KV layout of `layers` layers over one region of `num_blocks` blocks: per layer a K and
// (unless `mla`) a V buffer of `bytes_per_block`, laid out one after the other. Page objects are
// layers * (mla ? 1 : 2) * bytes_per_block bytes.
inline gpu::KvLayout TestLayout(uint32_t layers = kLayers, uint64_t bytes_per_block = kBytesPerBlock,
                                bool mla = false, uint32_t num_blocks = 16) {
  gpu::KvLayout l;
  const uint64_t buffer_bytes = uint64_t{num_blocks} * bytes_per_block;
  const uint32_t buffers = layers * (mla ? 1 : 2);
  l.regions.push_back({"/kvc-test-layout", 0, buffers * buffer_bytes});
  l.num_blocks = num_blocks;
  uint64_t offset = 0;
  auto buffer = [&] {
    gpu::BufferLayout b{0, offset, bytes_per_block, bytes_per_block};
    offset += buffer_bytes;
    return b;
  };
  for (uint32_t i = 0; i < layers; ++i) {
    gpu::LayerLayout layer;
    layer.k = buffer();
    if (!mla) layer.v = buffer();
    l.layers.push_back(layer);
  }
  return l;
}

// A host pool of `pool_bytes` in kRegionBytes regions with two size classes: kObjectBytes and
// 4 * kObjectBytes (the page objects of kBytesPerBlock and 4 * kBytesPerBlock engines).
inline std::unique_ptr<core::HostPool> SmallPool(uint64_t pool_bytes = 4 * kRegionBytes) {
  core::HostPoolOptions pool;
  pool.capacity_bytes = pool_bytes;
  pool.region_bytes = kRegionBytes;
  pool.slot_sizes = {kObjectBytes, 4 * kObjectBytes};
  pool.huge_pages = core::HugePages::kOff;
  absl::StatusOr<std::unique_ptr<core::HostPool>> p = core::HostPool::Create(pool);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

inline uint64_t SlotsUsed(const core::HostPool& pool) {
  uint64_t used = 0;
  for (const core::SizeClassStats& c : pool.Stats()) used += c.slots_used;
  return used;
}

// The L2 side of a CacheService, wired as CacheServiceImpl wires it: a real host pool, the
// namespace registry over it, CacheMetrics in a registry of its own, and L2Space. No threads.
class L2World {
 public:
  struct Options {
    uint64_t pool_bytes = 4 * kRegionBytes;
    // Only a full pool evicts unless a test sets these.
    double high_watermark = 1.0;
    double low_watermark = 0.99;
    int l3_tiers = 0;
    core::EvictionPolicyKind policy = core::EvictionPolicyKind::kLru;
  };

  L2World() : L2World(Options()) {}
  explicit L2World(const Options& o)
      : pool_(SmallPool(o.pool_bytes)),
        namespaces_(pool_.get(), o.policy, o.l3_tiers),
        metrics_(&registry_),
        l2_(pool_.get(), &namespaces_, o.high_watermark, o.low_watermark, &metrics_) {}

  core::HostPool& pool() { return *pool_; }
  NamespaceRegistry& namespaces() { return namespaces_; }
  MetricsRegistry& registry() { return registry_; }
  CacheMetrics& metrics() { return metrics_; }
  L2Space& l2() { return l2_; }

  // The namespace of `spec`, its geometry fixed by `layout` (held by one session, as after a
  // worker's registration).
  std::shared_ptr<Namespace> Adopted(const core::NamespaceSpec& spec,
                                     const gpu::KvLayout& layout = TestLayout()) {
    std::shared_ptr<Namespace> ns = namespaces_.GetOrCreate(spec);
    absl::Status s = ns->AdoptLayout(layout);
    EXPECT_TRUE(s.ok()) << s;
    return ns;
  }

  // What a finished Backup leaves: keys[i] (child of keys[i - 1], keys[0] child of `parent`) with
  // every shard in an L2 slot from L2Space::Allocate, committed. Returns the pages committed; a
  // page that gets no slot ends the chain.
  size_t Commit(Namespace& ns, absl::Span<const core::PageKey> keys,
                std::optional<core::PageKey> parent = std::nullopt) {
    core::RadixIndex& index = *ns.index();
    for (size_t i = 0; i < keys.size(); ++i) {
      for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
        absl::StatusOr<core::SlotRef> slot = l2_.Allocate(ns, keys[i], shard, 0);
        if (!slot.ok()) return i;
        const std::optional<core::PageKey> p = i == 0 ? parent : std::optional(keys[i - 1]);
        absl::Status begun = index.BeginWrite({keys[i], p, shard, *slot});
        EXPECT_TRUE(begun.ok()) << begun;
        if (!begun.ok()) {
          l2_.Free(*slot);
          return i;
        }
        EXPECT_TRUE(index.Commit({keys[i], shard}).ok());
      }
    }
    return keys.size();
  }

  // Pages of `keys` (a chain from its first key) whose every shard is committed in L2.
  static uint32_t L2Hits(Namespace& ns, absl::Span<const core::PageKey> keys) {
    core::MatchOptions o;
    o.shards = ns.group_shards();
    absl::StatusOr<core::MatchResult> r = ns.index()->Match(keys, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->l2_pages : 0;
  }

 private:
  std::unique_ptr<core::HostPool> pool_;
  NamespaceRegistry namespaces_;
  MetricsRegistry registry_;
  CacheMetrics metrics_;
  L2Space l2_;
};

}  // namespace kvcellar::server::testing

#endif  // KVCELLAR_TESTS_SERVER_COMPONENT_FIXTURES_H_
