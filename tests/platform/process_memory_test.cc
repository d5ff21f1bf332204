// ProcessMemory against a real engine process (a forked child holding a buffer): whose memory may
// be reached, copies both ways, unmapped ranges, and a process that has exited.
#include "platform/process_memory.h"

#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::platform {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBytes = 1 << 20;

// A child process with kBytes of its own memory filled with i % 251; it exits when told to.
class EngineChild {
 public:
  EngineChild() {
    int to_parent[2], to_child[2];
    EXPECT_EQ(pipe(to_parent), 0);
    EXPECT_EQ(pipe(to_child), 0);
    buffer_ = static_cast<uint8_t*>(
        mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    pid_ = fork();
    if (pid_ == 0) {
      // The child's private copy of the mapping is "its own memory" at the same address.
      for (size_t i = 0; i < kBytes; ++i) buffer_[i] = static_cast<uint8_t>(i % 251);
      char c = 1;
      (void)!write(to_parent[1], &c, 1);
      (void)!read(to_child[0], &c, 1);
      _exit(0);
    }
    close(to_parent[1]);
    close(to_child[0]);
    char c;
    EXPECT_EQ(read(to_parent[0], &c, 1), 1);
    close(to_parent[0]);
    release_ = to_child[1];
    // The parent's copy is different, so a read that went to the wrong process shows.
    memset(buffer_, 0xEE, kBytes);
  }
  ~EngineChild() {
    Exit();
    munmap(buffer_, kBytes);
  }

  void Exit() {
    if (release_ < 0) return;
    char c = 0;
    (void)!write(release_, &c, 1);
    close(release_);
    release_ = -1;
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  pid_t pid() const { return pid_; }
  uint64_t address() const { return reinterpret_cast<uintptr_t>(buffer_); }
  std::string name() const { return "/proc/" + std::to_string(pid_) + "/mem"; }

 private:
  uint8_t* buffer_ = nullptr;
  pid_t pid_ = 0;
  int release_ = -1;
};

// The child's whole buffer, opened as the daemon does for the child's own registration.
absl::StatusOr<ProcessMemory> OpenAsItsEngine(const EngineChild& child) {
  const ProcessMemory::Range range{child.address(), kBytes};
  return ProcessMemory::Open(child.name(), EngineMemoryAccess::ForPeer(getuid(), child.pid()),
                             {&range, 1});
}

TEST(ProcessMemoryTest, ParsesOnlyProcPidMem) {
  EXPECT_EQ(ParseProcessMemoryName("/proc/4242/mem"), 4242);
  for (const char* bad :
       {"/proc/self/mem", "/proc/0/mem", "/proc/042/mem", "/proc/-1/mem", "/proc/4242/mem/",
        "/proc/4242/fd/3", "/proc//mem", "proc/1/mem", "/proc/99999999999/mem", "/kvc-sim"}) {
    EXPECT_FALSE(ParseProcessMemoryName(bad).has_value()) << bad;
  }
}

TEST(ProcessMemoryTest, ReachesOnlyTheRegisteringEnginesOwnProcess) {
  EngineChild child;
  const ProcessMemory::Range range{child.address(), kBytes};
  // Another process than the peer, the daemon itself, and a peer whose pid is unknown (TCP).
  EngineChild other;
  for (const auto& [access, name] :
       {std::pair{EngineMemoryAccess::ForPeer(getuid(), other.pid()), child.name()},
        std::pair{EngineMemoryAccess::ForPeer(getuid(), getpid()),
                  "/proc/" + std::to_string(getpid()) + "/mem"},
        std::pair{EngineMemoryAccess::ForPeer(getuid(), 0), child.name()},
        std::pair{EngineMemoryAccess::Unchecked(), child.name()}}) {
    absl::StatusOr<ProcessMemory> m = ProcessMemory::Open(name, access, {&range, 1});
    EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied) << name;
    EXPECT_TRUE(IsMemoryRefusal(m.status())) << m.status();
  }
  EXPECT_EQ(
      ProcessMemory::Open("/kvc-x", EngineMemoryAccess::Unchecked(), {&range, 1}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(ProcessMemoryTest, ReadsAndWritesTheEnginesBytes) {
  EngineChild child;
  absl::StatusOr<ProcessMemory> m = OpenAsItsEngine(child);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->alive());
  // Many short runs in one call, more than IOV_MAX: scattered 100-byte runs.
  constexpr size_t kRuns = 3000;
  std::vector<uint8_t> got(kRuns * 100);
  std::vector<iovec> local(kRuns), remote(kRuns);
  for (size_t i = 0; i < kRuns; ++i) {
    local[i] = {got.data() + i * 100, 100};
    remote[i] = {reinterpret_cast<void*>(child.address() + i * 300), 100};
  }
  ASSERT_TRUE(m->Read(local, remote)) << strerror(errno);
  for (size_t i = 0; i < kRuns; ++i) {
    for (size_t b = 0; b < 100; ++b) {
      ASSERT_EQ(got[i * 100 + b], static_cast<uint8_t>((i * 300 + b) % 251)) << i << " " << b;
    }
  }
  std::vector<uint8_t> put(kRuns * 100, 0x5A);
  for (size_t i = 0; i < kRuns; ++i) local[i].iov_base = put.data() + i * 100;
  ASSERT_TRUE(m->Write(local, remote)) << strerror(errno);
  std::fill(got.begin(), got.end(), 0);
  for (size_t i = 0; i < kRuns; ++i) local[i].iov_base = got.data() + i * 100;
  ASSERT_TRUE(m->Read(local, remote));
  EXPECT_EQ(got, put);
}

TEST(ProcessMemoryTest, RangesTheEngineHasNotMappedAreRefusedAtOpen) {
  EngineChild child;
  const auto access = EngineMemoryAccess::ForPeer(getuid(), child.pid());
  // Runs past the end of the buffer into whatever follows (not mapped writable, or not at all).
  const ProcessMemory::Range ranges[] = {{child.address(), kBytes},
                                         {child.address() + kBytes - 4096, 1 << 30}};
  absl::StatusOr<ProcessMemory> m = ProcessMemory::Open(child.name(), access, ranges, "regions");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("regions[1]"));
  const ProcessMemory::Range unmapped{8192, 4096};
  m = ProcessMemory::Open(child.name(), access, {&unmapped, 1});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("ranges[0]"));
}

TEST(ProcessMemoryTest, AnExitedEngineIsNeverReachedAgain) {
  EngineChild child;
  absl::StatusOr<ProcessMemory> m = OpenAsItsEngine(child);
  ASSERT_TRUE(m.ok()) << m.status();
  child.Exit();
  EXPECT_FALSE(m->alive());
  uint8_t byte = 0;
  iovec local{&byte, 1};
  iovec remote{reinterpret_cast<void*>(child.address()), 1};
  EXPECT_FALSE(m->Read({&local, 1}, {&remote, 1}));
  EXPECT_EQ(errno, ESRCH);
  EXPECT_EQ(OpenAsItsEngine(child).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcellar::platform
