#include "core/kv_layout.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::HasSubstr;

// vLLM-like: one region per layer, K blocks then V blocks.
KvLayout MhaLayout(uint32_t layers, uint32_t blocks, uint64_t bpb) {
  KvLayout l;
  l.num_blocks = blocks;
  for (uint32_t i = 0; i < layers; ++i) {
    l.regions.push_back({"/r" + std::to_string(i), 0, 2 * blocks * bpb});
    l.layers.push_back({{i, 0, bpb, bpb}, BufferLayout{i, blocks * bpb, bpb, bpb}});
  }
  return l;
}

void ExpectInvalid(const KvLayout& l, const std::string& field) {
  absl::Status s = l.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(KvLayoutTest, ValidMhaAndObjectFormat) {
  KvLayout l = MhaLayout(3, 16, 4096);
  ASSERT_TRUE(l.Validate().ok()) << l.Validate();
  EXPECT_FALSE(l.is_mla());
  EXPECT_EQ(l.PageObjectBytes(), 3u * 2 * 4096);
  std::vector<PageSegment> segs = PageSegments(l);
  ASSERT_EQ(segs.size(), 6u);
  for (size_t i = 0; i < segs.size(); ++i) {
    EXPECT_EQ(segs[i].layer, i / 2);
    EXPECT_EQ(segs[i].buffer, i % 2);
    EXPECT_EQ(segs[i].object_offset, i * 4096);
  }
  std::vector<LayerObjectOffsets> offs = PageObjectOffsets(l);
  ASSERT_EQ(offs.size(), 3u);
  EXPECT_EQ(offs[1].k_offset, 2u * 4096);
  EXPECT_EQ(offs[1].v_offset, 3u * 4096);
  EXPECT_EQ(offs[1].v_bytes, 4096u);
}

TEST(KvLayoutTest, ValidMlaWithUnequalLayers) {
  KvLayout l;
  l.num_blocks = 8;
  l.regions.push_back({"/mla", 0, 8 * 1000 + 8 * 576});
  l.layers.push_back({{0, 0, 1000, 1000}, std::nullopt});
  l.layers.push_back({{0, 8000, 576, 576}, std::nullopt});
  ASSERT_TRUE(l.Validate().ok()) << l.Validate();
  EXPECT_TRUE(l.is_mla());
  EXPECT_EQ(l.PageObjectBytes(), 1576u);
  std::vector<LayerObjectOffsets> offs = PageObjectOffsets(l);
  EXPECT_EQ(offs[1].k_offset, 1000u);
  EXPECT_EQ(offs[1].v_bytes, 0u);
}

TEST(KvLayoutTest, InterleavedBlockMajorIsValid) {
  // Block b holds every layer's K and V side by side: buffers share one stride and interleave.
  KvLayout l;
  const uint32_t layers = 4;
  const uint64_t bpb = 256, stride = layers * 2 * bpb;
  l.num_blocks = 32;
  l.regions.push_back({"/pool", 0, stride * 32});
  for (uint32_t i = 0; i < layers; ++i) {
    l.layers.push_back(
        {{0, 2 * i * bpb, stride, bpb}, BufferLayout{0, (2 * i + 1) * bpb, stride, bpb}});
  }
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();
}

TEST(KvLayoutTest, CountsOutOfRange) {
  KvLayout l = MhaLayout(1, 4, 64);
  l.layers.clear();
  ExpectInvalid(l, "layers: count 0");
  l = MhaLayout(kMaxLayers + 1, 1, 64);
  ExpectInvalid(l, "layers: count 1025");
  l = MhaLayout(1, 4, 64);
  l.num_blocks = 0;
  ExpectInvalid(l, "num_blocks");
  l = MhaLayout(1, 4, 64);
  l.regions[0].handle.clear();
  ExpectInvalid(l, "regions[0].handle");
  l = MhaLayout(1, 4, 64);
  l.regions[0].size = 0;
  ExpectInvalid(l, "regions[0].size");
}

TEST(KvLayoutTest, BufferErrorsNameLayerAndField) {
  KvLayout l = MhaLayout(3, 4, 64);
  l.layers[2].v->region = 7;
  ExpectInvalid(l, "layers[2].v.region (7)");

  l = MhaLayout(3, 4, 64);
  l.layers[1].k.bytes_per_block = 0;
  ExpectInvalid(l, "layers[1].k.bytes_per_block is 0");

  l = MhaLayout(3, 4, 64);
  l.layers[1].v->bytes_per_block = 128;  // Stride stays 64: blocks would overlap.
  ExpectInvalid(l, "layers[1].v.bytes_per_block (128) exceeds layers[1].v.block_stride (64)");

  l = MhaLayout(3, 4, 64);
  l.layers[2].v->offset += 1;  // Last block one byte past the region.
  ExpectInvalid(l, "layers[2].v: block 3 ends past regions[2].size");

  l = MhaLayout(3, 4, 64);
  l.layers[0].k.offset = ~uint64_t{0} - 10;  // Would wrap in 64 bits.
  ExpectInvalid(l, "layers[0].k: block 3 ends past");

  l = MhaLayout(2, 4, 64);
  l.layers[1].v.reset();
  ExpectInvalid(l, "layers[1].v: absent");
}

TEST(KvLayoutTest, OverlappingBuffersRejected) {
  KvLayout l = MhaLayout(2, 4, 64);
  l.layers[0].v->offset = 64 * 3;  // V's block 0 is K's block 3.
  ExpectInvalid(l, "layers[0].v overlaps layers[0].k");

  // Same stride, interleaved but one byte too wide.
  l = KvLayout();
  l.num_blocks = 4;
  l.regions.push_back({"/p", 0, 4 * 128});
  l.layers.push_back({{0, 0, 128, 64}, BufferLayout{0, 63, 128, 64}});
  ExpectInvalid(l, "overlaps");
  l.layers[0].v->offset = 64;
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();

  // Two regions naming the same allocation are compared by absolute offset.
  l = MhaLayout(2, 4, 64);
  l.regions[1].handle = l.regions[0].handle;
  l.regions[1].offset = 64;  // Layer 1 starts inside layer 0's K.
  ExpectInvalid(l, "overlaps");
  l.regions[1].offset = 2 * 4 * 64;
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();

  // Different strides over the same bytes.
  l = KvLayout();
  l.num_blocks = 4;
  l.regions.push_back({"/p", 0, 4096});
  l.layers.push_back({{0, 0, 256, 64}, BufferLayout{0, 64, 128, 64}});
  ExpectInvalid(l, "different block strides");
}

TEST(KvLayoutTest, SameStrideDisjointAcrossBlockRange) {
  // B starts exactly where A's last block ends, with A's stride: A's block i+4 would be B's
  // block i, but A has only 4 blocks.
  KvLayout l;
  l.num_blocks = 4;
  l.regions.push_back({"/p", 0, 8 * 100});
  l.layers.push_back({{0, 0, 100, 100}, BufferLayout{0, 400, 100, 100}});
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();
  l.layers[0].v->offset = 399;
  ExpectInvalid(l, "overlaps");
}

// SGLang-like hybrid: the KV pool (group 0, 6 blocks) and a state pool (group 1, 3 slots), each
// its own allocation and its own block indices (one buffer per layer, as MLA lays them out).
KvLayout SeparatePools() {
  KvLayout l;
  l.num_blocks = 6;
  l.group_num_blocks = {6, 3};
  l.regions.push_back({"/kv", 0, 6 * 200});
  l.regions.push_back({"/state", 0, 3 * 40});
  l.layers.push_back({{0, 0, 200, 200}, std::nullopt, 0});
  l.layers.push_back({{1, 0, 40, 40}, std::nullopt, 1});
  return l;
}

TEST(KvLayoutTest, GroupsWithPoolsOfTheirOwnAreCheckedAgainstTheirOwnBlocks) {
  KvLayout l = SeparatePools();
  ASSERT_TRUE(l.Validate().ok()) << l.Validate();
  EXPECT_TRUE(l.separate_group_pools());
  EXPECT_EQ(l.GroupBlocks(0), 6u);
  EXPECT_EQ(l.GroupBlocks(1), 3u);
  // The state region holds 3 slots, not num_blocks (6): with one shared pool it is too small.
  KvLayout shared = l;
  shared.group_num_blocks.clear();
  ExpectInvalid(shared, "layers[1].k: block 5 ends past regions[1]");
  // One slot more than the region holds.
  KvLayout more = l;
  more.group_num_blocks = {6, 4};
  ExpectInvalid(more, "layers[1].k: block 3 ends past regions[1]");
}

TEST(KvLayoutTest, GroupPoolCountsAreRefusedNamingTheField) {
  KvLayout l = SeparatePools();
  l.group_num_blocks = {6};
  ExpectInvalid(l, "group_num_blocks: 1 entries for 2 groups");
  l.group_num_blocks = {6, 0};
  ExpectInvalid(l, "group_num_blocks[1] is 0");
  l.group_num_blocks = {5, 3};
  ExpectInvalid(l, "num_blocks (6) must be the largest group_num_blocks entry (5)");
  l.num_blocks = 0xFFFFFFFFu;
  l.group_num_blocks = {0xFFFFFFFFu, 3};
  ExpectInvalid(l, "more than 2^32 - 1");
}

TEST(KvLayoutTest, GroupsWithPoolsOfTheirOwnMayNotShareBytes) {
  // Both groups over one allocation: with one shared pool (vLLM) that is how groups alias; with
  // pools of their own both are in use at once, so the state slots may not meet the KV blocks.
  KvLayout l;
  l.num_blocks = 4;
  l.regions.push_back({"/one", 0, 8 * 100});
  l.layers.push_back({{0, 0, 100, 100}, std::nullopt, 0});
  l.layers.push_back({{0, 300, 100, 100}, std::nullopt, 1});
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();  // Shared pool: aliasing allowed.
  l.group_num_blocks = {4, 2};
  ExpectInvalid(l, "layers[1].k overlaps layers[0].k");
  // Right after the KV pool's last block: disjoint, though the same stride would reach it.
  l.layers[1].k.offset = 400;
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();
  // And a state pool ending just before the KV pool starts (KV after it in the allocation).
  l.layers[1].k.offset = 0;
  l.layers[0].k.offset = 200;
  EXPECT_TRUE(l.Validate().ok()) << l.Validate();
  l.layers[0].k.offset = 199;
  ExpectInvalid(l, "overlaps");
}

}  // namespace
}  // namespace kvcellar::core
