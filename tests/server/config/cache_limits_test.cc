// Tests server/config/cache_limits.h: the limits derived from the configuration, their named
// constants, what RegisterEngineResponse.limits reports, and pin lease clamping.
#include "server/config/cache_limits.h"

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "core/signal_layout.h"
#include "core/kv_layout.h"
#include "gtest/gtest.h"

namespace kvcellar::server {
namespace {

Config WithSessions(int64_t lease_ms, int64_t pin_lease_ms) {
  Config c = DefaultConfig();
  c.server.max_batch_pages = 512;
  c.server.max_message_bytes = 8 << 20;
  c.sessions.lease_ms = lease_ms;
  c.sessions.pin_lease_ms = pin_lease_ms;
  return c;
}

TEST(CacheLimitsTest, ConfiguredLimitsAndNamedConstants) {
  const CacheLimits l = CacheLimits::FromConfig(WithSessions(9000, 20000));
  EXPECT_EQ(l.max_batch_pages, 512u);
  EXPECT_EQ(l.max_message_bytes, uint64_t{8} << 20);
  EXPECT_EQ(l.default_pin_lease_ms, 20000u);
  EXPECT_EQ(l.lease_ms, 9000u);
  EXPECT_EQ(l.heartbeat_interval_ms, 3000u) << "a third of the lease";
  EXPECT_EQ(l.max_batch_sequences, kMaxBatchSequences);
  EXPECT_EQ(l.max_pin_lease_ms, kMaxPinLeaseMs);
  EXPECT_EQ(l.max_wait_ms, kMaxWaitMs);
  EXPECT_EQ(l.max_inflight_ops, kMaxInflightOps);
  EXPECT_EQ(l.max_prefetch_timeout_ms, kMaxPrefetchTimeoutMs);
  EXPECT_EQ(l.op_result_retention_ms, kOpResultRetentionMs);
  EXPECT_EQ(l.group_match_window_ms, kGroupMatchWindowMs);
  // What the engine's layout and completion channel are checked against.
  EXPECT_EQ(l.max_completion_slots, core::SignalLayout::kMaxSlots);
  EXPECT_EQ(l.max_layers, core::kMaxLayers);
  EXPECT_EQ(l.max_regions, core::kMaxRegions);
}

TEST(CacheLimitsTest, DefaultPinLeaseIsClampedToTheMaximum) {
  const CacheLimits l = CacheLimits::FromConfig(WithSessions(9000, int64_t{kMaxPinLeaseMs} * 2));
  EXPECT_EQ(l.default_pin_lease_ms, kMaxPinLeaseMs);
}

TEST(CacheLimitsTest, HeartbeatIntervalIsNeverZero) {
  EXPECT_EQ(CacheLimits::FromConfig(WithSessions(2, 1000)).heartbeat_interval_ms, 1u);
}

TEST(CacheLimitsTest, DefaultsMatchTheDefaultConfig) {
  const Config c = DefaultConfig();
  const CacheLimits l = CacheLimits::FromConfig(c);
  EXPECT_EQ(l.max_batch_pages, static_cast<uint64_t>(c.server.max_batch_pages));
  EXPECT_EQ(l.lease_ms, static_cast<uint64_t>(c.sessions.lease_ms));
  EXPECT_GT(l.lease_ms, 0u);
  EXPECT_GT(l.heartbeat_interval_ms, 0u);
  EXPECT_LT(l.heartbeat_interval_ms, l.lease_ms);
}

TEST(CacheLimitsTest, ReportsEveryServerLimitsField) {
  Config config = WithSessions(9000, 20000);
  config.events.endpoint = "tcp://*:5557";  // Events publish: page tokens are wanted.
  const CacheLimits l = CacheLimits::FromConfig(config);
  v1::ServerLimits proto;
  l.ToProto(&proto);
  EXPECT_TRUE(proto.page_tokens());
  EXPECT_EQ(proto.max_batch_pages(), l.max_batch_pages);
  EXPECT_EQ(proto.max_batch_sequences(), l.max_batch_sequences);
  EXPECT_EQ(proto.max_message_bytes(), l.max_message_bytes);
  EXPECT_EQ(proto.default_pin_lease_ms(), l.default_pin_lease_ms);
  EXPECT_EQ(proto.max_pin_lease_ms(), l.max_pin_lease_ms);
  EXPECT_EQ(proto.max_wait_ms(), l.max_wait_ms);
  EXPECT_EQ(proto.max_inflight_ops(), l.max_inflight_ops);
  EXPECT_EQ(proto.max_prefetch_timeout_ms(), l.max_prefetch_timeout_ms);
  EXPECT_EQ(proto.op_result_retention_ms(), l.op_result_retention_ms);
  EXPECT_EQ(proto.max_completion_slots(), l.max_completion_slots);
  EXPECT_EQ(proto.max_layers(), l.max_layers);
  EXPECT_EQ(proto.max_regions(), l.max_regions);
  EXPECT_EQ(proto.group_match_window_ms(), l.group_match_window_ms);
  // A field added to the proto and forgotten here would reach clients as 0 ("no limit" to some).
  const google::protobuf::Reflection* reflection = proto.GetReflection();
  const google::protobuf::Descriptor* descriptor = proto.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    EXPECT_TRUE(reflection->HasField(proto, field)) << field->name() << " is not reported";
  }
}

TEST(CacheLimitsTest, PageTokensAreWantedOnlyWhileEventsPublish) {
  Config config = WithSessions(9000, 20000);
  EXPECT_FALSE(CacheLimits::FromConfig(config).page_tokens);
  EXPECT_FALSE(CacheLimits::FromConfig(config).label_pages);
  config.events.endpoint = "ipc:///tmp/events";
  EXPECT_TRUE(CacheLimits::FromConfig(config).page_tokens);
  EXPECT_TRUE(CacheLimits::FromConfig(config).label_pages);
  config.events.page_tokens = false;  // Engine hashes (opaque keys) are still kept.
  EXPECT_FALSE(CacheLimits::FromConfig(config).page_tokens);
  EXPECT_TRUE(CacheLimits::FromConfig(config).label_pages);
}

TEST(CacheLimitsTest, PinLeaseZeroIsTheDefaultAndLongOnesAreClamped) {
  const CacheLimits l = CacheLimits::FromConfig(WithSessions(9000, 20000));
  EXPECT_EQ(l.PinLeaseMs(0), 20000u);
  EXPECT_EQ(l.PinLeaseMs(1), 1u);
  EXPECT_EQ(l.PinLeaseMs(kMaxPinLeaseMs), kMaxPinLeaseMs);
  EXPECT_EQ(l.PinLeaseMs(kMaxPinLeaseMs + 1), kMaxPinLeaseMs);
}

}  // namespace
}  // namespace kvcellar::server
