// Tests server/cache/cache.h, the composition root, without gRPC: what it builds from its options,
// the draining switch, session lookup, and the counts GetStatus reads.
#include "server/cache/cache.h"

#include <memory>

#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

class CacheTest : public ::testing::Test {
 protected:
  CacheTest() : pool_(SmallPool()) {
    CacheOptions o;
    o.config = DefaultConfig();
    o.pool = pool_.get();
    o.daemon_epoch = 7;
    o.metrics = &registry_;
    o.housekeeping_interval = absl::Hours(1);  // The tests run the pass themselves.
    cache_ = std::make_unique<Cache>(std::move(o));
  }

  MetricsRegistry registry_;
  std::unique_ptr<core::HostPool> pool_;
  std::unique_ptr<Cache> cache_;
};

TEST_F(CacheTest, BuildsEveryComponentFromItsOptions) {
  EXPECT_EQ(cache_->daemon_epoch(), 7u);
  EXPECT_EQ(cache_->device_kind(), v1::DEVICE_KIND_UNSPECIFIED);  // No device given.
  EXPECT_TRUE(cache_->l3().empty());  // No tiers: the empty list, never a null pointer.
  EXPECT_EQ(cache_->limits().max_inflight_ops,
            CacheLimits::FromConfig(DefaultConfig()).max_inflight_ops);
  const Cache::Counts counts = cache_->GetCounts();
  EXPECT_EQ(counts.sessions, 0u);
  EXPECT_EQ(counts.instances, 0u);
  EXPECT_EQ(counts.namespaces, 0u);
  const Cache::L2Usage l2 = cache_->GetL2Usage();
  EXPECT_EQ(l2.pages, 0u);
  EXPECT_EQ(l2.bytes, 0u);
}

TEST_F(CacheTest, DrainingRefusesWithNotReady) {
  EXPECT_TRUE(cache_->CheckNotDraining().ok());
  EXPECT_FALSE(cache_->draining());
  cache_->SetDraining();
  EXPECT_TRUE(cache_->draining());
  EXPECT_TRUE(IsCacheError(cache_->CheckNotDraining(), absl::StatusCode::kUnavailable,
                           v1::ERROR_REASON_NOT_READY, ""));
}

TEST_F(CacheTest, AnUnknownSessionIsSessionUnknown) {
  EXPECT_TRUE(IsCacheError(cache_->FindSession(12345).status(),
                           absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_SESSION_UNKNOWN, "session_id"));
}

TEST_F(CacheTest, FillInfoCountsNamespacesAndPinnedBytes) {
  std::shared_ptr<Namespace> ns = cache_->namespaces().GetOrCreate(NsSpec());
  ASSERT_TRUE(ns->AdoptLayout(TestLayout()).ok());
  DaemonInfo info;
  cache_->FillInfo(&info);
  EXPECT_EQ(info.namespaces, 1u);
  EXPECT_EQ(info.sessions, 0u);
  EXPECT_EQ(info.pool_pinned_bytes, 0u);
  EXPECT_EQ(info.pool_in_flight_bytes, 0u);
}

TEST_F(CacheTest, HousekeepExpiresPinLeasesAndCountsThem) {
  std::shared_ptr<Namespace> ns = cache_->namespaces().GetOrCreate(NsSpec());
  cache_->pins().Add(/*id=*/1, "inst", ns, {}, /*holds=*/1, absl::Milliseconds(1),
                     absl::Now() - absl::Milliseconds(1));
  cache_->pins().Add(/*id=*/2, "inst", ns, {}, /*holds=*/1, absl::Hours(1),
                     absl::Now() + absl::Hours(1));
  ASSERT_EQ(cache_->pins().size(), 2u);
  cache_->Housekeep();
  EXPECT_EQ(cache_->pins().size(), 1u);  // Only the lapsed one.
  EXPECT_NE(registry_.Scrape().find("kvcellar_pin_lease_expiries_total 1"), std::string::npos);
}

}  // namespace
}  // namespace kvcellar::server::testing
