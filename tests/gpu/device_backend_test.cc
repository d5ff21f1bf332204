#include "gpu/device_backend.h"

#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/signal_region.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::gpu {
namespace {

using ::testing::HasSubstr;

TEST(DeviceOpTest, FinishOnceAndWait) {
  DeviceOp op(DeviceOp::Kind::kScatter, 4);
  EXPECT_FALSE(op.Poll());
  EXPECT_EQ(op.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(op.Wait(absl::Milliseconds(5)));
  op.SetLayersDone(2);
  EXPECT_EQ(op.layers_done(), 2u);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(20));
    EXPECT_TRUE(op.Finish(absl::OkStatus()));
  });
  EXPECT_TRUE(op.Wait(absl::Seconds(30)));
  t.join();
  EXPECT_TRUE(op.status().ok());
  EXPECT_EQ(op.layers_done(), 4u);
  EXPECT_FALSE(op.Finish(absl::InternalError("late")));
  EXPECT_TRUE(op.status().ok());
}

TEST(DeviceOpTest, CancelIsAFlag) {
  DeviceOp op(DeviceOp::Kind::kGather, 1);
  EXPECT_FALSE(op.cancel_requested());
  op.Cancel();
  EXPECT_TRUE(op.cancel_requested());
  EXPECT_FALSE(op.Poll());  // Still the backend's to finish.
}

core::KvLayout Blocks(uint32_t n, std::vector<uint32_t> group_num_blocks = {}) {
  core::KvLayout l;
  l.num_blocks = n;
  l.group_num_blocks = std::move(group_num_blocks);
  return l;
}

TEST(ValidateCopyItemsTest, NamesTheItem) {
  uint8_t page[8];
  std::vector<CopyItem> items = {{0, page}, {3, page}, {4, page}};
  absl::Status s = ValidateCopyItems(items, Blocks(4), 1, false);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[2].device_block (4) out of range [0, 4)"));
  items[2] = {1, nullptr};
  s = ValidateCopyItems(items, Blocks(4), 1, false);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[2].host_page is null"));
  items[2] = {0, page};
  EXPECT_TRUE(ValidateCopyItems(items, Blocks(4), 1, false).ok());
  s = ValidateCopyItems(items, Blocks(4), 1, true);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[2].device_block (0) duplicates items[0]"));
  EXPECT_TRUE(ValidateCopyItems({}, Blocks(4), 1, true).ok());
  items[1] = {1, page, 2};
  s = ValidateCopyItems(items, Blocks(4), 2, false);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[1].group (2) out of range [0, 2)"));
  items[1].group = 1;
  EXPECT_TRUE(ValidateCopyItems(items, Blocks(4), 2, false).ok());
}

TEST(ValidateCopyItemsTest, GroupsWithPoolsOfTheirOwnHaveTheirOwnBlocks) {
  uint8_t page[8];
  // Group 0: 4 blocks; group 1: 2 slots. Block 0 of each is not the same block.
  std::vector<CopyItem> items = {{0, page, 0}, {0, page, 1}, {3, page, 0}};
  EXPECT_TRUE(ValidateCopyItems(items, Blocks(4, {4, 2}), 2, true).ok());
  // With one shared pool they are: a scatter into it twice races.
  absl::Status s = ValidateCopyItems(items, Blocks(4), 2, true);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[1].device_block (0) duplicates items[0]"));
  // Group 1's block 2 is past its 2 slots, though below num_blocks.
  items[1].device_block = 2;
  s = ValidateCopyItems(items, Blocks(4, {4, 2}), 2, true);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[1].device_block (2) out of range [0, 2)"));
  items[1].device_block = 1;
  items.push_back({1, page, 1});
  s = ValidateCopyItems(items, Blocks(4, {4, 2}), 2, true);
  EXPECT_THAT(std::string(s.message()), HasSubstr("items[3].device_block (1) duplicates items[1]"));
}

TEST(OpenCompletionRegionTest, ChecksTheLayoutAndNamesTheField) {
  const std::string name = platform::UniqueShmName("sig");
  absl::StatusOr<platform::SignalRegion> engine = platform::SignalRegion::Create(name, 4, 3, 2);
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<platform::SignalRegion> daemon = OpenCompletionRegion(name, 3);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(daemon->num_load_slots(), 4u);
  absl::Status wrong = OpenCompletionRegion(name, 4).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("completion_region: "));
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("num_layers 3"));
  absl::Status missing = OpenCompletionRegion(platform::UniqueShmName("missing"), 3).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("completion_region: "));
}

TEST(DeviceUuidTest, NormalizesEveryCommonSpelling) {
  const std::string want = "8e6a0b1c2d3e4f5061728394a5b6c7d8";
  EXPECT_EQ(*NormalizeDeviceUuid("GPU-8e6a0b1c-2d3e-4f50-6172-8394a5b6c7d8"), want);
  EXPECT_EQ(*NormalizeDeviceUuid("gpu-8E6A0B1C-2D3E-4F50-6172-8394A5B6C7D8"), want);
  EXPECT_EQ(*NormalizeDeviceUuid("8e6a0b1c2d3e4f5061728394a5b6c7d8"), want);
  EXPECT_FALSE(NormalizeDeviceUuid("GPU-8e6a").ok());
  EXPECT_FALSE(NormalizeDeviceUuid("GPU-8e6a0b1c-2d3e-4f50-6172-8394a5b6c7zz").ok());
  const uint8_t raw[16] = {0x8e, 0x6a, 0x0b, 0x1c, 0x2d, 0x3e, 0x4f, 0x50,
                           0x61, 0x72, 0x83, 0x94, 0xa5, 0xb6, 0xc7, 0xd8};
  EXPECT_EQ(FormatGpuUuid(raw), "GPU-8e6a0b1c-2d3e-4f50-6172-8394a5b6c7d8");
  EXPECT_EQ(*NormalizeDeviceUuid(FormatGpuUuid(raw)), want);
}

}  // namespace
}  // namespace kvcellar::gpu
