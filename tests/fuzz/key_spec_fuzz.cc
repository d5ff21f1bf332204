// Fuzz target: the page-key spec (docs/keys.md) as the daemon applies it to a client's values:
// namespace fields (core/namespace_spec.h Validate, the canonical encoding, the digest), page keys
// as raw bytes and as hex (core/page_key.h FromBytes, FromHex), and the key chain over tokens.
//
// Checked: a namespace that validates encodes within its bounds and a refusal quotes a bounded
// prefix of the bad value; hex and raw keys round-trip; and the chain keeps the property engines
// rely on to extend a prefix they hold: keys [i, n) computed from k_{i-1} and the tokens after
// page i equal the full chain's, and a short output asks for a prefix.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/types/span.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "tests/fuzz/fuzz_util.h"

namespace core = kvcellar::core;

namespace {

void CheckKeyParsing(FuzzedDataProvider& in) {
  const std::string raw = in.ConsumeRandomLengthString(40);
  absl::StatusOr<core::PageKey> from_bytes = core::PageKey::FromBytes(raw);
  FUZZ_CHECK(from_bytes.ok() == (raw.size() == core::kPageKeyBytes));
  if (from_bytes.ok()) FUZZ_CHECK(from_bytes->AsBytes() == raw);

  const std::string hex = in.ConsumeRandomLengthString(70);
  absl::StatusOr<core::PageKey> from_hex = core::PageKey::FromHex(hex);
  if (from_hex.ok()) FUZZ_CHECK(from_hex->Hex() == absl::AsciiStrToLower(hex));
  if (from_bytes.ok()) FUZZ_CHECK(core::PageKey::FromHex(from_bytes->Hex()).value() == *from_bytes);
}

core::NamespaceSpec ConsumeSpec(FuzzedDataProvider& in) {
  core::NamespaceSpec spec;
  spec.tenant = in.ConsumeRandomLengthString(2048);
  spec.model_id = in.ConsumeRandomLengthString(2048);
  spec.model_revision = in.ConsumeRandomLengthString(2048);
  spec.kv_dtype = in.ConsumeRandomLengthString(2048);
  // Small page sizes most of the time, so that token lists fill pages.
  spec.page_size = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint32_t>(0, 8)
                                    : in.ConsumeIntegral<uint32_t>();
  spec.layout = static_cast<core::LayoutKind>(in.ConsumeIntegralInRange<uint32_t>(0, 2));
  spec.tp_size = in.ConsumeIntegral<uint32_t>();
  spec.opaque_keys = in.ConsumeBool();
  return spec;
}

void CheckChain(const core::NamespaceSpec& spec, FuzzedDataProvider& in) {
  const size_t n_tokens = in.ConsumeIntegralInRange<size_t>(0, 512);
  std::vector<uint32_t> tokens;
  for (size_t i = 0; i < n_tokens && in.remaining_bytes() > 0; ++i) {
    tokens.push_back(in.ConsumeIntegral<uint32_t>());
  }
  const core::PageKey root = spec.Digest();
  const std::vector<core::PageKey> keys = core::ComputePageKeys(root, tokens, spec.page_size);
  FUZZ_CHECK(keys.size() == core::FullPages(tokens.size(), spec.page_size));
  if (keys.empty()) return;

  const size_t i = in.ConsumeIntegralInRange<size_t>(1, keys.size());
  if (i < keys.size()) {
    const absl::Span<const uint32_t> rest = absl::MakeConstSpan(tokens).subspan(i * spec.page_size);
    const std::vector<core::PageKey> tail = core::ComputePageKeys(keys[i - 1], rest, spec.page_size);
    FUZZ_CHECK(tail == std::vector<core::PageKey>(keys.begin() + i, keys.end()));
  }
  std::vector<core::PageKey> prefix(i);
  FUZZ_CHECK(core::ComputePageKeys(root, tokens, spec.page_size, absl::MakeSpan(prefix)) == i);
  FUZZ_CHECK(prefix == std::vector<core::PageKey>(keys.begin(), keys.begin() + i));
  const absl::Span<const uint32_t> first =
      absl::MakeConstSpan(tokens).subspan(0, spec.page_size);
  FUZZ_CHECK(core::ChainPageKey(root, first) == keys[0]);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  CheckKeyParsing(in);
  const core::NamespaceSpec spec = ConsumeSpec(in);
  const absl::Status valid = spec.Validate();
  if (!valid.ok()) {
    FUZZ_CHECK(valid.code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(valid.message().size() <= kvcellar::fuzz::kMaxErrorMessageBytes);
    return 0;
  }
  FUZZ_CHECK(spec.page_size >= 1 && spec.page_size <= core::kMaxPageSize);
  FUZZ_CHECK(spec.tp_size >= 1 && spec.tp_size <= core::kMaxTpSize);
  // Nine fields: four length-prefixed strings of at most kMaxNamespaceStringBytes, the tag, and
  // four u32s.
  const std::string encoding = spec.CanonicalEncoding();
  FUZZ_CHECK(encoding.size() <= 4 + 14 + 4 * (4 + core::kMaxNamespaceStringBytes) + 4 * 4);
  if (!spec.opaque_keys) CheckChain(spec, in);
  return 0;
}
