// CacheMetrics: the per-tier token arithmetic and the transfer durations behind bandwidth.
#include "server/metrics/cache_metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(CacheMetricsTest, L3TierTokensCountWhatReachedEachTier) {
  MetricsRegistry registry;
  CacheMetrics metrics(&registry);
  metrics.SetL3Tiers({"nvme", "redis"});
  // Of 9 pages missed in L2: 3 first found in nvme, 2 in redis, 4 nowhere. Page size 16.
  const uint32_t hits[] = {3, 2};
  metrics.CountL3Match(hits, 4, 16);
  const std::string text = registry.Scrape();
  // nvme saw all 9 pages (3 hit); redis the 6 that nvme missed (2 hit).
  EXPECT_THAT(text,
              HasSubstr("kvcellar_match_l3_tier_tokens_total{tier=\"nvme\",result=\"hit\"} 48"));
  EXPECT_THAT(text,
              HasSubstr("kvcellar_match_l3_tier_tokens_total{tier=\"nvme\",result=\"miss\"} 96"));
  EXPECT_THAT(text,
              HasSubstr("kvcellar_match_l3_tier_tokens_total{tier=\"redis\",result=\"hit\"} 32"));
  EXPECT_THAT(text,
              HasSubstr("kvcellar_match_l3_tier_tokens_total{tier=\"redis\",result=\"miss\"} 64"));
  EXPECT_THAT(text, HasSubstr("kvcellar_match_tokens_total{tier=\"l3\",result=\"hit\"} 80"));
  EXPECT_THAT(text, HasSubstr("kvcellar_match_tokens_total{tier=\"l3\",result=\"miss\"} 64"));
}

TEST(CacheMetricsTest, TransferDurationsFollowTheBytesMoved) {
  MetricsRegistry registry;
  CacheMetrics metrics(&registry);
  metrics.CountMovedBytes(v1::OP_KIND_LOAD, 4096, 0.002);
  metrics.CountMovedBytes(v1::OP_KIND_LOAD, 4096, 0.002);
  metrics.CountMovedBytes(v1::OP_KIND_BACKUP, 0, 5.0);  // Nothing moved: no observation.
  metrics.CountL3Bytes(/*write=*/true, 1000, 0.5);
  metrics.CountL3Bytes(/*write=*/false, 0, 0.5);
  const std::string text = registry.Scrape();
  EXPECT_THAT(text, HasSubstr("kvcellar_moved_bytes_total{direction=\"h2d\"} 8192"));
  EXPECT_THAT(text, HasSubstr("kvcellar_transfer_duration_seconds_count{direction=\"h2d\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvcellar_transfer_duration_seconds_sum{direction=\"h2d\"} 0.004"));
  EXPECT_THAT(text, HasSubstr("kvcellar_transfer_duration_seconds_count{direction=\"d2h\"} 0"));
  EXPECT_THAT(text, HasSubstr("kvcellar_moved_bytes_total{direction=\"l2_to_l3\"} 1000"));
  EXPECT_THAT(text,
              HasSubstr("kvcellar_transfer_duration_seconds_sum{direction=\"l2_to_l3\"} 0.5"));
  EXPECT_THAT(text,
              HasSubstr("kvcellar_transfer_duration_seconds_count{direction=\"l3_to_l2\"} 0"));
  EXPECT_THAT(text, Not(HasSubstr("direction=\"d2h\"} 5")));
}

}  // namespace
}  // namespace kvcellar::server
