#include "core/eviction_policy.h"

#include "core/adaptive_policy.h"
#include "core/lru_policy.h"
#include "core/s3fifo_policy.h"

namespace kvcellar::core {

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind) {
  switch (kind) {
    case EvictionPolicyKind::kLru:
      return std::make_unique<LruPolicy>();
    case EvictionPolicyKind::kAdaptive:
      return std::make_unique<AdaptivePolicy>();
    case EvictionPolicyKind::kS3Fifo:
      break;
  }
  return std::make_unique<S3FifoPolicy>();
}

}  // namespace kvcellar::core
