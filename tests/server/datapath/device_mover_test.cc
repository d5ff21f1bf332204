// Tests server/datapath/device_mover.h with the sim device and an engine's KV cache in shared
// memory: Backup gathers device blocks into L2 page objects and commits them (dedup, parent and
// space checks, a sequence stopping at its first failure), Load scatters the group-consistent L2
// prefix into device blocks, and a reservation error changes nothing. Bytes are checked against
// the pattern the engine was filled with.
#include "server/datapath/device_mover.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/sim_device.h"
#include "platform/sim_engine_memory.h"
#include "gtest/gtest.h"
#include "tests/gpu/sim_test_util.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;

constexpr uint32_t kBlocks = 16;
constexpr uint32_t kSeed = 5;

class DeviceMoverTest : public ::testing::Test {
 protected:
  explicit DeviceMoverTest(L2World::Options l2 = L2World::Options())
      : world_(l2),
        ops_(&world_.metrics(), absl::Seconds(60)),
        limits_(CacheLimits::FromConfig(DefaultConfig())),
        sim_(MakeSim()),
        devices_(sim_.get()),
        mover_(&devices_, &world_.l2(), &pins_, &ops_, &pump_, &world_.metrics(), &limits_),
        kv_(MakeEngine()),
        ns_(world_.Adopted(NsSpec(), kv_->layout())),
        keys_(PromptKeys(NsSpec(), 1, 6)) {
    gpu::testing::FillEngine(*kv_, kSeed);
    absl::StatusOr<std::unique_ptr<gpu::EngineMapping>> mapping = sim_->OpenEngine(gpu::testing::SpecOf(*kv_));
    EXPECT_TRUE(mapping.ok()) << mapping.status();
    SessionInfo info = WorkerInfo(ns_, "inst", 0, 21);
    info.num_blocks = kBlocks;
    info.num_load_slots = 4;
    session_ = std::make_shared<Session>(std::move(info), *std::move(mapping),
                                         absl::Now() + absl::Seconds(60));
  }
  ~DeviceMoverTest() override { session_->Close(); }

  static std::unique_ptr<gpu::SimDevice> MakeSim() {
    gpu::SimDevice::Options o;
    o.copy_threads = 1;
    absl::StatusOr<std::unique_ptr<gpu::SimDevice>> d = gpu::SimDevice::Create(o);
    EXPECT_TRUE(d.ok()) << d.status();
    return *std::move(d);
  }
  static std::unique_ptr<platform::SimEngineKvCache> MakeEngine() {
    platform::SimKvShape shape;
    shape.num_layers = kLayers;
    shape.num_blocks = kBlocks;
    shape.bytes_per_block = kBytesPerBlock;
    absl::StatusOr<platform::SimEngineKvCache> kv =
        platform::SimEngineKvCache::Create(platform::UniqueShmName("mover"), shape, 0);
    EXPECT_TRUE(kv.ok()) << kv.status();
    return std::make_unique<platform::SimEngineKvCache>(*std::move(kv));
  }

  v1::BackupRequest BackupOf(size_t begin, size_t end, uint32_t first_block) {
    v1::BackupRequest r;
    v1::BackupSequence* seq = r.add_sequences();
    if (begin > 0) seq->set_parent_key(std::string(keys_[begin - 1].AsBytes()));
    seq->set_page_keys(KeyBlob(keys_, begin, end));
    for (uint32_t b : Blocks(first_block, static_cast<uint32_t>(end - begin))) {
      seq->add_device_blocks(b);
    }
    return r;
  }
  v1::LoadRequest LoadOf(size_t begin, size_t end, uint32_t first_block) {
    v1::LoadRequest r;
    v1::LoadSequence* seq = r.add_sequences();
    seq->set_page_keys(KeyBlob(keys_, begin, end));
    for (uint32_t b : Blocks(first_block, static_cast<uint32_t>(end - begin))) {
      seq->add_device_blocks(b);
    }
    return r;
  }

  // Runs an op to its end; its page statuses (one sequence).
  std::vector<int> Run(absl::StatusOr<std::shared_ptr<OpRecord>> op) {
    EXPECT_TRUE(op.ok()) << op.status();
    if (!op.ok()) return {};
    const v1::OpResult r = AwaitOp(ops_, **op);
    EXPECT_EQ(r.state(), v1::OP_STATE_DONE);
    return r.sequences_size() == 1 ? Statuses(r.sequences(0)) : std::vector<int>{};
  }

  // "" when the L2 object of `key` holds device block `block`'s bytes.
  std::string CheckL2(const core::PageKey& key, uint32_t block) {
    core::SlotRef slot;
    ns_->index()->GetL2Slots(absl::MakeConstSpan(&key, 1), 0, absl::MakeSpan(&slot, 1));
    if (!slot.valid()) return "not in L2";
    return gpu::testing::CheckPage(kv_->layout(), world_.pool().Address(slot), kSeed, block);
  }

  L2World world_;
  OpTable ops_;
  PinTable pins_;
  SimSignalPump pump_;
  const CacheLimits limits_;
  std::unique_ptr<gpu::SimDevice> sim_;
  DeviceSet devices_;
  DeviceMover mover_;
  std::unique_ptr<platform::SimEngineKvCache> kv_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  std::shared_ptr<Session> session_;
};

TEST_F(DeviceMoverTest, BackupGathersBlocksIntoL2AndCommitsThem) {
  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf(0, 4, 3))), Each(v1::PAGE_STATUS_OK));
  EXPECT_EQ(L2World::L2Hits(*ns_, keys_), 4u);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(CheckL2(keys_[i], 3 + i), "") << "page " << i;
  EXPECT_EQ(session_->busy_blocks(), 0u) << "blocks back to the engine";
  EXPECT_EQ(session_->inflight_ops(), 0u);
  EXPECT_EQ(ns_->index()->Stats().pins, 0u) << "no copy pin left";
  EXPECT_EQ(world_.metrics().Snapshot().d2h_bytes, 4 * kObjectBytes);
}

TEST_F(DeviceMoverTest, BackupSkipsPagesAlreadyPresentAndStopsAtAMissingParent) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf(0, 2, 0))), Each(v1::PAGE_STATUS_OK));
  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf(0, 3, 8))),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT, v1::PAGE_STATUS_ALREADY_PRESENT,
                          v1::PAGE_STATUS_OK));
  EXPECT_EQ(CheckL2(keys_[0], 0), "") << "not copied again";
  EXPECT_EQ(CheckL2(keys_[2], 10), "");

  // Page 4's parent (page 3) is not indexed.
  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf(4, 6, 12))),
              ElementsAre(v1::PAGE_STATUS_PARENT_MISSING, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(SlotsUsed(world_.pool()), 3u) << "no slot kept for the refused pages";
  EXPECT_EQ(ns_->index()->Stats().l2_inflight_objects, 0u);
}

TEST_F(DeviceMoverTest, LoadScattersTheL2PrefixAndMissesTheRest) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf(0, 3, 0))), Each(v1::PAGE_STATUS_OK));
  EXPECT_THAT(Run(mover_.Load(session_, LoadOf(0, 5, 8))),
              ElementsAre(v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK, v1::PAGE_STATUS_OK,
                          v1::PAGE_STATUS_MISS, v1::PAGE_STATUS_SKIPPED));
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(gpu::testing::CheckBlock(*kv_, 8 + i, kSeed, i), "") << "page " << i;
  }
  EXPECT_EQ(gpu::testing::CheckBlock(*kv_, 11, kSeed, 11), "")
      << "a missed page's block is untouched";
  EXPECT_EQ(gpu::testing::CheckBlock(*kv_, 12, kSeed, 12), "");
  EXPECT_EQ(session_->busy_blocks(), 0u);
  EXPECT_EQ(ns_->index()->Stats().pins, 0u) << "the copy pins are dropped";
  EXPECT_EQ(world_.metrics().Snapshot().h2d_bytes, 3 * kObjectBytes);
}

TEST_F(DeviceMoverTest, LoadWithReleasePinDropsThisRanksHold) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf(0, 2, 0))), Each(v1::PAGE_STATUS_OK));
  const std::vector<core::PageKey> pinned = {keys_[0], keys_[1]};
  ns_->index()->Pin(900, pinned, absl::Now() + absl::Seconds(30));
  pins_.Add(900, "inst", ns_, pinned, 1, absl::Seconds(30), absl::Now() + absl::Seconds(30));
  v1::LoadRequest load = LoadOf(0, 2, 4);
  load.mutable_sequences(0)->set_pin_id(900);
  load.mutable_sequences(0)->set_release_pin(true);
  EXPECT_THAT(Run(mover_.Load(session_, load)), Each(v1::PAGE_STATUS_OK));
  EXPECT_EQ(pins_.size(), 0u);
  EXPECT_EQ(ns_->index()->Stats().pinned_pages, 0u);
}

TEST_F(DeviceMoverTest, ReservationErrorsChangeNothing) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf(0, 2, 0))), Each(v1::PAGE_STATUS_OK));
  // Another op of the session still uses block 6.
  const std::vector<uint32_t> held = {6};
  ASSERT_TRUE(session_
                  ->Reserve(
                      held, [](size_t) { return ""; }, std::nullopt, "", 8)
                  .ok());
  session_->EndSubmission(true);

  absl::StatusOr<std::shared_ptr<OpRecord>> busy = mover_.Load(session_, LoadOf(0, 2, 5));
  EXPECT_TRUE(IsCacheError(busy.status(), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_BLOCK_BUSY, "sequences[0].device_blocks[1]"));
  EXPECT_EQ(gpu::testing::CheckBlock(*kv_, 5, kSeed, 5), "") << "nothing copied";
  EXPECT_EQ(ops_.unfinished(), 0u);
  EXPECT_EQ(session_->busy_blocks(), 1u) << "block 5 was not taken";
  EXPECT_EQ(ns_->index()->Stats().pins, 0u);

  absl::StatusOr<std::shared_ptr<OpRecord>> backup = mover_.Backup(session_, BackupOf(2, 3, 6));
  EXPECT_EQ(ErrorReasonOf(backup.status()), v1::ERROR_REASON_BLOCK_BUSY);
  EXPECT_EQ(ns_->index()->Stats().l2_inflight_objects, 0u);
  EXPECT_EQ(SlotsUsed(world_.pool()), 2u);

  session_->ReleaseBlocks(held);
  session_->OpFinished();
  session_->Close();
  EXPECT_EQ(ErrorReasonOf(mover_.Load(session_, LoadOf(0, 2, 5)).status()),
            v1::ERROR_REASON_SESSION_UNKNOWN);
}

L2World::Options OneRegion() {
  L2World::Options o;
  o.pool_bytes = kRegionBytes;
  return o;
}

class FullPoolDeviceMoverTest : public DeviceMoverTest {
 protected:
  FullPoolDeviceMoverTest() : DeviceMoverTest(OneRegion()) {}
};

TEST_F(FullPoolDeviceMoverTest, BackupWithoutAnySlotIsNoSpace) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf(0, 1, 0))), Each(v1::PAGE_STATUS_OK));
  // The rest of the pool: pinned pages of another model of the same object size.
  std::shared_ptr<Namespace> other = world_.Adopted(NsSpec(1, false, "other"), kv_->layout());
  const std::vector<core::PageKey> filler = PromptKeys(NsSpec(1, false, "other"), 1, 63);
  ASSERT_EQ(world_.Commit(*other, filler), 63u);
  other->index()->Pin(7, filler, absl::InfiniteFuture());
  ns_->index()->Pin(8, {keys_[0]}, absl::InfiniteFuture());

  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf(1, 3, 1))),
              ElementsAre(v1::PAGE_STATUS_NO_SPACE, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(SlotsUsed(world_.pool()), 64u);
  EXPECT_EQ(ns_->index()->Stats().l2_inflight_objects, 0u);
  EXPECT_EQ(session_->busy_blocks(), 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
