// Tests server/admin/cache_admin.h on the CacheService's real components without the service:
// namespace registry, sessions, pins, L2Space over a real pool, and (for TIER_L3) L3TierAdmin
// over a file tier in a temp directory. Listings, statistics, Evict and Clear: what they report,
// which pages and pins they touch, and the errors naming the request field.
#include "server/admin/cache_admin.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/l3/l3_tier_admin.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kChain = 8;
constexpr absl::Duration kLease = absl::Seconds(30);

std::string Bytes(const core::PageKey& key) { return std::string(key.AsBytes()); }

class CacheAdminTest : public ::testing::Test {
 protected:
  CacheAdminTest()
      : start_(absl::Now() - absl::Seconds(5)),
        admin_(&world_.namespaces(), &sessions_, &pins_, &world_.l2(), &world_.metrics(), start_) {}

  // A live session of `instance` in the namespace of `spec`.
  std::shared_ptr<Session> AddSession(const std::string& instance, uint32_t rank,
                                      const core::NamespaceSpec& spec,
                                      v1::SessionRole role = v1::SESSION_ROLE_WORKER) {
    SessionInfo info =
        WorkerInfo(world_.namespaces().GetOrCreate(spec), instance, rank, sessions_.NewSessionId());
    info.role = role;
    info.num_blocks = 64;
    info.engine_name = "test-engine";
    auto session = std::make_shared<Session>(std::move(info), nullptr, absl::Now() + kLease);
    std::shared_ptr<Session> replaced;
    EXPECT_TRUE(sessions_.Add(session, false, &replaced).ok());
    return session;
  }

  // Namespace of `spec` with `prompts` prompts of kChain pages in L2.
  std::shared_ptr<Namespace> WithPages(const core::NamespaceSpec& spec, uint32_t prompts) {
    std::shared_ptr<Namespace> ns = world_.Adopted(spec);
    for (uint32_t p = 0; p < prompts; ++p) {
      EXPECT_EQ(world_.Commit(*ns, PromptKeys(spec, p, kChain)), kChain);
    }
    return ns;
  }

  // A Match pin of `instance` on `keys` (what Matcher records).
  uint64_t MatchPin(Namespace& ns, const std::string& instance,
                    const std::vector<core::PageKey>& keys, uint64_t session = 0) {
    const uint64_t id = next_pin_++;
    ns.index()->Pin(id, keys, absl::Now() + kLease);
    pins_.Add(id, instance, world_.namespaces().ById(ns.id()), keys, 1, kLease,
              absl::Now() + kLease, session);
    return id;
  }

  const v1::TierUsage* Usage(const google::protobuf::RepeatedPtrField<v1::TierUsage>& tiers,
                             v1::Tier tier, const std::string& backend = "") {
    for (const v1::TierUsage& u : tiers) {
      if (u.tier() == tier && u.l3_backend() == backend) return &u;
    }
    return nullptr;
  }

  L2World world_;
  SessionRegistry sessions_;
  PinTable pins_;
  const absl::Time start_;
  CacheAdmin admin_;
  uint64_t next_pin_ = 1000;
};

TEST_F(CacheAdminTest, ListEnginesOrdersAndFiltersSessions) {
  const core::NamespaceSpec a = NsSpec(2, false, "model-a", "team-a");
  const core::NamespaceSpec b = NsSpec(1, false, "model-b", "team-b");
  std::shared_ptr<Session> b0 = AddSession("inst-b", 0, b);
  std::shared_ptr<Session> a1 = AddSession("inst-a", 1, a);
  std::shared_ptr<Session> a0 = AddSession("inst-a", 0, a);
  std::shared_ptr<Session> sched = AddSession("inst-a", 0, a, v1::SESSION_ROLE_SCHEDULER);
  std::shared_ptr<Namespace> ns_a = WithPages(a, 1);
  MatchPin(*ns_a, "inst-a", PromptKeys(a, 0, 3), a1->id());

  v1::ListEnginesResponse all;
  ASSERT_TRUE(admin_.ListEngines(v1::ListEnginesRequest(), &all).ok());
  ASSERT_EQ(all.sessions_size(), 4);
  // By instance, then role (workers first), then rank.
  EXPECT_EQ(all.sessions(0).session_id(), a0->id());
  EXPECT_EQ(all.sessions(1).session_id(), a1->id());
  EXPECT_EQ(all.sessions(2).session_id(), sched->id());
  EXPECT_EQ(all.sessions(3).session_id(), b0->id());

  const v1::EngineSession& w = all.sessions(1);
  EXPECT_EQ(w.instance_id(), "inst-a");
  EXPECT_EQ(w.rank(), 1u);
  EXPECT_EQ(w.shard_index(), 1u);
  EXPECT_EQ(w.ns_digest(), Bytes(a.Digest()));
  EXPECT_EQ(w.namespace_spec().model_id(), "model-a");
  EXPECT_EQ(w.namespace_spec().tp_size(), 2u);
  EXPECT_EQ(w.device().kind(), v1::DEVICE_KIND_SIM);
  EXPECT_EQ(w.num_blocks(), 64u);
  EXPECT_EQ(w.num_layers(), kLayers);
  EXPECT_EQ(w.engine_name(), "test-engine");
  EXPECT_EQ(w.pins(), 1u);
  EXPECT_EQ(w.pinned_pages(), 3u);
  EXPECT_EQ(w.lease_deadline_unix_ms(), absl::ToUnixMillis(a1->lease_deadline()));
  const v1::EngineSession& s = all.sessions(2);
  EXPECT_EQ(s.role(), v1::SESSION_ROLE_SCHEDULER);
  EXPECT_FALSE(s.has_device()) << "schedulers have no device";
  EXPECT_EQ(s.num_blocks(), 0u);
  EXPECT_EQ(s.pins(), 0u);

  v1::ListEnginesRequest by_instance;
  by_instance.set_instance_id("inst-b");
  v1::ListEnginesResponse one;
  ASSERT_TRUE(admin_.ListEngines(by_instance, &one).ok());
  ASSERT_EQ(one.sessions_size(), 1);
  EXPECT_EQ(one.sessions(0).session_id(), b0->id());

  v1::ListEnginesRequest by_tenant;
  by_tenant.mutable_tenant()->set_tenant("team-a");
  v1::ListEnginesResponse three;
  ASSERT_TRUE(admin_.ListEngines(by_tenant, &three).ok());
  EXPECT_EQ(three.sessions_size(), 3);

  v1::ListEnginesRequest by_digest;
  by_digest.set_ns_digest(Bytes(b.Digest()));
  v1::ListEnginesResponse digest;
  ASSERT_TRUE(admin_.ListEngines(by_digest, &digest).ok());
  EXPECT_EQ(digest.sessions_size(), 1);

  by_digest.set_ns_digest("not-a-digest");
  v1::ListEnginesResponse bad;
  EXPECT_TRUE(IsCacheError(admin_.ListEngines(by_digest, &bad), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "ns_digest"));
  EXPECT_EQ(bad.sessions_size(), 0);
}

TEST_F(CacheAdminTest, ListNamespacesReportsL2UsageSessionsAndHitRates) {
  const core::NamespaceSpec a = NsSpec(2, false, "model-a", "team-b");
  const core::NamespaceSpec b = NsSpec(1, false, "model-b", "team-a");
  std::shared_ptr<Namespace> ns_a = WithPages(a, 2);  // 16 pages of 2 shards.
  world_.namespaces().GetOrCreate(b);                 // No geometry yet.
  AddSession("inst", 0, a);
  AddSession("inst", 1, a);
  NamespaceCounters::Add(ns_a->counters().lookup_pages, 10);
  NamespaceCounters::Add(ns_a->counters().l2_hit_pages, 4);
  NamespaceCounters::Add(ns_a->counters().l3_hit_pages, 1);

  v1::ListNamespacesResponse r;
  ASSERT_TRUE(admin_.ListNamespaces(v1::ListNamespacesRequest(), nullptr, &r).ok());
  ASSERT_EQ(r.namespaces_size(), 2);
  EXPECT_EQ(r.namespaces(0).spec().tenant(), "team-a") << "ordered by tenant";
  const v1::NamespaceInfo& info = r.namespaces(1);
  EXPECT_EQ(info.ns_digest(), Bytes(a.Digest()));
  EXPECT_EQ(info.num_shards(), 2u);
  EXPECT_EQ(info.page_object_bytes(), kObjectBytes);
  EXPECT_EQ(info.sessions(), 2u);
  ASSERT_EQ(info.tiers_size(), 1) << "no L3";
  EXPECT_EQ(info.tiers(0).tier(), v1::TIER_L2);
  EXPECT_EQ(info.tiers(0).pages(), 2 * kChain);
  EXPECT_EQ(info.tiers(0).objects(), 4 * kChain);
  EXPECT_EQ(info.tiers(0).bytes(), 4 * kChain * kObjectBytes);
  EXPECT_EQ(info.lookup_pages(), 10u);
  EXPECT_DOUBLE_EQ(info.hit_rate(), 0.5);
  EXPECT_EQ(r.namespaces(0).page_object_bytes(), 0u);
  EXPECT_EQ(r.namespaces(0).tiers(0).objects(), 0u);
  EXPECT_DOUBLE_EQ(r.namespaces(0).hit_rate(), 0.0);

  v1::ListNamespacesRequest by_tenant;
  by_tenant.mutable_tenant()->set_tenant("team-b");
  v1::ListNamespacesResponse one;
  ASSERT_TRUE(admin_.ListNamespaces(by_tenant, nullptr, &one).ok());
  ASSERT_EQ(one.namespaces_size(), 1);
  EXPECT_EQ(one.namespaces(0).spec().model_id(), "model-a");
}

TEST_F(CacheAdminTest, GetStatsTotalsAndPerNamespaceCounters) {
  const core::NamespaceSpec a = NsSpec(1, false, "model-a");
  const core::NamespaceSpec b = NsSpec(1, false, "model-b");
  std::shared_ptr<Namespace> ns_a = WithPages(a, 1);
  std::shared_ptr<Namespace> ns_b = WithPages(b, 1);
  world_.metrics().CountMatch(3, 5, kPageSize);
  world_.l2().EvictScope(*ns_a, std::nullopt, 2, false);
  world_.l2().EvictScope(*ns_b, std::nullopt, 1, false);
  NamespaceCounters::Add(ns_b->counters().lookup_pages, 6);
  NamespaceCounters::Add(ns_b->counters().l2_hit_pages, 2);

  v1::GetStatsRequest request;
  v1::GetStatsResponse r;
  ASSERT_TRUE(admin_.GetStats(request, &r).ok());
  EXPECT_GE(r.uptime_ms(), 5000u);
  EXPECT_LT(r.uptime_ms(), 60000u);
  EXPECT_EQ(r.totals().match().l2_hit_pages(), 3u);
  EXPECT_EQ(r.totals().match().miss_pages(), 5u) << "without L3 every L2 miss is a miss";
  EXPECT_EQ(r.totals().match().l2_hit_tokens(), 3u * kPageSize);
  ASSERT_EQ(r.totals().tiers_size(), 1);
  EXPECT_EQ(r.totals().tiers(0).evicted_objects(), 3u) << "summed over the namespaces";
  EXPECT_EQ(r.totals().tiers(0).evicted_bytes(), 3 * kObjectBytes);
  EXPECT_EQ(r.totals().ops_size(), 3);
  EXPECT_EQ(r.namespaces_size(), 0) << "per_namespace not asked for";

  request.set_per_namespace(true);
  request.set_ns_digest(Bytes(b.Digest()));
  v1::GetStatsResponse per;
  ASSERT_TRUE(admin_.GetStats(request, &per).ok());
  ASSERT_EQ(per.namespaces_size(), 1);
  const v1::NamespaceStats& nb = per.namespaces(0);
  EXPECT_EQ(nb.model_id(), "model-b");
  EXPECT_EQ(nb.counters().match().lookup_pages(), 6u);
  EXPECT_EQ(nb.counters().match().miss_pages(), 4u);
  EXPECT_EQ(nb.counters().match().miss_tokens(), 4u * kPageSize);
  EXPECT_EQ(nb.counters().tiers(0).evicted_objects(), 1u);
  EXPECT_EQ(per.totals().tiers(0).evicted_objects(), 3u) << "totals stay daemon-wide";

  request.set_ns_digest(std::string(31, 'x'));
  v1::GetStatsResponse bad;
  EXPECT_TRUE(IsCacheError(admin_.GetStats(request, &bad), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "ns_digest"));
}

v1::EvictRequest EvictL2(uint64_t target_bytes = 0, bool dry_run = false) {
  v1::EvictRequest r;
  r.add_tiers(v1::TIER_L2);
  r.set_target_bytes(target_bytes);
  r.set_dry_run(dry_run);
  return r;
}

TEST_F(CacheAdminTest, EvictStopsAtTheTargetInWholeObjectsAndSkipsPinnedPages) {
  const core::NamespaceSpec a = NsSpec(1, false, "model-a");
  std::shared_ptr<Namespace> ns = WithPages(a, 2);
  MatchPin(*ns, "inst", PromptKeys(a, 1, kChain));

  v1::EvictResponse dry;
  ASSERT_TRUE(admin_.Evict(EvictL2(0, true), nullptr, &dry).ok());
  EXPECT_TRUE(dry.dry_run());
  EXPECT_EQ(Usage(dry.evicted(), v1::TIER_L2)->pages(), kChain);
  EXPECT_EQ(dry.skipped_pinned_pages(), kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), 2 * kChain) << "a dry run evicts nothing";

  // 2.5 objects' worth: three objects go (pages leave whole).
  v1::EvictResponse some;
  ASSERT_TRUE(admin_.Evict(EvictL2(5 * kObjectBytes / 2), nullptr, &some).ok());
  EXPECT_FALSE(some.dry_run());
  EXPECT_EQ(Usage(some.evicted(), v1::TIER_L2)->objects(), 3u);
  EXPECT_EQ(Usage(some.evicted(), v1::TIER_L2)->bytes(), 3 * kObjectBytes);
  EXPECT_EQ(SlotsUsed(world_.pool()), 2 * kChain - 3);

  v1::EvictResponse rest;
  ASSERT_TRUE(admin_.Evict(EvictL2(), nullptr, &rest).ok());
  EXPECT_EQ(Usage(rest.evicted(), v1::TIER_L2)->pages(), kChain - 3);
  EXPECT_EQ(L2World::L2Hits(*ns, PromptKeys(a, 1, kChain)), kChain) << "the pinned prompt stays";
}

TEST_F(CacheAdminTest, EvictAppliesToTheScopedNamespaceAndSubtree) {
  const core::NamespaceSpec a = NsSpec(1, false, "model-a", "team-a");
  const core::NamespaceSpec b = NsSpec(1, false, "model-b", "team-b");
  std::shared_ptr<Namespace> ns_a = WithPages(a, 1);
  std::shared_ptr<Namespace> ns_b = WithPages(b, 1);

  v1::EvictRequest by_tenant = EvictL2();
  by_tenant.mutable_scope()->mutable_tenant()->set_tenant("team-b");
  v1::EvictResponse r;
  ASSERT_TRUE(admin_.Evict(by_tenant, nullptr, &r).ok());
  EXPECT_EQ(L2World::L2Hits(*ns_b, PromptKeys(b, 0, kChain)), 0u);
  EXPECT_EQ(L2World::L2Hits(*ns_a, PromptKeys(a, 0, kChain)), kChain);

  v1::EvictRequest subtree = EvictL2();
  subtree.mutable_scope()->set_ns_digest(Bytes(a.Digest()));
  subtree.mutable_scope()->set_subtree_root_key(Bytes(PromptKeys(a, 0, kChain)[5]));
  v1::EvictResponse sub;
  ASSERT_TRUE(admin_.Evict(subtree, nullptr, &sub).ok());
  EXPECT_EQ(Usage(sub.evicted(), v1::TIER_L2)->pages(), 3u);
  EXPECT_EQ(L2World::L2Hits(*ns_a, PromptKeys(a, 0, kChain)), 5u);
}

TEST_F(CacheAdminTest, EvictAndClearRequestErrorsNameTheFieldAndChangeNothing) {
  std::shared_ptr<Namespace> ns = WithPages(NsSpec(), 1);
  v1::EvictRequest no_tier;
  v1::EvictResponse r;
  EXPECT_TRUE(IsCacheError(admin_.Evict(no_tier, nullptr, &r), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "tiers"));
  v1::EvictRequest bad_scope = EvictL2();
  bad_scope.mutable_scope()->set_subtree_root_key("x");
  EXPECT_TRUE(IsCacheError(admin_.Evict(bad_scope, nullptr, &r), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "scope.subtree_root_key"));
  v1::EvictRequest backend = EvictL2();
  backend.add_tiers(v1::TIER_L3);
  backend.add_l3_backends("nvme");
  EXPECT_TRUE(IsCacheError(admin_.Evict(backend, nullptr, &r), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "l3_backends[0]"))
      << "no L3: no backend has that name";

  v1::ClearRequest unconfirmed;
  unconfirmed.add_tiers(v1::TIER_L2);
  v1::ClearResponse c;
  EXPECT_TRUE(IsCacheError(admin_.Clear(unconfirmed, nullptr, &c),
                           absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_CONFIRM_REQUIRED,
                           "confirm"));
  EXPECT_EQ(SlotsUsed(world_.pool()), kChain);
  EXPECT_EQ(L2World::L2Hits(*ns, PromptKeys(NsSpec(), 0, kChain)), kChain);
}

TEST_F(CacheAdminTest, TierL3WithoutL3ContributesNothing) {
  WithPages(NsSpec(), 1);
  v1::EvictRequest l3;
  l3.add_tiers(v1::TIER_L3);
  v1::EvictResponse r;
  ASSERT_TRUE(admin_.Evict(l3, nullptr, &r).ok());
  EXPECT_EQ(r.evicted_size(), 0);
  EXPECT_EQ(SlotsUsed(world_.pool()), kChain);
}

TEST_F(CacheAdminTest, ClearRevokesPinsInScopeAndDefersPagesUnderACopy) {
  const core::NamespaceSpec a = NsSpec(1, false, "model-a");
  std::shared_ptr<Namespace> ns = WithPages(a, 3);
  const std::vector<core::PageKey> p0 = PromptKeys(a, 0, kChain);
  const std::vector<core::PageKey> p1 = PromptKeys(a, 1, kChain);
  const std::vector<core::PageKey> p2 = PromptKeys(a, 2, kChain);
  const uint64_t pin0 = MatchPin(*ns, "inst", p0);
  const uint64_t pin1 = MatchPin(*ns, "inst", {p1[0], p1[1]});
  ns->index()->Pin(/*copy op id=*/77, p2, absl::InfiniteFuture());  // A Load copying prompt 2.

  // Subtree of prompt 1's page 1: only pin1 holds a page of it.
  v1::ClearRequest subtree;
  subtree.add_tiers(v1::TIER_L2);
  subtree.set_confirm(true);
  subtree.mutable_scope()->set_subtree_root_key(Bytes(p1[1]));
  v1::ClearResponse sub;
  ASSERT_TRUE(admin_.Clear(subtree, nullptr, &sub).ok());
  EXPECT_EQ(sub.pins_revoked(), 1u);
  EXPECT_EQ(Usage(sub.removed(), v1::TIER_L2)->pages(), kChain - 1);
  EXPECT_FALSE(pins_.Release(pin1, "inst")) << "revoked";
  EXPECT_EQ(L2World::L2Hits(*ns, p1), 1u);
  EXPECT_EQ(world_.metrics().Snapshot().pins_revoked, 1u);

  v1::ClearRequest dry;
  dry.add_tiers(v1::TIER_L2);
  dry.set_dry_run(true);  // No confirm needed.
  v1::ClearResponse would;
  ASSERT_TRUE(admin_.Clear(dry, nullptr, &would).ok());
  EXPECT_TRUE(would.dry_run());
  EXPECT_EQ(would.pins_revoked(), 1u) << "pin0 would be revoked";
  EXPECT_EQ(pins_.size(), 1u) << "but is not";
  EXPECT_EQ(world_.metrics().Snapshot().pins_revoked, 1u);

  v1::ClearRequest all = dry;
  all.set_dry_run(false);
  all.set_confirm(true);
  v1::ClearResponse r;
  ASSERT_TRUE(admin_.Clear(all, nullptr, &r).ok());
  EXPECT_EQ(r.pins_revoked(), 1u);
  EXPECT_FALSE(pins_.Release(pin0, "inst")) << "revoked";
  EXPECT_EQ(r.deferred_pages(), kChain) << "prompt 2 is under a copy";
  EXPECT_EQ(Usage(r.removed(), v1::TIER_L2)->pages(), kChain + 1);
  EXPECT_EQ(L2World::L2Hits(*ns, p2), 0u) << "deferred pages are invisible at once";
  EXPECT_EQ(SlotsUsed(world_.pool()), kChain) << "their slots wait for the copy";
  ns->index()->ReleaseOwner(77);
  EXPECT_EQ(world_.l2().ReapDoomed(), kChain);
  EXPECT_EQ(SlotsUsed(world_.pool()), 0u);
}

// TIER_L3 through the real L3Admin over a file tier: per-backend usage merged into the reply.
TEST_F(CacheAdminTest, L3UsageAndClearGoThroughTheL3Admin) {
  L3World world;  // One file tier, "t0".
  CacheAdmin admin(&world.namespaces(), &sessions_, &pins_, &world.l2(), &world.metrics(), start_);
  L3TierAdmin l3(&world.tiers(), &world.namespaces());
  std::shared_ptr<Namespace> ns = world.Adopted(NsSpec());
  const std::vector<core::PageKey> keys = PromptKeys(NsSpec(), 0, 4);
  ASSERT_EQ(world.Commit(*ns, keys), 4u);
  world.StoreInL3(*ns, 0, {keys[0], keys[1], keys[2]});  // As after write-through.

  v1::ListNamespacesResponse listed;
  ASSERT_TRUE(admin.ListNamespaces(v1::ListNamespacesRequest(), &l3, &listed).ok());
  ASSERT_EQ(listed.namespaces_size(), 1);
  const v1::TierUsage* t0 = Usage(listed.namespaces(0).tiers(), v1::TIER_L3, "t0");
  ASSERT_NE(t0, nullptr);
  EXPECT_EQ(t0->objects(), 3u);
  EXPECT_EQ(t0->bytes(), 3 * kObjectBytes);

  v1::ClearRequest clear;
  clear.add_tiers(v1::TIER_L3);
  clear.add_l3_backends("t0");
  clear.set_confirm(true);
  v1::ClearResponse cleared;
  ASSERT_TRUE(admin.Clear(clear, &l3, &cleared).ok());
  ASSERT_EQ(cleared.removed_size(), 1) << "TIER_L3 only: L2 untouched";
  EXPECT_EQ(cleared.removed(0).l3_backend(), "t0");
  EXPECT_EQ(cleared.removed(0).objects(), 3u);
  EXPECT_EQ(ns->index()->Stats().l3_objects[0], 0u);
  EXPECT_EQ(world.Read(*ns, 0, keys[1]), storage::ObjectStatus::kNotFound) << "deleted";
  EXPECT_EQ(L2World::L2Hits(*ns, keys), 4u);

  clear.set_l3_backends(0, "redis");
  EXPECT_TRUE(IsCacheError(admin.Clear(clear, &l3, &cleared), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "l3_backends[0]"));
}

}  // namespace
}  // namespace kvcellar::server::testing
