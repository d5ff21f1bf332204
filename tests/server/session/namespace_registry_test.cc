// Tests server/session/namespace_registry.h: namespaces created once and numbered in creation
// order, their index keys, and the page geometry the first worker fixes, checks later workers
// against (naming the differing field) and gives up once nothing holds it. A real host pool.
#include "server/session/namespace_registry.h"

#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Empties `ns`'s index and frees the slots, as an admin Clear would.
void ClearIndex(L2World& world, Namespace& ns) {
  std::vector<core::ReleasedObject> released;
  ns.index()->Clear(&released);
  world.l2().FreeReleased(released);
}

TEST(NamespaceRegistryTest, OneNamespacePerSpecNumberedInCreationOrder) {
  L2World world;
  NamespaceRegistry& registry = world.namespaces();
  EXPECT_EQ(registry.size(), 0u);
  std::shared_ptr<Namespace> a = registry.GetOrCreate(NsSpec(1, false, "model-a"));
  std::shared_ptr<Namespace> b = registry.GetOrCreate(NsSpec(1, false, "model-b"));
  std::shared_ptr<Namespace> c = registry.GetOrCreate(NsSpec(1, false, "model-a", "team-b"));
  EXPECT_EQ(registry.GetOrCreate(NsSpec(1, false, "model-a")), a) << "same spec, same namespace";
  EXPECT_EQ(registry.size(), 3u);
  EXPECT_EQ(a->id(), 1u);
  EXPECT_EQ(b->id(), 2u);
  EXPECT_EQ(c->id(), 3u);
  EXPECT_THAT(registry.Snapshot(), ElementsAre(a, b, c));
  EXPECT_EQ(registry.ById(2), b);
  EXPECT_EQ(registry.ById(0), nullptr);
  EXPECT_EQ(registry.ById(4), nullptr);
  EXPECT_EQ(a->digest(), NsSpec(1, false, "model-a").Digest());
  EXPECT_NE(a->digest(), c->digest()) << "the tenant is part of the namespace";
}

TEST(NamespaceRegistryTest, ConcurrentFirstUsesCreateOneNamespace) {
  L2World world;
  constexpr int kThreads = 8;
  std::vector<std::shared_ptr<Namespace>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { got[t] = world.namespaces().GetOrCreate(NsSpec()); });
  }
  for (std::thread& t : threads) t.join();
  for (const std::shared_ptr<Namespace>& ns : got) EXPECT_EQ(ns, got[0]);
  EXPECT_EQ(world.namespaces().size(), 1u);
  EXPECT_EQ(got[0]->id(), 1u);
}

TEST(NamespaceRegistryTest, NamespaceMadeOutsideARegistryHasIdZero) {
  std::unique_ptr<core::HostPool> pool = SmallPool();
  Namespace ns(NsSpec(), pool.get(), core::EvictionPolicyKind::kLru);
  EXPECT_EQ(ns.id(), 0u);
}

TEST(NamespaceTest, ShardsAreTheTpSizeForMhaAndOneForMla) {
  L2World world;
  std::shared_ptr<Namespace> mha = world.namespaces().GetOrCreate(NsSpec(4, false));
  std::shared_ptr<Namespace> mla = world.namespaces().GetOrCreate(NsSpec(4, true));
  EXPECT_EQ(mha->shards(), 4);
  EXPECT_EQ(mha->group_shards(), core::ShardMask{0b1111});
  EXPECT_EQ(mla->shards(), 1);
  EXPECT_EQ(mla->group_shards(), core::ShardMask{1});
}

TEST(NamespaceTest, ChainedKeysAreIndexedAsSentOpaqueOnesScopedToTheNamespace) {
  L2World world;
  core::NamespaceSpec opaque_spec = NsSpec();
  opaque_spec.opaque_keys = true;
  std::shared_ptr<Namespace> chained = world.namespaces().GetOrCreate(NsSpec());
  std::shared_ptr<Namespace> opaque = world.namespaces().GetOrCreate(opaque_spec);
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 1, 3);
  const std::string blob = KeyBlob(keys);

  EXPECT_EQ(chained->IndexKey(blob.data()), keys[0]);
  EXPECT_EQ(opaque->IndexKey(blob.data()), core::ScopeOpaqueKey(opaque->digest(), keys[0]));
  EXPECT_NE(opaque->IndexKey(blob.data()), keys[0]);

  std::vector<core::PageKey> out = {keys[2]};  // Appended to, not replaced.
  chained->AppendIndexKeys(blob, &out);
  EXPECT_THAT(out, ElementsAre(keys[2], keys[0], keys[1], keys[2]));
  out.clear();
  opaque->AppendIndexKeys(blob, &out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[1], core::ScopeOpaqueKey(opaque->digest(), keys[1]));
  // No keys into an empty vector (a sequence without pages): nothing, and no memcpy to the
  // empty vector's null data() (UBSan in the gRPC fuzzer found it).
  for (const auto& ns : {chained, opaque}) {
    std::vector<core::PageKey> none;
    ns->AppendIndexKeys("", &none);
    ns->AppendIndexKeys(blob.substr(0, 31), &none);
    EXPECT_TRUE(none.empty());
  }
}

TEST(NamespaceTest, FirstWorkerFixesTheGeometryAndCreatesTheIndex) {
  L2World::Options o;
  o.l3_tiers = 2;
  o.policy = core::EvictionPolicyKind::kS3Fifo;
  L2World world(o);
  std::shared_ptr<Namespace> ns = world.namespaces().GetOrCreate(NsSpec(2));
  EXPECT_EQ(ns->index(), nullptr) << "no index before a worker's layout";
  EXPECT_EQ(ns->object_bytes(), 0u);
  EXPECT_EQ(ns->slot_bytes(), 0u);

  // 12 KiB objects go into the pool's 16 KiB class; the index accounts in slot bytes.
  ASSERT_TRUE(ns->AdoptLayout(TestLayout(kLayers, 3072)).ok());
  ASSERT_NE(ns->index(), nullptr);
  EXPECT_EQ(ns->object_bytes(), 12288u);
  EXPECT_EQ(ns->slot_bytes(), kObjectBytes);
  EXPECT_EQ(ns->index()->object_bytes(), kObjectBytes);
  EXPECT_EQ(ns->index()->shards_per_page(), 2);
  EXPECT_EQ(ns->index()->l3_tiers(), 2);
  EXPECT_EQ(ns->index()->policy_name(), "s3fifo");

  core::RadixIndex* const index = ns->index();
  EXPECT_TRUE(ns->AdoptLayout(TestLayout(kLayers, 3072)).ok()) << "same geometry: accepted";
  EXPECT_EQ(ns->index(), index);
}

TEST(NamespaceTest, AnotherGeometryIsRefusedNamingTheFieldAndChangesNothing) {
  L2World world;
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());
  core::RadixIndex* const index = ns->index();

  absl::Status layers = ns->AdoptLayout(TestLayout(kLayers + 1));
  EXPECT_TRUE(IsCacheError(layers, absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "layout.layers"));
  EXPECT_THAT(layers.message(), HasSubstr("3 layers"));

  core::KvLayout k = TestLayout();
  k.layers[1].k.bytes_per_block = 2048;
  EXPECT_TRUE(IsCacheError(ns->AdoptLayout(k), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "layout.layers[1].k.bytes_per_block"));

  core::KvLayout mla = TestLayout(kLayers, 2 * kBytesPerBlock, /*mla=*/true);  // Same object size.
  EXPECT_TRUE(IsCacheError(ns->AdoptLayout(mla), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "layout.layers[0].k.bytes_per_block"));

  core::KvLayout v = TestLayout();
  v.layers[0].v->bytes_per_block = 2048;
  absl::Status v_status = ns->AdoptLayout(v);
  EXPECT_TRUE(IsCacheError(v_status, absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "layout.layers[0].v.bytes_per_block"));
  EXPECT_THAT(v_status.message(), HasSubstr("(2048) differs from this namespace's 4096"));

  EXPECT_EQ(ns->index(), index);
  EXPECT_EQ(ns->object_bytes(), kObjectBytes);
  EXPECT_TRUE(ns->AdoptLayout(TestLayout()).ok()) << "the first geometry still holds";
}

TEST(NamespaceTest, ObjectLargerThanEverySlotIsInvalidAndFixesNothing) {
  L2World world;
  std::shared_ptr<Namespace> ns = world.namespaces().GetOrCreate(NsSpec());
  // 2 layers x (K + V) x 32 KiB = 128 KiB; the pool's largest class is 64 KiB.
  absl::Status s = ns->AdoptLayout(TestLayout(kLayers, 32 * 1024));
  EXPECT_TRUE(IsCacheError(s, absl::StatusCode::kInvalidArgument, v1::ERROR_REASON_INVALID_FIELD,
                           "layout"));
  EXPECT_THAT(s.message(), HasSubstr("131072 bytes"));
  EXPECT_EQ(ns->index(), nullptr);
  EXPECT_EQ(ns->object_bytes(), 0u);
  // Nothing was held: the next worker fixes its own geometry.
  EXPECT_TRUE(ns->AdoptLayout(TestLayout(kLayers, 8192)).ok());
  EXPECT_EQ(ns->slot_bytes(), 4 * kObjectBytes);
}

TEST(NamespaceTest, GeometryIsAdoptedAnewOnceNoSessionAndNoPageHoldsIt) {
  L2World world;
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());  // One holder.
  core::RadixIndex* const index = ns->index();
  ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());  // Two holders.
  const core::KvLayout bigger = TestLayout(kLayers, 2 * kBytesPerBlock);

  ns->ReleaseLayout();
  EXPECT_EQ(ErrorReasonOf(ns->AdoptLayout(bigger)), v1::ERROR_REASON_GROUP_MISMATCH)
      << "a session still holds the geometry";
  ns->ReleaseLayout();

  // No session, but a page of the namespace is in L2: the geometry still binds.
  ASSERT_EQ(world.Commit(*ns, PromptKeys(NsSpec(), 1, 1)), 1u);
  EXPECT_EQ(ErrorReasonOf(ns->AdoptLayout(bigger)), v1::ERROR_REASON_GROUP_MISMATCH)
      << "a page holds the geometry";

  ClearIndex(world, *ns);
  ASSERT_TRUE(ns->AdoptLayout(bigger).ok());
  EXPECT_EQ(ns->index(), index) << "the same, empty, index is reconfigured";
  EXPECT_EQ(ns->object_bytes(), 2 * kObjectBytes);
  EXPECT_EQ(ns->slot_bytes(), 4 * kObjectBytes);
  EXPECT_EQ(index->object_bytes(), 4 * kObjectBytes);
  EXPECT_EQ(ErrorReasonOf(ns->AdoptLayout(TestLayout())), v1::ERROR_REASON_GROUP_MISMATCH)
      << "now the new geometry binds";
}

TEST(NamespaceTest, ExtraReleasesDoNotUnderflowTheHolders) {
  L2World world;
  std::shared_ptr<Namespace> ns = world.namespaces().GetOrCreate(NsSpec());
  ns->ReleaseLayout();  // Nothing held: ignored.
  ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
  ns->ReleaseLayout();
  ns->ReleaseLayout();                              // One too many: ignored.
  ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());  // One holder again.
  EXPECT_EQ(ErrorReasonOf(ns->AdoptLayout(TestLayout(kLayers + 1))),
            v1::ERROR_REASON_GROUP_MISMATCH);
}

}  // namespace
}  // namespace kvcellar::server::testing
