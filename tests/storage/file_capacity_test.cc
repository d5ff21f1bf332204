#include "storage/file_capacity.h"

#include "gtest/gtest.h"
#include "storage_test_util.h"

namespace kvcellar::storage {
namespace {

FileObjectId Id(uint64_t i) { return FileObjectId{1, testing::TestKey(i), 0}; }

uint64_t Evicted(const StatsCounters& stats) {
  BackendStats s;
  stats.Snapshot(&s);
  return s.evicted_objects;
}

TEST(FileCapacityTest, WritesReserveThenLand) {
  StatsCounters stats;
  FileCapacity cap(100, /*shared=*/false, &stats);
  FileVictims victims;
  ASSERT_TRUE(cap.Reserve(40, &victims));
  EXPECT_EQ(cap.used_bytes(), 0u);  // Reserved is not used yet.
  cap.Written(Id(1), 40);
  EXPECT_EQ(cap.used_bytes(), 40u);
  EXPECT_TRUE(cap.Knows(Id(1)));
  EXPECT_EQ(cap.objects(), 1u);
  // Overwrite of the same object: its footprint is replaced, not added.
  ASSERT_TRUE(cap.Reserve(50, &victims));
  cap.Written(Id(1), 50);
  EXPECT_EQ(cap.used_bytes(), 50u);
  EXPECT_TRUE(victims.empty());
}

TEST(FileCapacityTest, AWriteEvictsTheColdestUntilItFits) {
  StatsCounters stats;
  FileCapacity cap(100, false, &stats);
  FileVictims victims;
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(cap.Reserve(30, &victims));
    cap.Written(Id(i), 30);
  }
  FileVictims none;
  cap.Read(Id(0), 30, &none);  // Not authoritative yet: 0 is learned again, now the hottest.
  ASSERT_TRUE(cap.Reserve(50, &victims));
  ASSERT_EQ(victims.size(), 2u);
  EXPECT_EQ(victims[0], Id(1));
  EXPECT_EQ(victims[1], Id(2));
  EXPECT_EQ(cap.used_bytes(), 30u);
  EXPECT_EQ(Evicted(stats), 2u);
}

TEST(FileCapacityTest, RefusesWhatCannotFit) {
  StatsCounters stats;
  FileCapacity cap(100, false, &stats);
  FileVictims victims;
  EXPECT_FALSE(cap.Reserve(101, &victims));  // Larger than the tier.
  ASSERT_TRUE(cap.Reserve(80, &victims));    // In flight: not evictable.
  EXPECT_FALSE(cap.Reserve(30, &victims));
  cap.Unreserve(80);
  EXPECT_TRUE(cap.Reserve(30, &victims));
  EXPECT_TRUE(victims.empty());
}

TEST(FileCapacityTest, ZeroCapacityIsUnlimited) {
  StatsCounters stats;
  FileCapacity cap(0, false, &stats);
  FileVictims victims;
  EXPECT_TRUE(cap.Reserve(uint64_t{1} << 50, &victims));
  EXPECT_TRUE(victims.empty());
}

TEST(FileCapacityTest, AuthoritativeOnlyOnceTheScanIsMergedAndNeverWhenShared) {
  StatsCounters stats;
  FileCapacity priv(0, false, &stats);
  FileCapacity shared(0, true, &stats);
  FileVictims victims;
  EXPECT_FALSE(priv.Authoritative());
  priv.CompleteScan(&victims);
  shared.CompleteScan(&victims);
  EXPECT_TRUE(priv.complete());
  EXPECT_TRUE(priv.Authoritative());
  EXPECT_TRUE(shared.complete());
  EXPECT_FALSE(shared.Authoritative());
}

TEST(FileCapacityTest, AReadLearnsOnlyWhileTheIndexIsNotAuthoritative) {
  StatsCounters stats;
  FileCapacity cap(0, false, &stats);
  FileVictims victims;
  cap.Read(Id(1), 10, &victims);
  EXPECT_TRUE(cap.Knows(Id(1)));
  EXPECT_EQ(cap.used_bytes(), 10u);
  cap.CompleteScan(&victims);
  cap.Read(Id(2), 10, &victims);  // Absent from a complete index: deleted meanwhile, kept out.
  EXPECT_FALSE(cap.Knows(Id(2)));
  EXPECT_EQ(cap.used_bytes(), 10u);
}

TEST(FileCapacityTest, TheScanDoesNotReaddWhatWentOrWasRewritten) {
  StatsCounters stats;
  FileCapacity cap(0, false, &stats);
  FileVictims victims;
  cap.Read(Id(1), 10, &victims);
  cap.Forget(Id(1));  // Removed while the scan runs.
  ASSERT_TRUE(cap.Reserve(20, &victims));
  cap.Written(Id(2), 20);  // Written by this process: newer than what the scan saw.
  EXPECT_FALSE(cap.AddScanned(Id(1), 10));
  EXPECT_FALSE(cap.AddScanned(Id(2), 10));
  EXPECT_TRUE(cap.AddScanned(Id(3), 30));
  EXPECT_EQ(cap.used_bytes(), 50u);
  EXPECT_EQ(cap.objects(), 2u);
}

TEST(FileCapacityTest, CompletingTheScanEvictsOverCapacityOldestFirst) {
  StatsCounters stats;
  FileCapacity cap(50, false, &stats);
  FileVictims victims;
  // Newest first, as the backend merges them.
  ASSERT_TRUE(cap.AddScanned(Id(1), 20));
  ASSERT_TRUE(cap.AddScanned(Id(2), 20));
  ASSERT_TRUE(cap.AddScanned(Id(3), 20));
  cap.CompleteScan(&victims);
  ASSERT_EQ(victims.size(), 1u);
  EXPECT_EQ(victims[0], Id(3));
  EXPECT_EQ(cap.used_bytes(), 40u);
  // After the scan, removals are no longer remembered.
  cap.Forget(Id(1));
  EXPECT_TRUE(cap.AddScanned(Id(1), 5));
}

}  // namespace
}  // namespace kvcellar::storage
