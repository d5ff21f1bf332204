// ShmMapping's two kinds of name: POSIX shm objects, and an object another process holds open
// (a memfd, as SGLang's HiCache host pool is) named "/proc/<pid>/fd/<fd>". The engine side here is
// this test process: it creates the memfd and the mapping reopens it through /proc with this
// process's real pid, exactly as the daemon reopens an engine's.
#include "platform/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/sim_engine_memory.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

// A memfd of `bytes`, mapped in this process as an engine maps its host pool.
class Memfd {
 public:
  explicit Memfd(uint64_t bytes) : bytes_(bytes) {
    fd_ = memfd_create("kvc-shm-mapping-test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0) << strerror(errno);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0) << strerror(errno);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED) << strerror(errno);
    data_ = static_cast<uint8_t*>(p);
  }
  ~Memfd() {
    munmap(data_, bytes_);
    close(fd_);
  }
  Memfd(const Memfd&) = delete;
  Memfd& operator=(const Memfd&) = delete;

  // What the engine registers as MemoryRegion.sim_shm_name.
  std::string ProcPath() const { return absl::StrCat("/proc/", getpid(), "/fd/", fd_); }
  uint8_t* data() const { return data_; }
  int fd() const { return fd_; }

 private:
  uint64_t bytes_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;
};

TEST(ShmMappingTest, MemfdByProcPathSeesTheSameBytesBothWays) {
  constexpr uint64_t kBytes = 64 << 10;
  Memfd engine(kBytes);
  const std::string path = engine.ProcPath();
  ASSERT_TRUE(ShmMapping::IsProcFdPath(path)) << path;
  ASSERT_TRUE(ShmMapping::CheckName(path).ok());
  absl::StatusOr<ShmMapping> daemon = ShmMapping::Open(path, kBytes);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(daemon->size(), kBytes);
  EXPECT_EQ(daemon->name(), path);
  EXPECT_FALSE(daemon->owner());
  EXPECT_NE(daemon->data(), engine.data());  // A mapping of its own, of the same object.

  // Engine -> daemon, and daemon -> engine, at both ends of the object.
  for (uint64_t i = 0; i < kBytes; i += 4093) engine.data()[i] = static_cast<uint8_t>(i * 7 + 1);
  engine.data()[kBytes - 1] = 0xA5;
  for (uint64_t i = 0; i < kBytes; i += 4093) {
    ASSERT_EQ(daemon->data()[i], static_cast<uint8_t>(i * 7 + 1)) << i;
  }
  EXPECT_EQ(daemon->data()[kBytes - 1], 0xA5);
  std::memset(daemon->data() + 100, 0x3C, 1000);
  daemon->data()[kBytes - 2] = 0x5A;
  for (uint64_t i = 100; i < 1100; ++i) ASSERT_EQ(engine.data()[i], 0x3C) << i;
  EXPECT_EQ(engine.data()[kBytes - 2], 0x5A);

  // A prefix is enough; unmapping leaves the engine's memfd alone.
  absl::StatusOr<ShmMapping> prefix = ShmMapping::Open(path, 4096);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  EXPECT_EQ(prefix->data()[100], 0x3C);
  daemon->Reset();
  prefix->Reset();
  EXPECT_EQ(engine.data()[100], 0x3C);
  EXPECT_EQ(fcntl(engine.fd(), F_GETFD), FD_CLOEXEC);  // Still open.
}

TEST(ShmMappingTest, MalformedProcPathsAreInvalidArgument) {
  Memfd engine(4096);
  const std::string pid = absl::StrCat(getpid());
  const std::string fd = absl::StrCat(engine.fd());
  for (const std::string& name : {
           std::string("/proc/1/fd/x"),
           std::string("/proc/self/fd/3"),
           absl::StrCat("/proc/self/fd/", fd),
           absl::StrCat("/proc/thread-self/fd/", fd),
           absl::StrCat("/proc/", pid, "/fd/", fd, "/extra"),
           absl::StrCat("/proc/", pid, "/fd/", fd, "/"),
           absl::StrCat("/proc/", pid, "/task/", pid, "/fd/", fd),
           absl::StrCat("/proc/", pid, "/fdinfo/", fd),
           absl::StrCat("/proc/", pid, "/fd/"),
           absl::StrCat("/proc/", pid, "/fd"),
           absl::StrCat("/proc//fd/", fd),
           absl::StrCat("/proc/", pid, "//fd/", fd),
           absl::StrCat("/proc/+", pid, "/fd/", fd),
           absl::StrCat("/proc/0", pid, "/fd/", fd),
           absl::StrCat("/proc/", pid, "/fd/0", fd),
           absl::StrCat("/proc/", pid, "/fd/-", fd),
           absl::StrCat("/proc/", pid, "/fd/ ", fd),
           absl::StrCat("/proc/", pid, "/fd/99999999999"),
           std::string("/proc/1/fd/3\0", 13),
           std::string("/proc/"),
       }) {
    EXPECT_FALSE(ShmMapping::IsProcFdPath(name)) << name;
    absl::Status check = ShmMapping::CheckName(name);
    EXPECT_EQ(check.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(check.message()), HasSubstr("/proc/<pid>/fd/<fd>")) << name;
    absl::StatusOr<ShmMapping> m = ShmMapping::Open(name, 4096);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  // The accepted form, whether or not the process exists.
  for (const char* name : {"/proc/1/fd/0", "/proc/4194304/fd/17", "/proc/2147483647/fd/3"}) {
    EXPECT_TRUE(ShmMapping::IsProcFdPath(name)) << name;
    EXPECT_TRUE(ShmMapping::CheckName(name).ok()) << name;
  }
  // POSIX names are unchanged; "/proc" alone is one.
  EXPECT_TRUE(ShmMapping::CheckName("/kvc-sim-4242-rank0").ok());
  EXPECT_TRUE(ShmMapping::CheckName("/proc").ok());
  EXPECT_FALSE(ShmMapping::IsProcFdPath("/kvc-sim-4242-rank0"));
  EXPECT_EQ(ShmMapping::CheckName("/a/b").code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmMappingTest, MissingProcessOrFdIsNotFound) {
  Memfd engine(4096);
  // An fd this process does not have, and a pid above any pid_max (4194304 at most).
  for (const std::string& name : {absl::StrCat("/proc/", getpid(), "/fd/999999"),
                                  absl::StrCat("/proc/2147483647/fd/", engine.fd())}) {
    absl::StatusOr<ShmMapping> m = ShmMapping::Open(name, 4096);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << name << ": " << m.status();
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("no such process or fd")) << name;
  }
}

TEST(ShmMappingTest, MemfdSmallerThanDeclaredIsInvalidArgument) {
  Memfd engine(4096);
  absl::StatusOr<ShmMapping> m = ShmMapping::Open(engine.ProcPath(), 8192);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("fewer than the 8192 declared"));
}

TEST(ShmMappingTest, ProcPathToSomethingOtherThanSharedMemoryIsRefused) {
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  absl::StatusOr<ShmMapping> m =
      ShmMapping::Open(absl::StrCat("/proc/", getpid(), "/fd/", pipe_fds[0]), 4096);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("not shared memory"));
  close(pipe_fds[0]);
  close(pipe_fds[1]);

  // A regular file on a disk file system: the daemon would write engine pages into it.
  const std::string file = absl::StrCat(KVCELLAR_BIN_DIR, "/shm_mapping_test-", getpid());
  int fd = open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << file << ": " << strerror(errno);
  unlink(file.c_str());
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  struct statfs fs;
  ASSERT_EQ(fstatfs(fd, &fs), 0);
  m = ShmMapping::Open(absl::StrCat("/proc/", getpid(), "/fd/", fd), 4096);
  if (fs.f_type == 0x01021994 /* TMPFS_MAGIC */) {
    EXPECT_TRUE(m.ok()) << m.status();  // The build directory is on tmpfs: shared memory.
  } else {
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("not shared memory"));
  }
  close(fd);
}

TEST(ShmMappingTest, ProcPathOfAnotherUidIsPermissionDenied) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  Memfd engine(4096);
  const std::string path = engine.ProcPath();
  // The child, as nobody, is the daemon that does not run as the engine's uid.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
    absl::StatusOr<ShmMapping> m = ShmMapping::Open(path, 4096);
    if (m.ok()) _exit(101);
    if (!absl::StrContains(m.status().message(), "CAP_SYS_PTRACE")) _exit(102);
    _exit(static_cast<int>(m.status().code()));
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), static_cast<int>(absl::StatusCode::kPermissionDenied));
}

TEST(ShmMappingTest, CreateTakesOnlyPosixNames) {
  absl::StatusOr<ShmMapping> proc =
      ShmMapping::Create(absl::StrCat("/proc/", getpid(), "/fd/0"), 4096);
  EXPECT_EQ(proc.status().code(), absl::StatusCode::kInvalidArgument);

  const std::string name = UniqueShmName("shm-test");
  absl::StatusOr<ShmMapping> created = ShmMapping::Create(name, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->owner());
  created->data()[7] = 42;
  absl::StatusOr<ShmMapping> opened = ShmMapping::Open(name, 4096);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->data()[7], 42);
  EXPECT_EQ(ShmMapping::Open(name, 8192).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmMapping::Create(name, 4096).status().code(), absl::StatusCode::kAlreadyExists);
  created->Reset();  // Unlinks.
  EXPECT_EQ(ShmMapping::Open(name, 4096).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcellar::platform
