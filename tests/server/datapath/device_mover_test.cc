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
#include "gtest/gtest.h"
#include "platform/sim_engine_memory.h"
#include "server/rpc/request_validation.h"
#include "tests/gpu/sim_test_util.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;

constexpr uint32_t kBlocks = 16;
constexpr uint32_t kSeed = 5;

// The daemon's side of the copies: an L2 pool, the op and pin tables, and a mover over the sim
// device.
class MoverFixture : public ::testing::Test {
 protected:
  explicit MoverFixture(L2World::Options l2 = L2World::Options())
      : world_(l2),
        ops_(&world_.metrics(), absl::Seconds(60)),
        limits_(CacheLimits::FromConfig(DefaultConfig())),
        sim_(gpu::testing::OneThreadSimDevice()),
        devices_(sim_.get()),
        mover_(&devices_, &world_.l2(), &pins_, &ops_, &pump_, &world_.metrics(), &limits_) {}

  // Runs an op to its end; its page statuses (one sequence).
  std::vector<int> Run(absl::StatusOr<std::shared_ptr<OpRecord>> op) {
    EXPECT_TRUE(op.ok()) << op.status();
    if (!op.ok()) return {};
    const v1::OpResult r = AwaitOp(ops_, **op);
    EXPECT_EQ(r.state(), v1::OP_STATE_DONE);
    return r.sequences_size() == 1 ? Statuses(r.sequences(0)) : std::vector<int>{};
  }

  L2World world_;
  OpTable ops_;
  PinTable pins_;
  SimSignalPump pump_;
  const CacheLimits limits_;
  std::unique_ptr<gpu::SimDevice> sim_;
  DeviceSet devices_;
  DeviceMover mover_;
};

class DeviceMoverTest : public MoverFixture {
 protected:
  explicit DeviceMoverTest(L2World::Options l2 = L2World::Options())
      : MoverFixture(l2),
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

  // "" when the L2 object of `key` holds device block `block`'s bytes.
  std::string CheckL2(const core::PageKey& key, uint32_t block) {
    core::SlotRef slot;
    ns_->index()->GetL2Slots(absl::MakeConstSpan(&key, 1), 0, absl::MakeSpan(&slot, 1));
    if (!slot.valid()) return "not in L2";
    return gpu::testing::CheckPage(kv_->layout(), world_.pool().Address(slot), kSeed, block);
  }

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

// A hybrid model (docs/api.md "Groups"): three layers in three KV groups (full attention, a
// sliding window of two pages, a recurrent state), each page one object per group. Backup stores
// the objects the engine names, Match finds the longest boundary every group serves, and Load
// copies each group's object into that group's layers of the block named for it, and only there.
constexpr uint32_t kHybridBlocks = 32;
constexpr uint32_t kHybridSeed = 9;

core::NamespaceSpec HybridSpec() {
  core::NamespaceSpec spec = NsSpec(1, false, "hybrid-model");
  spec.groups = {{core::GroupKind::kFull, 0},
                 {core::GroupKind::kWindow, 2 * kPageSize + 1},  // The last 2 pages.
                 {core::GroupKind::kState, 0}};
  return spec;
}

class HybridDeviceMoverTest : public MoverFixture {
 protected:
  HybridDeviceMoverTest() {
    platform::SimKvShape shape;
    shape.num_layers = 3;
    shape.num_blocks = kHybridBlocks;
    shape.bytes_per_block = kBytesPerBlock;
    absl::StatusOr<platform::SimEngineKvCache> kv =
        platform::SimEngineKvCache::Create(platform::UniqueShmName("hybrid"), shape, 0);
    EXPECT_TRUE(kv.ok()) << kv.status();
    kv_ = std::make_unique<platform::SimEngineKvCache>(*std::move(kv));
    gpu::testing::FillEngine(*kv_, kHybridSeed);
    layout_ = kv_->layout();
    for (uint32_t l = 0; l < 3; ++l) layout_.layers[l].group = l;  // Layer l is group l.
    ns_ = world_.Adopted(HybridSpec(), layout_);
    keys_ = PromptKeys(HybridSpec(), 1, 6);
    gpu::EngineSpec spec = gpu::testing::SpecOf(*kv_);
    spec.layout = layout_;
    absl::StatusOr<std::unique_ptr<gpu::EngineMapping>> mapping = sim_->OpenEngine(spec);
    EXPECT_TRUE(mapping.ok()) << mapping.status();
    SessionInfo info = WorkerInfo(ns_, "inst", 0, 31);
    info.num_blocks = kHybridBlocks;
    info.num_layers = 3;
    session_ = std::make_shared<Session>(std::move(info), *std::move(mapping),
                                         absl::Now() + absl::Seconds(60));
  }
  ~HybridDeviceMoverTest() override { session_->Close(); }

  // Page i's blocks for the three groups (kNoBlock: not named), page-major.
  struct PageBlocks {
    uint32_t full = kNoBlock;
    uint32_t window = kNoBlock;
    uint32_t state = kNoBlock;
  };
  template <typename Seq>
  static void SetBlocks(Seq* seq, const std::vector<PageBlocks>& pages) {
    for (const PageBlocks& p : pages) {
      seq->add_group_blocks(p.full);
      seq->add_group_blocks(p.window);
      seq->add_group_blocks(p.state);
    }
  }
  v1::BackupRequest BackupOf(const std::vector<PageBlocks>& pages) {
    v1::BackupRequest r;
    v1::BackupSequence* seq = r.add_sequences();
    seq->set_page_keys(KeyBlob(keys_, 0, pages.size()));
    SetBlocks(seq, pages);
    return r;
  }
  v1::LoadRequest LoadOf(const std::vector<PageBlocks>& pages) {
    v1::LoadRequest r;
    v1::LoadSequence* seq = r.add_sequences();
    seq->set_page_keys(KeyBlob(keys_, 0, pages.size()));
    SetBlocks(seq, pages);
    return r;
  }
  // "" when group `group`'s L2 object of page `page` holds device block `block`'s bytes of that
  // group's layer.
  std::string CheckL2(uint32_t page, uint32_t group, uint32_t block) {
    core::SlotRef slot;
    ns_->index()->GetL2Slots(absl::MakeConstSpan(&keys_[page], 1), ns_->GroupShard(group, 0),
                             absl::MakeSpan(&slot, 1));
    if (!slot.valid()) return "not in L2";
    const uint8_t* object = world_.pool().Address(slot);
    for (const core::PageSegment& s : core::PageSegments(layout_)) {
      if (s.group != group) continue;
      if (s.object_offset + s.bytes > kBytesPerBlock * 2) return "object larger than one layer";
      if (!gpu::testing::HoldsPattern(object + s.object_offset, s.bytes, kHybridSeed, s.layer,
                                      s.buffer, block)) {
        return "differs from block " + std::to_string(block);
      }
    }
    return "";
  }
  // Whether layer `layer` of device block `block` holds block `source`'s pattern (K and V).
  bool BlockHolds(uint32_t layer, uint32_t block, uint32_t source) {
    for (uint32_t buf = 0; buf < 2; ++buf) {
      if (!gpu::testing::HoldsPattern(kv_->Block(layer, buf, block), kBytesPerBlock, kHybridSeed,
                                      layer, buf, source)) {
        return false;
      }
    }
    return true;
  }

  std::unique_ptr<platform::SimEngineKvCache> kv_;
  core::KvLayout layout_;
  std::shared_ptr<Namespace> ns_;
  std::vector<core::PageKey> keys_;
  std::shared_ptr<Session> session_;
};

TEST_F(HybridDeviceMoverTest, StoresEachGroupsObjectsAndLoadsThemIntoThatGroupsLayers) {
  // As an engine after a 6-page prompt: every full-attention page, the window's last two pages,
  // and the states at the ends of pages 2 and 5.
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf({{0, kNoBlock, kNoBlock},
                                                    {1, kNoBlock, kNoBlock},
                                                    {2, kNoBlock, 8},
                                                    {3, kNoBlock, kNoBlock},
                                                    {4, 6, kNoBlock},
                                                    {5, 7, 9}}))),
              Each(v1::PAGE_STATUS_OK));
  for (uint32_t p = 0; p < 6; ++p) EXPECT_EQ(CheckL2(p, 0, p), "") << "page " << p;
  EXPECT_EQ(CheckL2(4, 1, 6), "");
  EXPECT_EQ(CheckL2(5, 1, 7), "");
  EXPECT_EQ(CheckL2(2, 2, 8), "");
  EXPECT_EQ(CheckL2(5, 2, 9), "");
  EXPECT_EQ(CheckL2(3, 1, 0), "not in L2") << "only the objects named are stored";
  EXPECT_EQ(world_.metrics().Snapshot().d2h_bytes, 10 * ns_->object_bytes());

  // Boundary 6 is served by every group; boundary 3 has its state but not its window's pages.
  EXPECT_EQ(L2World::L2Hits(*ns_, keys_), 6u);
  EXPECT_EQ(L2World::L2Hits(*ns_, absl::MakeConstSpan(keys_).first(3)), 0u);

  // Loaded into other blocks: each group's layer of its block gets the stored bytes, and the
  // other groups' layers of that block are untouched.
  EXPECT_THAT(Run(mover_.Load(session_, LoadOf({{16, kNoBlock, kNoBlock},
                                                {17, kNoBlock, kNoBlock},
                                                {18, kNoBlock, kNoBlock},
                                                {19, kNoBlock, kNoBlock},
                                                {20, 22, kNoBlock},
                                                {21, 23, 24}}))),
              Each(v1::PAGE_STATUS_OK));
  for (uint32_t p = 0; p < 6; ++p) {
    EXPECT_TRUE(BlockHolds(0, 16 + p, p)) << "full page " << p;
    EXPECT_TRUE(BlockHolds(1, 16 + p, 16 + p)) << "window layer of block " << 16 + p;
    EXPECT_TRUE(BlockHolds(2, 16 + p, 16 + p)) << "state layer of block " << 16 + p;
  }
  EXPECT_TRUE(BlockHolds(1, 22, 6));
  EXPECT_TRUE(BlockHolds(1, 23, 7));
  EXPECT_TRUE(BlockHolds(2, 24, 9));
  EXPECT_TRUE(BlockHolds(0, 24, 24)) << "the state's block keeps its other layers";
  EXPECT_EQ(session_->busy_blocks(), 0u);
  EXPECT_EQ(ns_->index()->Stats().pins, 0u) << "no copy pin left";
}

TEST_F(HybridDeviceMoverTest, ALoadMissingOneObjectCopiesNothing) {
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf({{0, kNoBlock, kNoBlock},
                                                    {1, kNoBlock, kNoBlock},
                                                    {2, 6, kNoBlock},
                                                    {3, 7, 8}}))),
              Each(v1::PAGE_STATUS_OK));
  // The engine asks for the window on page 1 as well, which was never stored: the blocks it
  // allocated are for a boundary the cache cannot serve, so no page is copied.
  EXPECT_THAT(Run(mover_.Load(session_, LoadOf({{16, kNoBlock, kNoBlock},
                                                {17, 20, kNoBlock},
                                                {18, 21, kNoBlock},
                                                {19, 22, 23}}))),
              ElementsAre(v1::PAGE_STATUS_SKIPPED, v1::PAGE_STATUS_MISS, v1::PAGE_STATUS_SKIPPED,
                          v1::PAGE_STATUS_SKIPPED));
  for (uint32_t b = 16; b < 24; ++b) {
    for (uint32_t l = 0; l < 3; ++l) EXPECT_TRUE(BlockHolds(l, b, b)) << "block " << b;
  }
  EXPECT_EQ(session_->busy_blocks(), 0u);
  EXPECT_EQ(ns_->index()->Stats().pins, 0u);
  // The same boundary with the blocks the stored objects serve loads whole.
  EXPECT_THAT(Run(mover_.Load(session_, LoadOf({{16, kNoBlock, kNoBlock},
                                                {17, kNoBlock, kNoBlock},
                                                {18, 21, kNoBlock},
                                                {19, 22, 23}}))),
              Each(v1::PAGE_STATUS_OK));
  EXPECT_TRUE(BlockHolds(2, 23, 8));
}

TEST_F(HybridDeviceMoverTest, ABackupPageFailsWholeAndNothingAfterItIsStored) {
  // Page 0 stored; page 2's parent (page 1) is not: its objects all fail, nothing is left behind.
  ASSERT_THAT(Run(mover_.Backup(session_, BackupOf({{0, 3, kNoBlock}}))), Each(v1::PAGE_STATUS_OK));
  v1::BackupRequest orphan;
  v1::BackupSequence* seq = orphan.add_sequences();
  seq->set_parent_key(std::string(keys_[1].AsBytes()));
  seq->set_page_keys(KeyBlob(keys_, 2, 4));
  SetBlocks(seq, {{4, 5, 6}, {7, 8, 9}});
  EXPECT_THAT(Run(mover_.Backup(session_, orphan)),
              ElementsAre(v1::PAGE_STATUS_PARENT_MISSING, v1::PAGE_STATUS_SKIPPED));
  EXPECT_EQ(ns_->index()->Stats().l2_objects, 2u) << "page 0's two objects only";
  EXPECT_EQ(session_->busy_blocks(), 0u);
  // Stored again with one more group: only the new object is copied.
  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf({{10, 3, 11}}))),
              ElementsAre(v1::PAGE_STATUS_OK));
  EXPECT_EQ(CheckL2(0, 0, 0), "") << "the full object was present: not copied again";
  EXPECT_EQ(CheckL2(0, 2, 11), "");
  EXPECT_THAT(Run(mover_.Backup(session_, BackupOf({{10, 3, 11}}))),
              ElementsAre(v1::PAGE_STATUS_ALREADY_PRESENT));
}

}  // namespace
}  // namespace kvcellar::server::testing
