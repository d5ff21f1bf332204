// EngineMemoryAccess through ShmMapping::Open, as the daemon opens an engine's memory: objects
// owned by another uid, /proc fd paths of another process, the daemon's own objects, and the
// links and renames that would make a name point elsewhere. The tests run as root (CI does), so
// ownership is set with fchown; without root they skip what needs it.
#include "platform/engine_memory_access.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/shm_mapping.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBytes = 8192;
// Uids no process of the test machine runs as.
constexpr uint32_t kOwnerUid = 42001;
constexpr uint32_t kOtherUid = 42002;

std::string DevShm(const std::string& name) { return absl::StrCat("/dev/shm", name); }

// An object of kBytes owned by `uid`, filled with `fill`.
class OwnedObject {
 public:
  OwnedObject(uint32_t uid, uint8_t fill) : name_(UniqueShmName("mem-access")) {
    absl::StatusOr<ShmMapping> m = ShmMapping::Create(name_, kBytes);
    EXPECT_TRUE(m.ok()) << m.status();
    memset(m->data(), fill, kBytes);
    EXPECT_EQ(chown(DevShm(name_).c_str(), uid, uid), 0) << strerror(errno);
    mapping_ = *std::move(m);
  }
  const std::string& name() const { return name_; }
  const uint8_t* data() const { return mapping_.data(); }

 private:
  std::string name_;
  ShmMapping mapping_;
};

bool AllBytes(const uint8_t* p, uint64_t n, uint8_t v) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != v) return false;
  }
  return true;
}

class EngineMemoryAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to give objects to other uids";
  }
};

TEST_F(EngineMemoryAccessTest, AnObjectOfThePeersOwnUidIsMapped) {
  OwnedObject own(kOwnerUid, 0x5a);
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(own.name(), kBytes, EngineMemoryAccess::ForPeer(kOwnerUid, getpid()));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(AllBytes(m->data(), kBytes, 0x5a));
}

TEST_F(EngineMemoryAccessTest, AnObjectOfAnotherUidIsRefusedAndMarked) {
  OwnedObject victim(kOwnerUid, 0x11);
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(victim.name(), kBytes, EngineMemoryAccess::ForPeer(kOtherUid, getpid()));
  ASSERT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied) << m.status();
  EXPECT_TRUE(IsMemoryRefusal(m.status()));
  EXPECT_THAT(m.status().message(), HasSubstr(absl::StrCat("owned by uid ", kOwnerUid)));
  EXPECT_THAT(m.status().message(), HasSubstr(absl::StrCat("(uid ", kOtherUid, ")")));
  // Unchecked (an engine opening its own memory) maps it: the check is the access, not Open.
  EXPECT_TRUE(ShmMapping::Open(victim.name(), kBytes).ok());
  // Mode does not matter: a world-writable object of another uid is still not the peer's.
  ASSERT_EQ(chmod(DevShm(victim.name()).c_str(), 0666), 0);
  EXPECT_TRUE(IsMemoryRefusal(
      ShmMapping::Open(victim.name(), kBytes, EngineMemoryAccess::ForPeer(kOtherUid, getpid()))
          .status()));
  EXPECT_TRUE(AllBytes(victim.data(), kBytes, 0x11));
}

TEST_F(EngineMemoryAccessTest, AHardLinkIsJudgedByTheObjectItLeadsTo) {
  OwnedObject victim(kOwnerUid, 0x22);
  const std::string link = UniqueShmName("mem-access-link");
  ASSERT_EQ(::link(DevShm(victim.name()).c_str(), DevShm(link).c_str()), 0) << strerror(errno);
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(link, kBytes, EngineMemoryAccess::ForPeer(kOtherUid, getpid()));
  EXPECT_TRUE(IsMemoryRefusal(m.status())) << m.status();
  unlink(DevShm(link).c_str());
}

TEST_F(EngineMemoryAccessTest, ASymlinkIsNeverFollowed) {
  OwnedObject victim(kOwnerUid, 0x33);
  const std::string link = UniqueShmName("mem-access-sym");
  ASSERT_EQ(symlink(DevShm(victim.name()).c_str(), DevShm(link).c_str()), 0) << strerror(errno);
  // Even the victim's own uid gets no mapping through a symlink (shm_open's O_NOFOLLOW).
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(link, kBytes, EngineMemoryAccess::ForPeer(kOwnerUid, getpid()));
  EXPECT_TRUE(IsMemoryRefusal(m.status())) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("symbolic link"));
  m = ShmMapping::Open(link, kBytes, EngineMemoryAccess::ForPeer(kOtherUid, getpid()));
  EXPECT_TRUE(IsMemoryRefusal(m.status())) << m.status();
  unlink(DevShm(link).c_str());
}

TEST_F(EngineMemoryAccessTest, AProcPathMustNameThePeersOwnProcess) {
  const int fd = memfd_create("kvc-mem-access", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  ASSERT_EQ(fchown(fd, kOwnerUid, kOwnerUid), 0);
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  // The peer is this process and owns the memfd: mapped.
  EXPECT_TRUE(
      ShmMapping::Open(path, kBytes, EngineMemoryAccess::ForPeer(kOwnerUid, getpid())).ok());
  // Another peer (pid) naming this process's fd: refused before anything is opened.
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(path, kBytes, EngineMemoryAccess::ForPeer(kOwnerUid, getpid() + 1));
  EXPECT_TRUE(IsMemoryRefusal(m.status())) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("own process"));
  // A peer whose pid the daemon cannot see names no /proc path at all.
  EXPECT_TRUE(IsMemoryRefusal(
      ShmMapping::Open(path, kBytes, EngineMemoryAccess::ForPeer(kOwnerUid, 0)).status()));
  // Its own pid, but an fd of another user's object (opened read-only, say): refused.
  EXPECT_TRUE(IsMemoryRefusal(
      ShmMapping::Open(path, kBytes, EngineMemoryAccess::ForPeer(kOtherUid, getpid())).status()));
  close(fd);
}

TEST_F(EngineMemoryAccessTest, TheDaemonsOwnObjectsAreRefusedToEveryone) {
  OwnedObject pool(getuid(), 0x44);
  const int fd = shm_open(pool.name().c_str(), O_RDONLY | O_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  absl::StatusOr<FileId> id = FileId::OfFd(fd);
  close(fd);
  ASSERT_TRUE(id.ok());
  const std::vector<DaemonObject> daemon = {{*id, "the daemon's L2 pool"}};
  // A peer of the daemon's own uid, and an unchecked (TCP, trusted) peer alike.
  for (EngineMemoryAccess access :
       {EngineMemoryAccess::ForPeer(getuid(), getpid()), EngineMemoryAccess::Unchecked()}) {
    absl::StatusOr<ShmMapping> m = ShmMapping::Open(pool.name(), kBytes, access.Forbid(daemon));
    ASSERT_TRUE(IsMemoryRefusal(m.status())) << m.status();
    EXPECT_THAT(m.status().message(), HasSubstr("the daemon's L2 pool"));
  }
  // Through a hard link too.
  const std::string link = UniqueShmName("mem-access-pool-link");
  ASSERT_EQ(::link(DevShm(pool.name()).c_str(), DevShm(link).c_str()), 0);
  EXPECT_TRUE(IsMemoryRefusal(
      ShmMapping::Open(link, kBytes, EngineMemoryAccess::Unchecked().Forbid(daemon)).status()));
  unlink(DevShm(link).c_str());
}

TEST_F(EngineMemoryAccessTest, AnObjectReplacedUnderItsNameIsJudgedAsOpened) {
  // The engine names its own object, then swaps another uid's object in under that name before
  // the daemon opens it: the daemon sees the swapped-in object and refuses it.
  OwnedObject own(kOtherUid, 0x55);
  OwnedObject victim(kOwnerUid, 0x66);
  const std::string victim_link = UniqueShmName("mem-access-swap");
  ASSERT_EQ(::link(DevShm(victim.name()).c_str(), DevShm(victim_link).c_str()), 0);
  const EngineMemoryAccess access = EngineMemoryAccess::ForPeer(kOtherUid, getpid());
  EXPECT_TRUE(ShmMapping::Open(own.name(), kBytes, access).ok());
  ASSERT_EQ(rename(DevShm(victim_link).c_str(), DevShm(own.name()).c_str()), 0);
  EXPECT_TRUE(IsMemoryRefusal(ShmMapping::Open(own.name(), kBytes, access).status()));
  EXPECT_TRUE(AllBytes(victim.data(), kBytes, 0x66));
}

TEST(ShmMappingMode, CreateSetsTheModeWhateverTheUmask) {
  const mode_t old = umask(077);
  const std::string name = UniqueShmName("mem-access-mode");
  absl::StatusOr<ShmMapping> m = ShmMapping::Create(name, kBytes, 0660);
  umask(old);
  ASSERT_TRUE(m.ok()) << m.status();
  struct stat st;
  ASSERT_EQ(stat(DevShm(name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
}

TEST(WithPrefix, KeepsCodeAndRefusalMark) {
  const absl::Status refused =
      ShmMapping::Open("/kvc-no-such-object", kBytes, EngineMemoryAccess::ForPeer(1, 1)).status();
  EXPECT_FALSE(IsMemoryRefusal(refused));  // Missing is NOT_FOUND, not a refusal.
  absl::Status s = absl::PermissionDeniedError("x");
  s.SetPayload(kMemoryRefusalPayload, absl::Cord("1"));
  const absl::Status wrapped = WithPrefix(s, "regions[2]: ");
  EXPECT_EQ(wrapped.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(wrapped.message(), "regions[2]: x");
  EXPECT_TRUE(IsMemoryRefusal(wrapped));
}

}  // namespace
}  // namespace kvcellar::platform
