#include "storage/file_object_index.h"

#include <algorithm>
#include <list>
#include <optional>
#include <random>
#include <utility>

#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

FileObjectId Id(uint64_t i) { return FileObjectId{7, testing::TestKey(i), 0}; }

TEST(FileObjectIndexTest, UpsertReportsTheFootprintItReplaced) {
  FileObjectIndex index;
  EXPECT_EQ(index.UpsertHot(Id(1), 100), 0u);
  EXPECT_EQ(index.UpsertHot(Id(1), 300), 100u);
  EXPECT_EQ(index.size(), 1u);
  EXPECT_TRUE(index.Contains(Id(1)));
  EXPECT_FALSE(index.Contains(Id(2)));
}

TEST(FileObjectIndexTest, ShardAndNamespaceArePartOfTheIdentity) {
  FileObjectIndex index;
  FileObjectId a = Id(1);
  FileObjectId other_shard = a;
  other_shard.shard = 1;
  FileObjectId other_ns = a;
  other_ns.ns_prefix = 8;
  index.UpsertHot(a, 1);
  EXPECT_FALSE(index.Contains(other_shard));
  EXPECT_FALSE(index.Contains(other_ns));
}

TEST(FileObjectIndexTest, EvictionOrderIsColdToHot) {
  FileObjectIndex index;
  index.UpsertHot(Id(1), 1);
  index.UpsertHot(Id(2), 2);
  index.UpsertHot(Id(3), 3);
  EXPECT_TRUE(index.InsertCold(Id(0), 10));   // Colder than everything.
  EXPECT_FALSE(index.InsertCold(Id(2), 99));  // Present: nothing changes.
  index.Touch(Id(1));                         // Now the hottest.
  index.Touch(Id(42));                        // Absent: nothing.
  FileObjectId id;
  uint64_t bytes;
  std::vector<std::pair<FileObjectId, uint64_t>> order;
  while (index.PopColdest(&id, &bytes)) order.emplace_back(id, bytes);
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order[0], std::make_pair(Id(0), uint64_t{10}));
  EXPECT_EQ(order[1], std::make_pair(Id(2), uint64_t{2}));
  EXPECT_EQ(order[2], std::make_pair(Id(3), uint64_t{3}));
  EXPECT_EQ(order[3], std::make_pair(Id(1), uint64_t{1}));
  EXPECT_EQ(index.size(), 0u);
}

TEST(FileObjectIndexTest, RemoveReturnsTheFootprint) {
  FileObjectIndex index;
  index.UpsertHot(Id(1), 5);
  EXPECT_EQ(index.Remove(Id(1)), std::optional<uint64_t>(5));
  EXPECT_EQ(index.Remove(Id(1)), std::nullopt);
  FileObjectId id;
  uint64_t bytes;
  EXPECT_FALSE(index.PopColdest(&id, &bytes));
}

// Random operations against a plain list (front = hottest): same membership, footprints and
// eviction order.
TEST(FileObjectIndexTest, MatchesAListModel) {
  std::mt19937_64 rng(12345);
  FileObjectIndex index;
  std::list<std::pair<uint64_t, uint64_t>> model;  // (id, bytes), hottest first.
  auto find = [&](uint64_t i) {
    return std::find_if(model.begin(), model.end(), [i](const auto& e) { return e.first == i; });
  };
  for (int step = 0; step < 20000; ++step) {
    const uint64_t i = rng() % 64;
    const uint64_t bytes = rng() % 1000;
    switch (rng() % 5) {
      case 0: {
        auto it = find(i);
        const uint64_t old = it == model.end() ? 0 : it->second;
        if (it != model.end()) model.erase(it);
        model.emplace_front(i, bytes);
        ASSERT_EQ(index.UpsertHot(Id(i), bytes), old);
        break;
      }
      case 1: {
        const bool absent = find(i) == model.end();
        if (absent) model.emplace_back(i, bytes);
        ASSERT_EQ(index.InsertCold(Id(i), bytes), absent);
        break;
      }
      case 2: {
        auto it = find(i);
        if (it != model.end()) model.splice(model.begin(), model, it);
        index.Touch(Id(i));
        break;
      }
      case 3: {
        auto it = find(i);
        std::optional<uint64_t> want;
        if (it != model.end()) {
          want = it->second;
          model.erase(it);
        }
        ASSERT_EQ(index.Remove(Id(i)), want);
        break;
      }
      case 4: {
        FileObjectId id;
        uint64_t b;
        const bool got = index.PopColdest(&id, &b);
        ASSERT_EQ(got, !model.empty());
        if (got) {
          ASSERT_EQ(id, Id(model.back().first));
          ASSERT_EQ(b, model.back().second);
          model.pop_back();
        }
        break;
      }
    }
    ASSERT_EQ(index.size(), model.size());
  }
}

}  // namespace
}  // namespace kvcellar::storage
