// Fuzz target: `storage.tiers`, the list of L3 tier specs (server/config/l3_tier_spec.h). An
// accepted list must be what the backends are built from without further checks: at most
// kMaxL3TierSpecs tiers with distinct valid names, a file tier an absolute path, a redis tier
// addresses the Redis backend parses (storage/redis_cluster.h ParseRedisAddress) to the same kind
// of socket the spec meant.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "server/config/l3_tier_spec.h"
#include "storage/redis_cluster.h"
#include "tests/fuzz/fuzz_util.h"

namespace server = kvcellar::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<server::L3TierSpec>> specs = server::ParseL3TierSpecs(text);
  if (!specs.ok()) {
    FUZZ_CHECK(specs.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(specs->size() <= server::kMaxL3TierSpecs);
  absl::flat_hash_set<std::string> names;
  for (const server::L3TierSpec& spec : *specs) {
    FUZZ_CHECK(!spec.name.empty() && spec.name.size() <= 32);
    FUZZ_CHECK(names.insert(spec.name).second);
    if (spec.kind == server::L3TierSpec::Kind::kFile) {
      FUZZ_CHECK(absl::StartsWith(spec.path, "/"));
      FUZZ_CHECK(spec.addresses.empty());
      continue;
    }
    FUZZ_CHECK(!spec.addresses.empty());
    FUZZ_CHECK(spec.kind == server::L3TierSpec::Kind::kRedisCluster || spec.addresses.size() == 1);
    FUZZ_CHECK(!spec.key_prefix.empty());
    for (const std::string& address : spec.addresses) {
      absl::StatusOr<kvcellar::storage::RedisAddress> a =
          kvcellar::storage::ParseRedisAddress(address);
      FUZZ_CHECK(a.ok());
      FUZZ_CHECK(a->is_unix == absl::StartsWith(address, "unix:/"));
    }
  }
  return 0;
}
