// Fixtures shared by the server's unit tests (tests/server/<room>/<name>_test.cc test
// server/<room>/<name>.h): the test engines' geometry, namespace specs, KV layouts, a small real
// host pool; L2World, the L2 side of a CacheService (pool, namespace registry, metrics, L2Space)
// without the service, its threads or gRPC; and L3World, that plus real file tiers in temp
// directories. cache_test_harness.h builds the whole service on the same pieces.
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
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "core/eviction_policy.h"
#include "core/host_pool.h"
#include "core/kv_layout.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/radix_index.h"
#include "gtest/gtest.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "kvcellar/v1/common.pb.h"
#include "server/config/config.h"
#include "server/config/tenant_quota.h"
#include "server/errors/cache_error.h"
#include "server/l2/l2_space.h"
#include "server/l3/l3_tiers.h"
#include "server/metrics/cache_metrics.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"
#include "server/session/op_table.h"
#include "server/session/session_registry.h"
#include "server/session/tenant_ledger.h"
#include "tests/storage/storage_test_util.h"

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
// `field` ("" = no field), as cache_error.h builds them: EXPECT_TRUE(IsCacheError(...)).
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
inline core::KvLayout TestLayout(uint32_t layers = kLayers,
                                uint64_t bytes_per_block = kBytesPerBlock, bool mla = false,
                                uint32_t num_blocks = 16) {
  core::KvLayout l;
  const uint64_t buffer_bytes = uint64_t{num_blocks} * bytes_per_block;
  const uint32_t buffers = layers * (mla ? 1 : 2);
  l.regions.push_back({"/kvc-test-layout", 0, buffers * buffer_bytes});
  l.num_blocks = num_blocks;
  uint64_t offset = 0;
  auto buffer = [&] {
    core::BufferLayout b{0, offset, bytes_per_block, bytes_per_block};
    offset += buffer_bytes;
    return b;
  };
  for (uint32_t i = 0; i < layers; ++i) {
    core::LayerLayout layer;
    layer.k = buffer();
    if (!mla) layer.v = buffer();
    l.layers.push_back(layer);
  }
  return l;
}

// `layout` as a SIM engine registers it (RegisterEngineRequest.layout): regions by shm name.
inline void SimLayoutProto(const core::KvLayout& layout, v1::KvLayout* out) {
  for (const core::MemoryRegion& region : layout.regions) {
    v1::MemoryRegion* m = out->add_regions();
    m->set_sim_shm_name(region.handle);
    m->set_offset_bytes(region.offset);
    m->set_size_bytes(region.size);
  }
  auto buffer = [](const core::BufferLayout& b, v1::BlockBuffer* o) {
    o->set_region(b.region);
    o->set_offset_bytes(b.offset);
    o->set_block_stride_bytes(b.block_stride);
    o->set_bytes_per_block(b.bytes_per_block);
  };
  for (const core::LayerLayout& layer : layout.layers) {
    v1::LayerLayout* l = out->add_layers();
    buffer(layer.k, l->mutable_k());
    if (layer.v.has_value()) buffer(*layer.v, l->mutable_v());
  }
  out->set_num_blocks(layout.num_blocks);
}

// A host pool of `pool_bytes` in kRegionBytes regions with two size classes: kObjectBytes and
// 4 * kObjectBytes (the page objects of kBytesPerBlock and 4 * kBytesPerBlock engines).
inline std::unique_ptr<core::HostPool> SmallPool(uint64_t pool_bytes = 4 * kRegionBytes) {
  core::HostPoolOptions pool;
  pool.capacity_bytes = pool_bytes;
  pool.region_bytes = kRegionBytes;
  pool.slot_sizes = {kObjectBytes, 4 * kObjectBytes};
  absl::StatusOr<std::unique_ptr<core::HostPool>> p = core::HostPool::Create(pool);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

inline uint64_t SlotsUsed(const core::HostPool& pool) {
  uint64_t used = 0;
  for (const core::SizeClassStats& c : pool.Stats()) used += c.slots_used;
  return used;
}

// The L2 side of a CacheService, wired as the Cache (server/cache/cache.h) wires it: a real host pool, the
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
    // tenants.quotas in bytes; empty: every tenant accounted, none with a quota.
    std::vector<TenantQuotaBytes> quotas;
  };

  L2World() : L2World(Options()) {}
  explicit L2World(const Options& o)
      : pool_(SmallPool(o.pool_bytes)),
        tenants_(o.quotas),
        namespaces_(pool_.get(), o.policy, o.l3_tiers, nullptr, &tenants_),
        metrics_(&registry_),
        l2_(pool_.get(), &namespaces_, o.high_watermark, o.low_watermark, &metrics_, &tenants_) {}

  core::HostPool& pool() { return *pool_; }
  NamespaceRegistry& namespaces() { return namespaces_; }
  TenantLedger& tenants() { return tenants_; }
  MetricsRegistry& registry() { return registry_; }
  CacheMetrics& metrics() { return metrics_; }
  L2Space& l2() { return l2_; }

  // The namespace of `spec`, its geometry fixed by `layout` (held by one session, as after a
  // worker's registration).
  std::shared_ptr<Namespace> Adopted(const core::NamespaceSpec& spec,
                                     const core::KvLayout& layout = TestLayout()) {
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

  // Writes storage::testing::FillPayload's bytes for each (key, shard) into the L2 slot of every
  // shard of `keys` (committed): what a Backup would have gathered from an engine.
  void FillPayloads(Namespace& ns, absl::Span<const core::PageKey> keys) {
    for (const core::PageKey& key : keys) {
      for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
        core::SlotRef slot;
        ns.index()->GetL2Slots(absl::MakeConstSpan(&key, 1), shard, absl::MakeSpan(&slot, 1));
        ASSERT_TRUE(slot.valid()) << "page not in L2";
        storage::testing::FillPayload(key, shard, pool_->Address(slot), ns.object_bytes());
      }
    }
  }
  // Whether the L2 slots of `key` hold FillPayload's bytes (what an L3 read brought back).
  bool HoldsPayload(Namespace& ns, const core::PageKey& key) {
    for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
      core::SlotRef slot;
      ns.index()->GetL2Slots(absl::MakeConstSpan(&key, 1), shard, absl::MakeSpan(&slot, 1));
      if (!slot.valid() ||
          !storage::testing::PayloadMatches(key, shard, pool_->Address(slot), ns.object_bytes())) {
        return false;
      }
    }
    return true;
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
  TenantLedger tenants_;
  NamespaceRegistry namespaces_;
  MetricsRegistry registry_;
  CacheMetrics metrics_;
  L2Space l2_;
};

// An L2World whose indexes know `tiers.size()` L3 tiers, and those tiers: file tiers, each in a
// temp directory of its own, opened from storage.tiers as the daemon opens them. tiers[i] is the
// options of tier i ("admit_after=2"); tier i is named "t<i>". The metrics know the tier names.
class L3World : public L2World {
 public:
  explicit L3World(std::vector<std::string> tiers = {""},
                   StorageConfig storage = DefaultConfig().storage,
                   L2World::Options l2 = L2World::Options())
      : L2World(WithTiers(l2, tiers.size())) {
    for (size_t i = 0; i < tiers.size(); ++i) {
      dirs_.push_back(std::make_unique<storage::testing::TempDir>());
      absl::StrAppend(&storage.tiers, i == 0 ? "" : ";", "file:", dirs_.back()->path(), "?name=t",
                      i, "&io=threads", tiers[i].empty() ? "" : "&", tiers[i]);
    }
    storage_ = storage;
    absl::StatusOr<std::unique_ptr<L3Tiers>> opened = L3Tiers::Open(storage_);
    EXPECT_TRUE(opened.ok()) << opened.status();
    tiers_ = opened.ok() ? *std::move(opened) : L3Tiers::None();
    metrics().SetL3Tiers(tiers_->names());
  }

  L3Tiers& tiers() { return *tiers_; }
  storage::Backend& backend(size_t tier) { return *tiers_->tier(tier).backend; }
  const StorageConfig& storage() const { return storage_; }

  // Puts FillPayload objects of every shard of `keys` into tier `tier` and marks them in the
  // index (keys[0]'s parent is `parent`), as this daemon's earlier writes would have.
  void StoreInL3(Namespace& ns, size_t tier, const std::vector<core::PageKey>& keys,
                 std::optional<core::PageKey> parent = std::nullopt) {
    std::vector<core::L3Update> marks;
    for (size_t i = 0; i < keys.size(); ++i) {
      for (uint16_t shard = 0; shard < ns.shards(); ++shard) {
        EXPECT_EQ(
            storage::testing::PutOne(backend(tier), ns.digest(), keys[i], shard, ns.object_bytes()),
            storage::ObjectStatus::kOk);
        marks.push_back({keys[i], i == 0 ? parent : std::optional(keys[i - 1]), shard,
                         static_cast<uint8_t>(tier), true});
      }
    }
    std::vector<absl::Status> statuses(marks.size());
    EXPECT_EQ(ns.index()->UpdateL3(marks, absl::MakeSpan(statuses)), marks.size());
  }

  // The status of reading (key, shard) back from tier `tier` (kOk only with FillPayload's bytes).
  storage::ObjectStatus Read(Namespace& ns, size_t tier, const core::PageKey& key,
                             uint16_t shard = 0) {
    return storage::testing::GetOne(backend(tier), ns.digest(), key, shard, ns.object_bytes(),
                                    ns.object_bytes());
  }

 private:
  static L2World::Options WithTiers(L2World::Options o, size_t tiers) {
    o.l3_tiers = static_cast<int>(tiers);
    return o;
  }

  std::vector<std::unique_ptr<storage::testing::TempDir>> dirs_;
  StorageConfig storage_;
  std::unique_ptr<L3Tiers> tiers_;
};

// The op's result once it is terminal (or, after 10 s, as it stands: the test then fails on it).
inline v1::OpResult AwaitOp(OpTable& ops, const OpRecord& op) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  v1::OpResult r;
  for (;;) {
    r.Clear();
    ops.Fill(op, /*omit_page_status=*/false, /*submission=*/false, &r);
    if (r.state() != v1::OP_STATE_PENDING || absl::Now() > give_up) return r;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// A sequence result's per-page statuses as ints (for ElementsAre against v1::PAGE_STATUS_*).
inline std::vector<int> Statuses(const v1::SequenceResult& r) {
  return std::vector<int>(r.page_status().begin(), r.page_status().end());
}

// What a registration fixes, for components that take a SessionInfo; no device mapping.
inline SessionInfo WorkerInfo(std::shared_ptr<Namespace> ns, const std::string& instance = "inst",
                              uint32_t rank = 0, uint64_t id = 1) {
  SessionInfo info;
  info.id = id;
  info.instance_id = instance;
  info.rank = rank;
  info.role = v1::SESSION_ROLE_WORKER;
  info.tp_size = ns->spec().tp_size;
  info.page_size = ns->spec().page_size;
  info.opaque_keys = ns->spec().opaque_keys;
  info.ns_digest = ns->digest();
  const bool sharded = ns->spec().ShardsPerPage() > 1;
  info.shard = sharded ? static_cast<uint16_t>(rank) : 0;
  info.shard_writer = sharded || rank == 0;
  if (ns->spec().Hybrid()) {
    for (const core::KvGroup& g : ns->spec().groups) info.group_kinds.push_back(g.kind);
  }
  info.ns = std::move(ns);
  info.device_kind = v1::DEVICE_KIND_SIM;
  info.num_layers = kLayers;
  info.registered = absl::Now();
  return info;
}

}  // namespace kvcellar::server::testing

#endif  // KVCELLAR_TESTS_SERVER_COMPONENT_FIXTURES_H_
