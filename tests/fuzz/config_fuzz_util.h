// The config targets' shared half: a config file the daemon can open by path without touching the
// disk, and the round trip every loaded config must survive.
#ifndef KVCELLAR_TESTS_FUZZ_CONFIG_FUZZ_UTIL_H_
#define KVCELLAR_TESTS_FUZZ_CONFIG_FUZZ_UTIL_H_

#include <sys/mman.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcellar::fuzz {

// A memfd LoadConfig reads through /proc/self/fd/N, as it reads any file: one per process,
// rewritten for each input.
class MemoryConfigFile {
 public:
  MemoryConfigFile() : fd_(memfd_create("kvcellar-fuzz-config", MFD_CLOEXEC)) {
    FUZZ_CHECK(fd_ >= 0);
  }
  std::string Write(absl::string_view content) {
    FUZZ_CHECK(ftruncate(fd_, 0) == 0);
    FUZZ_CHECK(pwrite(fd_, content.data(), content.size(), 0) ==
               static_cast<ssize_t>(content.size()));
    return absl::StrCat("/proc/self/fd/", fd_);
  }

 private:
  int fd_;
};

// ConfigToYaml promises a text that loads back to the same config (config.h): checked on every
// config the fuzzer gets accepted.
inline void CheckRoundTrip(const server::Config& config, MemoryConfigFile* file) {
  const std::string yaml = server::ConfigToYaml(config, /*redact_secrets=*/false);
  absl::StatusOr<server::Config> again = server::LoadConfig(file->Write(yaml), {});
  if (!again.ok()) {
    std::fprintf(stderr, "canonical YAML does not load back: %s\n--- yaml\n%s\n",
                 std::string(again.status().message()).c_str(), yaml.c_str());
  }
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(server::ConfigToYaml(*again, false) == yaml);
  FUZZ_CHECK(server::ConfigDigest(*again) == server::ConfigDigest(config));
}

// What every config target checks of LoadConfig's answer: a refusal is INVALID_ARGUMENT with a
// message; an accepted config round-trips through its canonical YAML.
inline void CheckLoaded(const absl::StatusOr<server::Config>& config, MemoryConfigFile* file) {
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!config.status().message().empty());
    return;
  }
  CheckRoundTrip(*config, file);
}

}  // namespace kvcellar::fuzz

#endif  // KVCELLAR_TESTS_FUZZ_CONFIG_FUZZ_UTIL_H_
