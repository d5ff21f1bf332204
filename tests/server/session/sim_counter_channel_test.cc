// Tests server/session/sim_counter_channel.h: the daemon opens an engine's real KVCSIG01 region
// (created as libkvcellar-client creates it) and refuses one that disagrees with the
// registration, naming the field; words the engine stores are what the daemon reads.
#include "server/session/sim_counter_channel.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/sim_engine_memory.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kLoadSlots = 2;
constexpr uint32_t kReadySlots = 3;

class SimCounterChannelTest : public ::testing::Test {
 protected:
  SimCounterChannelTest() {
    absl::StatusOr<platform::SignalRegion> r = platform::SignalRegion::Create(
        platform::UniqueShmName("chan"), kLoadSlots, kLayers, kReadySlots);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) engine_ = *std::move(r);
  }

  uint64_t Bytes() const {
    return core::SignalLayout::Bytes(kLoadSlots, kLayers, kReadySlots);
  }

  platform::SignalRegion engine_;
};

TEST_F(SimCounterChannelTest, OpensTheEnginesRegionAndSeesItsWords) {
  absl::StatusOr<std::shared_ptr<SimCounterChannel>> ch =
      SimCounterChannel::Open(engine_.name(), Bytes(), kLoadSlots, kLayers, kReadySlots);
  ASSERT_TRUE(ch.ok()) << ch.status();
  engine_.PublishReady(2, 77);
  EXPECT_EQ((*ch)->ready_word(2), 77u);
  (*ch)->SignalLayer(1, kLayers - 1, 9);
  EXPECT_EQ(engine_.layer_word(1, kLayers - 1), 9u);
}

TEST_F(SimCounterChannelTest, AMissingObjectNamesTheShmName) {
  absl::StatusOr<std::shared_ptr<SimCounterChannel>> ch = SimCounterChannel::Open(
      "/kvc-no-such-region", Bytes(), kLoadSlots, kLayers, kReadySlots);
  EXPECT_TRUE(IsCacheError(ch.status(), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_HANDLE_OPEN_FAILED,
                           "completion.sim_counters.shm_name"));
}

TEST_F(SimCounterChannelTest, ASizeBelowWhatTheCountsNeedIsAnInvalidField) {
  absl::StatusOr<std::shared_ptr<SimCounterChannel>> ch =
      SimCounterChannel::Open(engine_.name(), Bytes() - 8, kLoadSlots, kLayers, kReadySlots);
  EXPECT_TRUE(IsCacheError(ch.status(), absl::StatusCode::kInvalidArgument,
                           v1::ERROR_REASON_INVALID_FIELD, "completion.sim_counters.size_bytes"));
}

TEST_F(SimCounterChannelTest, AHeaderThatDisagreesNamesTheCountAtFault) {
  absl::StatusOr<std::shared_ptr<SimCounterChannel>> ch = SimCounterChannel::Open(
      engine_.name(), core::SignalLayout::Bytes(kLoadSlots, kLayers, kReadySlots - 1), kLoadSlots,
      kLayers, kReadySlots - 1);
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ErrorFieldOf(ch.status()), "completion.num_ready_slots");
  EXPECT_THAT(ch.status().message(), HasSubstr("the header says 3"));
}

}  // namespace
}  // namespace kvcellar::server::testing
