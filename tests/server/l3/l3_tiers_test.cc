// Tests server/l3/l3_tiers.h: storage.tiers opened into backends in lookup order, with their
// names, admission thresholds and sharing; what fails at startup and what is only an L3 that is
// down.
#include "server/l3/l3_tiers.h"

#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvcellar::server {
namespace {

using storage::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<std::unique_ptr<L3Tiers>> Open(const std::string& tiers) {
  StorageConfig c = DefaultConfig().storage;
  c.tiers = tiers;
  return L3Tiers::Open(c);
}

TEST(L3TiersTest, NoTiersIsL2Only) {
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers = Open("");
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  EXPECT_TRUE((*tiers)->empty());
  EXPECT_EQ((*tiers)->size(), 0u);
  EXPECT_TRUE((*tiers)->names().empty());
  EXPECT_FALSE((*tiers)->any_admission());
  EXPECT_TRUE(L3Tiers::None()->empty());
}

TEST(L3TiersTest, TiersOpenInLookupOrderWithTheirSpecs) {
  TempDir fast;
  TempDir shared;
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers =
      Open(absl::StrCat("file:", fast.path(), "?name=nvme&io=threads; file:", shared.path(),
                        "?name=nfs&shared=true&admit_after=2&io=threads"));
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  L3Tiers& t = **tiers;
  ASSERT_EQ(t.size(), 2u);
  EXPECT_THAT(t.names(), ElementsAre("nvme", "nfs"));
  EXPECT_EQ(t.tier(0).spec.path, fast.path());
  EXPECT_FALSE(t.tier(0).shared);
  EXPECT_TRUE(t.tier(1).shared) << "other nodes write a shared directory";
  EXPECT_EQ(t.tier(1).spec.admit_after, 2u);
  EXPECT_TRUE(t.any_admission());
  ASSERT_NE(t.tier(0).backend, nullptr);
  EXPECT_EQ(t.tier(0).backend->capabilities().shared_across_nodes, false);
}

TEST(L3TiersTest, BackendsStoreObjectsInTheirOwnDirectories) {
  TempDir a;
  TempDir b;
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers = Open(
      absl::StrCat("file:", a.path(), "?name=a&io=threads;file:", b.path(), "?name=b&io=threads"));
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  const core::PageKey ns = storage::testing::TestNamespace();
  const core::PageKey key = storage::testing::TestKey(1);
  ASSERT_EQ(storage::testing::PutOne(*(*tiers)->tier(0).backend, ns, key, 0, 4096),
            storage::ObjectStatus::kOk);
  EXPECT_EQ(storage::testing::GetOne(*(*tiers)->tier(0).backend, ns, key, 0, 4096, 4096),
            storage::ObjectStatus::kOk);
  EXPECT_EQ(storage::testing::GetOne(*(*tiers)->tier(1).backend, ns, key, 0, 4096),
            storage::ObjectStatus::kNotFound);
}

TEST(L3TiersTest, BadSpecIsInvalidNamingTheConfigKey) {
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers = Open("tape:/dev/st0");
  EXPECT_EQ(tiers.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tiers.status().message(), HasSubstr("'storage.tiers' is invalid"));
}

TEST(L3TiersTest, UnusableDirectoryFailsNamingTheTier) {
  TempDir dir;
  const std::string file = dir.path() + "/not-a-directory";
  std::ofstream(file) << "x";
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers =
      Open(absl::StrCat("file:", file, "/l3?name=nvme&io=threads"));
  ASSERT_FALSE(tiers.ok());
  EXPECT_THAT(tiers.status().message(), HasSubstr("tier 'nvme' cannot be opened"));
}

TEST(L3TiersTest, UnreachableRedisIsADownTierNotAStartupError) {
  // Port 1 on loopback: nothing listens there.
  absl::StatusOr<std::unique_ptr<L3Tiers>> tiers = Open("redis:127.0.0.1:1?name=cache");
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  EXPECT_THAT((*tiers)->names(), ElementsAre("cache"));
  EXPECT_TRUE((*tiers)->tier(0).shared) << "a Redis server is there for every node";
}

}  // namespace
}  // namespace kvcellar::server
