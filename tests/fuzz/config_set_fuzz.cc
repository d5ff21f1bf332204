// Fuzz target: `kvcellard --set key=value` overrides (server/config/config.h LoadConfig), one per
// input line: the key lookup, each value syntax (sizes, durations, modes, choices, tier specs) and
// the checks across keys. Errors must name the override; a config that loads must survive the
// canonical-YAML round trip.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"
#include "tests/fuzz/config_fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kvcellar::fuzz::MemoryConfigFile file;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<std::string> overrides = absl::StrSplit(text, '\n');
  kvcellar::fuzz::CheckLoaded(kvcellar::server::LoadConfig(std::nullopt, overrides), &file);
  return 0;
}
