// Huge pages as this kernel offers them: the policy a mapping asks for (HugePages), what it got
// (HugePageBacking), and the kernel settings that decide between them, read from /proc/meminfo
// and the transparent_hugepage files in sysfs.
//
// Kept apart from the mapping itself (platform/host_memory.h) because the settings are needed
// before anything is mapped: a caller checks its own sizes against HugePageBytes() first, and
// errors quote the reserved hugetlb pages (HugetlbAdvice).
//
// Threading: every function may be called from any thread; each reads the files afresh.
#ifndef KVCELLAR_PLATFORM_HUGE_PAGES_H_
#define KVCELLAR_PLATFORM_HUGE_PAGES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::platform {

// Huge-page policy for a mapping.
enum class HugePages {
  kOff,   // Plain 4 KiB pages; nothing is requested.
  kAuto,  // Anonymous memory tries MAP_HUGETLB, then falls back to madvise(MADV_HUGEPAGE) (THP).
          // Shared-memory objects (tmpfs) only madvise.
  kOn,    // MAP_HUGETLB or fail. Anonymous memory only (tmpfs objects cannot be hugetlb).
};
// "off", "auto", "on".
absl::StatusOr<HugePages> ParseHugePages(absl::string_view name);
absl::string_view HugePagesName(HugePages mode);

// What a mapping actually got.
enum class HugePageBacking {
  kNone,         // 4 KiB pages.
  kHugetlb,      // Reserved hugetlb pages (MAP_HUGETLB).
  kTransparent,  // madvise(MADV_HUGEPAGE) accepted and the kernel's THP mode allows it.
};
// "none", "hugetlb", "transparent".
absl::string_view HugePageBackingName(HugePageBacking backing);

// The hugetlb page size (/proc/meminfo Hugepagesize), or Linux's usual 2 MiB when it cannot be
// read.
uint64_t HugePageBytes();

// For an error about a failed MAP_HUGETLB of `bytes`: the reserved and free hugetlb pages, how
// many the mapping needs, and what to do about it (raise vm.nr_hugepages or use huge_pages=auto).
std::string HugetlbAdvice(uint64_t bytes);

// Which transparent-huge-page setting governs a mapping: private anonymous memory follows
// transparent_hugepage/enabled, shared memory (tmpfs, shm) follows transparent_hugepage/
// shmem_enabled.
enum class ThpScope { kAnonymous, kShmem };
// True when the kernel's THP mode for `scope` lets madvise(MADV_HUGEPAGE) take effect: the
// selected value, in brackets, is anything but "never" or "deny".
bool ThpHonorsMadvise(ThpScope scope);

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_HUGE_PAGES_H_
