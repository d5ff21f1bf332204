// Huge pages: policy names, and the kernel's settings read from /proc/meminfo and sysfs.
#include "platform/huge_pages.h"

#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvcellar::platform {
namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
// Linux's huge page size on x86-64 and most arm64 kernels, used when /proc/meminfo cannot be read.
constexpr uint64_t kFallbackHugePageBytes = 2 * (uint64_t{1} << 20);

// A field of /proc/meminfo (e.g. "HugePages_Free"), with "kB" values converted to bytes.
std::optional<uint64_t> MeminfoValue(absl::string_view field) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > field.size() &&
        line.compare(0, field.size(), field.data(), field.size()) == 0 &&
        line[field.size()] == ':') {
      std::istringstream rest(line.substr(field.size() + 1));
      uint64_t v = 0;
      std::string unit;
      if (!(rest >> v)) return std::nullopt;
      rest >> unit;
      return unit == "kB" ? v * kKiB : v;
    }
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<HugePages> ParseHugePages(absl::string_view name) {
  if (name == "off") return HugePages::kOff;
  if (name == "auto") return HugePages::kAuto;
  if (name == "on") return HugePages::kOn;
  return absl::InvalidArgumentError(
      absl::StrCat("huge_pages \"", name, "\" is not one of off, auto, on"));
}

absl::string_view HugePagesName(HugePages mode) {
  switch (mode) {
    case HugePages::kOff:
      return "off";
    case HugePages::kAuto:
      return "auto";
    case HugePages::kOn:
      return "on";
  }
  return "unknown";
}

absl::string_view HugePageBackingName(HugePageBacking backing) {
  switch (backing) {
    case HugePageBacking::kNone:
      return "none";
    case HugePageBacking::kHugetlb:
      return "hugetlb";
    case HugePageBacking::kTransparent:
      return "transparent";
  }
  return "unknown";
}

uint64_t HugePageBytes() { return MeminfoValue("Hugepagesize").value_or(kFallbackHugePageBytes); }

std::string HugetlbAdvice(uint64_t bytes) {
  const uint64_t page = HugePageBytes();
  return absl::StrCat("HugePages_Total=", MeminfoValue("HugePages_Total").value_or(0),
                      " HugePages_Free=", MeminfoValue("HugePages_Free").value_or(0),
                      " Hugepagesize=", page / kKiB, "kB; the pool needs ",
                      (bytes + page - 1) / page,
                      " free huge pages (sysctl vm.nr_hugepages), or use huge_pages=auto");
}

bool ThpHonorsMadvise(ThpScope scope) {
  std::ifstream in(scope == ThpScope::kAnonymous
                       ? "/sys/kernel/mm/transparent_hugepage/enabled"
                       : "/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text;
  std::getline(in, text);
  const size_t open = text.find('[');
  const size_t close = text.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return false;
  const std::string mode = text.substr(open + 1, close - open - 1);
  return mode != "never" && mode != "deny";
}

}  // namespace kvcellar::platform
