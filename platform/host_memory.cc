// HostMemory: anonymous (hugetlb, THP or plain) and shared-memory mappings.
#include "platform/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcellar::platform {
namespace {

std::string Errno(int err) { return std::strerror(err); }

struct Mapping {
  uint8_t* base = nullptr;
  HugePageBacking backing = HugePageBacking::kNone;
};

// Private, not shared, anonymous memory: nothing else maps it (engines reach it through CUDA),
// and THP for private anonymous memory follows transparent_hugepage/enabled, whose common
// default "madvise" honours MADV_HUGEPAGE, while shared anonymous memory is shmem and follows
// shmem_enabled, which defaults to "never".
absl::StatusOr<Mapping> MapAnonymous(uint64_t bytes, HugePages mode) {
  const int prot = PROT_READ | PROT_WRITE;
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  Mapping m;
  if (mode != HugePages::kOff && bytes % HugePageBytes() == 0) {
    void* p = mmap(nullptr, bytes, prot, flags | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) {
      m.base = static_cast<uint8_t*>(p);
      m.backing = HugePageBacking::kHugetlb;
      return m;
    }
    if (mode == HugePages::kOn) {
      return absl::ResourceExhaustedError(absl::StrCat("huge_pages=on: mmap of ", bytes,
                                                       " bytes with MAP_HUGETLB failed (",
                                                       Errno(errno), "); ", HugetlbAdvice(bytes)));
    }
  } else if (mode == HugePages::kOn) {
    return absl::InvalidArgumentError(absl::StrCat("huge_pages=on: capacity ", bytes,
                                                   " is not a multiple of the huge page size ",
                                                   HugePageBytes()));
  }
  void* p = mmap(nullptr, bytes, prot, flags, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", bytes, " bytes of anonymous memory failed: ", Errno(errno)));
  }
  m.base = static_cast<uint8_t*>(p);
  if (mode == HugePages::kAuto && madvise(p, bytes, MADV_HUGEPAGE) == 0 &&
      ThpHonorsMadvise(ThpScope::kAnonymous)) {
    m.backing = HugePageBacking::kTransparent;
  }
  return m;
}

// Maps an opened shm object. On error the caller destroys `shm`, which removes an object that
// Open created.
absl::StatusOr<Mapping> MapShm(ShmObject& shm, uint64_t bytes, HugePages mode) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, shm.fd(), 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of shm object ", shm.name(), " (", bytes, " bytes): ", Errno(errno)));
  }
  Mapping m;
  m.base = static_cast<uint8_t*>(p);
  if (mode == HugePages::kAuto && madvise(p, bytes, MADV_HUGEPAGE) == 0 &&
      ThpHonorsMadvise(ThpScope::kShmem)) {
    m.backing = HugePageBacking::kTransparent;
  }
  return m;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostMemory>> HostMemory::Map(const HostMemoryOptions& options) {
  if (options.bytes == 0) return absl::InvalidArgumentError("host memory of 0 bytes");
  std::unique_ptr<HostMemory> memory(new HostMemory());
  absl::StatusOr<Mapping> mapping;
  if (options.shm_name.empty()) {
    mapping = MapAnonymous(options.bytes, options.huge_pages);
  } else {
    absl::StatusOr<std::string> name = ShmObject::NormalizeName(options.shm_name);
    if (!name.ok()) return name.status();
    if (options.huge_pages == HugePages::kOn) {
      return absl::InvalidArgumentError(
          "huge_pages=on needs an anonymous pool: a POSIX shm object lives on tmpfs, which cannot "
          "be hugetlb-backed; use huge_pages=auto (transparent huge pages, per "
          "transparent_hugepage/shmem_enabled) or drop shm_name");
    }
    absl::StatusOr<std::unique_ptr<ShmObject>> shm = ShmObject::Open(*name, options.bytes, options.recreate_on_size_change);
    if (!shm.ok()) return shm.status();
    memory->shm_ = *std::move(shm);
    mapping = MapShm(*memory->shm_, options.bytes, options.huge_pages);
    if (!mapping.ok() && memory->shm_->created()) memory->shm_->UnlinkOnDestroy();
  }
  if (!mapping.ok()) return mapping.status();
  memory->base_ = mapping->base;
  memory->size_ = options.bytes;
  memory->backing_ = mapping->backing;
  memory->page_bytes_ = mapping->backing == HugePageBacking::kHugetlb
                            ? HugePageBytes()
                            : static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (memory->shm_ != nullptr) {
    memory->shm_name_ = memory->shm_->name();
    if (options.unlink_on_destroy) memory->shm_->UnlinkOnDestroy();
  }
  return memory;
}

absl::Status HostMemory::UnlinkShm(absl::string_view shm_name) {
  return ShmObject::Unlink(shm_name);
}

HostMemory::~HostMemory() {
  if (base_ != nullptr) munmap(base_, size_);
  // shm_, destroyed next, removes the object if asked and only then drops its lock.
}

}  // namespace kvcellar::platform
