#include "client/tools/bench/model_shape.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/host_pool.h"

namespace kvcellar::bench {

uint64_t SlotBytes(uint64_t object_bytes) {
  static const std::vector<uint64_t> kSlots =
      core::HostPool::DefaultSlotSizes(core::kDefaultRegionBytes);
  auto it = std::lower_bound(kSlots.begin(), kSlots.end(), object_bytes);
  return it == kSlots.end() ? object_bytes : *it;
}

uint32_t ModelShape::DtypeBytes() const {
  if (dtype == "fp32") return 4;
  if (dtype == "fp16" || dtype == "bf16") return 2;
  if (dtype == "fp8_e4m3" || dtype == "fp8_e5m2" || dtype == "int8") return 1;
  return 0;
}

absl::Status ModelShape::Validate() const {
  if (DtypeBytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dtype: '", dtype, "' is not one of fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8"));
  }
  if (!mla() && kv_heads % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-heads: ", kv_heads,
                                                   " heads do not split over --tp ", tp,
                                                   " ranks (must be a multiple of it)"));
  }
  return absl::OkStatus();
}

uint64_t ModelShape::BlockBytes() const {
  const uint64_t per_token = mla() ? mla_latent : uint64_t{kv_heads / tp} * head_dim;
  return per_token * DtypeBytes() * page_size;
}

uint64_t ModelShape::L2BytesPerPage() const {
  return uint64_t{shards()} * SlotBytes(ObjectBytes());
}

uint64_t ModelShape::BytesPerToken() const {
  const uint64_t elems = mla() ? mla_latent : 2 * uint64_t{kv_heads} * head_dim;
  return elems * DtypeBytes() * layers;
}

std::string ModelShape::Describe() const {
  if (mla()) {
    return absl::StrCat(layers, " layers, MLA latent ", mla_latent, ", ", dtype, ", page ",
                        page_size, " tokens, TP ", tp);
  }
  return absl::StrCat(layers, " layers, ", kv_heads, " KV heads x ", head_dim, ", ", dtype,
                      ", page ", page_size, " tokens, TP ", tp);
}

}  // namespace kvcellar::bench
