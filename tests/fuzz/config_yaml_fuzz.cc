// Fuzz target: the daemon's config file (YAML, server/config/config.h LoadConfig). An operator's
// file is trusted more than a client's bytes, but a typo must give an error naming the line, never
// a crash; and a file that loads must survive the canonical-YAML round trip.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/config/config.h"
#include "tests/fuzz/config_fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kvcellar::fuzz::MemoryConfigFile file;
  const std::string content(reinterpret_cast<const char*>(data), size);
  kvcellar::fuzz::CheckLoaded(kvcellar::server::LoadConfig(file.Write(content), {}), &file);
  return 0;
}
