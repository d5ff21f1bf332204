// Tests for platform/host_memory.h: anonymous memory, shared-memory re-attach, one live mapping
// per object, size changes, and the huge-page policy (what the host pool's memory gets from the
// kernel; the pool's own rules are tested in tests/core/host_pool_test.cc).
#include "platform/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;

HostMemoryOptions Options(uint64_t bytes, HugePages huge_pages = HugePages::kOff) {
  HostMemoryOptions o;
  o.bytes = bytes;
  o.huge_pages = huge_pages;
  return o;
}

std::unique_ptr<HostMemory> MustMap(const HostMemoryOptions& o) {
  absl::StatusOr<std::unique_ptr<HostMemory>> memory = HostMemory::Map(o);
  EXPECT_TRUE(memory.ok()) << memory.status();
  return memory.ok() ? *std::move(memory) : nullptr;
}

// A name unique to this process and test, so parallel ctest runs never share an object.
std::string ShmName(absl::string_view tag) {
  return absl::StrCat("kvcellar-test-", getpid(), "-", tag);
}

bool ShmExists(const std::string& name) {
  const int fd = shm_open(absl::StrCat("/", name).c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

uint64_t ConfiguredHugePages() {
  std::ifstream in("/proc/sys/vm/nr_hugepages");
  uint64_t n = 0;
  in >> n;
  return n;
}

// ---- Anonymous memory ---------------------------------------------------------------------------

TEST(HostMemoryTest, AnonymousMemoryIsZeroedWritableAndPlain) {
  std::unique_ptr<HostMemory> m = MustMap(Options(3 * kMiB));
  ASSERT_NE(m, nullptr);
  ASSERT_NE(m->data(), nullptr);
  EXPECT_EQ(m->size(), 3 * kMiB);
  EXPECT_EQ(m->bytes().data(), m->data());
  EXPECT_EQ(m->bytes().size(), 3 * kMiB);
  EXPECT_EQ(m->backing(), HugePageBacking::kNone);
  EXPECT_FALSE(m->reattached());
  EXPECT_EQ(m->shm_name(), "");
  EXPECT_EQ(m->page_bytes(), static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data()) % m->page_bytes(), 0u);
  EXPECT_TRUE(std::all_of(m->data(), m->data() + m->size(), [](uint8_t x) { return x == 0; }));
  m->data()[0] = 1;
  m->data()[m->size() - 1] = 1;
}

TEST(HostMemoryTest, RejectsBadOptions) {
  absl::StatusOr<std::unique_ptr<HostMemory>> m = HostMemory::Map(Options(0));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);

  HostMemoryOptions o = Options(4 * kMiB);
  o.shm_name = "a/b";
  m = HostMemory::Map(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("shm_name \"a/b\""));
}

// ---- Shared memory ------------------------------------------------------------------------------

TEST(HostMemoryTest, ShmMemoryReattachesTheSameBytes) {
  const std::string name = ShmName("reattach");
  HostMemoryOptions o = Options(4 * kMiB, HugePages::kAuto);
  o.shm_name = name;
  // (offset, value) of the bytes written before the first mapping goes away.
  std::vector<std::pair<uint64_t, uint8_t>> written;
  {
    std::unique_ptr<HostMemory> a = MustMap(o);
    ASSERT_NE(a, nullptr);
    EXPECT_FALSE(a->reattached());
    EXPECT_EQ(a->shm_name(), "/" + name);
    EXPECT_NE(a->backing(), HugePageBacking::kHugetlb);  // tmpfs is never hugetlb.
    for (int i = 0; i < 10; ++i) {
      const uint64_t offset = i * 256 * kKiB;
      const uint8_t v = static_cast<uint8_t>(0x40 + i);
      std::memset(a->data() + offset, v, 64 * kKiB);
      written.emplace_back(offset, v);
    }
  }  // Destroyed without unlinking.
  ASSERT_TRUE(ShmExists(name));

  o.unlink_on_destroy = true;
  {
    std::unique_ptr<HostMemory> b = MustMap(o);
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(b->reattached());
    for (const auto& [offset, v] : written) {
      const uint8_t* p = b->data() + offset;
      EXPECT_TRUE(std::all_of(p, p + 64 * kKiB, [v = v](uint8_t x) { return x == v; }))
          << "offset " << offset;
    }
  }
  EXPECT_FALSE(ShmExists(name));
}

TEST(HostMemoryTest, ShmObjectHasOneLiveMapping) {
  const std::string name = ShmName("inuse");
  HostMemoryOptions o = Options(2 * kMiB);
  o.shm_name = "/" + name;  // The leading slash is optional.
  o.unlink_on_destroy = true;
  std::unique_ptr<HostMemory> a = MustMap(o);
  ASSERT_NE(a, nullptr);
  absl::StatusOr<std::unique_ptr<HostMemory>> b = HostMemory::Map(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("in use by another live host pool"));
  EXPECT_TRUE(ShmExists(name)) << "a refused attach must not remove the live object";
  a.reset();
  EXPECT_FALSE(ShmExists(name));
}

TEST(HostMemoryTest, ShmSizeChangeIsRefused) {
  const std::string name = ShmName("geometry");
  HostMemoryOptions o = Options(2 * kMiB);
  o.shm_name = name;
  ASSERT_NE(MustMap(o), nullptr);
  o.bytes = 4 * kMiB;
  absl::StatusOr<std::unique_ptr<HostMemory>> b = HostMemory::Map(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("2097152 bytes but the pool wants 4194304"));
  EXPECT_TRUE(ShmExists(name)) << "a refused attach must not remove the object";
  EXPECT_TRUE(HostMemory::UnlinkShm(name).ok());
  EXPECT_EQ(HostMemory::UnlinkShm(name).code(), absl::StatusCode::kNotFound);
}

// The daemon's choice (pool.shm_name, docs/restart.md): a pool of another capacity starts empty
// at its new size instead of not starting; the old bytes are gone and the mapping says so.
TEST(HostMemoryTest, ShmSizeChangeRecreatesWhenAsked) {
  const std::string name = ShmName("recreate");
  HostMemoryOptions o = Options(2 * kMiB);
  o.shm_name = name;
  {
    std::unique_ptr<HostMemory> a = MustMap(o);
    ASSERT_NE(a, nullptr);
    std::memset(a->data(), 0x77, 64 * kKiB);
  }
  o.bytes = 4 * kMiB;
  o.recreate_on_size_change = true;
  o.unlink_on_destroy = true;
  {
    std::unique_ptr<HostMemory> b = MustMap(o);
    ASSERT_NE(b, nullptr);
    EXPECT_FALSE(b->reattached());
    EXPECT_EQ(b->previous_bytes(), 2 * kMiB);
    EXPECT_EQ(b->size(), 4 * kMiB);
    EXPECT_TRUE(std::all_of(b->data(), b->data() + 64 * kKiB, [](uint8_t x) { return x == 0; }));
  }
  EXPECT_FALSE(ShmExists(name));
  // And an object of the same size is re-attached as ever.
  o.unlink_on_destroy = false;
  ASSERT_NE(MustMap(o), nullptr);
  o.unlink_on_destroy = true;
  std::unique_ptr<HostMemory> c = MustMap(o);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->reattached());
  EXPECT_EQ(c->previous_bytes(), 0u);
}

// ---- Huge pages ---------------------------------------------------------------------------------

TEST(HostMemoryTest, HugePagesOnFailsClearlyWithoutHugetlbPages) {
  if (ConfiguredHugePages() != 0) GTEST_SKIP() << "hugetlb pages are configured on this host";
  HostMemoryOptions o = Options(8 * kMiB, HugePages::kOn);
  absl::StatusOr<std::unique_ptr<HostMemory>> m = HostMemory::Map(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(m.status().message(), HasSubstr("huge_pages=on"));
  EXPECT_THAT(m.status().message(), HasSubstr("MAP_HUGETLB"));
  EXPECT_THAT(m.status().message(), HasSubstr("vm.nr_hugepages"));

  // auto falls back and still works.
  o.huge_pages = HugePages::kAuto;
  std::unique_ptr<HostMemory> fallback = MustMap(o);
  ASSERT_NE(fallback, nullptr);
  EXPECT_NE(fallback->backing(), HugePageBacking::kHugetlb);
  EXPECT_EQ(fallback->page_bytes(), static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
}

TEST(HostMemoryTest, HugePagesOnRejectsShmAndPartialHugePages) {
  HostMemoryOptions o = Options(8 * kMiB, HugePages::kOn);
  o.shm_name = ShmName("huge");
  absl::StatusOr<std::unique_ptr<HostMemory>> m = HostMemory::Map(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("tmpfs"));
  EXPECT_FALSE(ShmExists(o.shm_name));

  o.shm_name.clear();
  o.bytes = HugePageBytes() + 4 * kKiB;
  m = HostMemory::Map(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("multiple of the huge page size"));
}

}  // namespace
}  // namespace kvcellar::platform
