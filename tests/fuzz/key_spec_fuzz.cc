// Fuzz target: the page-key spec (docs/keys.md) as the daemon applies it to a client's values:
// namespace fields (core/namespace_spec.h ParseLayoutKind, Validate, the canonical encoding, the
// digest), page keys as raw bytes and as hex (core/page_key.h FromBytes, FromHex), and the key
// chain over tokens.
//
// Input, so that seeds are readable (tests/fuzz/make_corpus.py writes the golden vectors' cases):
// nine lines, tenant, model_id, model_revision, kv_dtype, page_size, layout, tp_size, opaque_keys
// (0 or 1) and a page key in hex; then a byte choosing where to split the chain, then the tokens
// as u32 little-endian.
//
// Checked: a namespace that validates encodes within its bounds and a refusal quotes a bounded
// prefix of the bad value; hex and raw keys round-trip; and the chain keeps the property engines
// rely on to extend a prefix they hold: keys [i, n) computed from k_{i-1} and the tokens after
// page i equal the full chain's, and a short output asks for a prefix.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "tests/fuzz/fuzz_util.h"

namespace core = kvcellar::core;

namespace {

void CheckKeyParsing(absl::string_view hex) {
  absl::StatusOr<core::PageKey> key = core::PageKey::FromHex(hex);
  if (!key.ok()) {
    FUZZ_CHECK(key.status().message().size() <= kvcellar::fuzz::kMaxErrorMessageBytes);
    return;
  }
  FUZZ_CHECK(key->Hex() == absl::AsciiStrToLower(hex));
  absl::StatusOr<core::PageKey> raw = core::PageKey::FromBytes(key->AsBytes());
  FUZZ_CHECK(raw.ok() && *raw == *key);
  FUZZ_CHECK(!core::PageKey::FromBytes(key->AsBytes().substr(1)).ok());
}

void CheckChain(const core::NamespaceSpec& spec, uint8_t split, absl::string_view token_bytes) {
  std::vector<uint32_t> tokens(token_bytes.size() / sizeof(uint32_t));
  for (size_t i = 0; i < tokens.size(); ++i) {  // u32 little-endian, as on x86.
    std::memcpy(&tokens[i], token_bytes.data() + i * sizeof(uint32_t), sizeof(uint32_t));
  }
  const core::PageKey root = spec.Digest();
  const std::vector<core::PageKey> keys = core::ComputePageKeys(root, tokens, spec.page_size);
  FUZZ_CHECK(keys.size() == core::FullPages(tokens.size(), spec.page_size));
  if (keys.empty()) return;

  const size_t i = 1 + split % keys.size();
  if (i < keys.size()) {
    const auto rest = absl::MakeConstSpan(tokens).subspan(i * spec.page_size);
    const std::vector<core::PageKey> tail = core::ComputePageKeys(keys[i - 1], rest, spec.page_size);
    FUZZ_CHECK(tail == std::vector<core::PageKey>(keys.begin() + i, keys.end()));
  }
  std::vector<core::PageKey> prefix(i);
  FUZZ_CHECK(core::ComputePageKeys(root, tokens, spec.page_size, absl::MakeSpan(prefix)) == i);
  FUZZ_CHECK(prefix == std::vector<core::PageKey>(keys.begin(), keys.begin() + i));
  const auto first = absl::MakeConstSpan(tokens).subspan(0, spec.page_size);
  FUZZ_CHECK(core::ChainPageKey(root, first) == keys[0]);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const std::vector<absl::string_view> f = absl::StrSplit(input, absl::MaxSplits('\n', 9));
  if (f.size() < 10) return -1;
  core::NamespaceSpec spec;
  spec.tenant = std::string(f[0]);
  spec.model_id = std::string(f[1]);
  spec.model_revision = std::string(f[2]);
  spec.kv_dtype = std::string(f[3]);
  absl::StatusOr<core::LayoutKind> layout = core::ParseLayoutKind(f[5]);
  if (!absl::SimpleAtoi(f[4], &spec.page_size) || !absl::SimpleAtoi(f[6], &spec.tp_size) ||
      !layout.ok()) {
    return 0;
  }
  spec.layout = *layout;
  spec.opaque_keys = f[7] == "1";
  CheckKeyParsing(f[8]);

  const absl::Status valid = spec.Validate();
  if (!valid.ok()) {
    FUZZ_CHECK(valid.code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(valid.message().size() <= kvcellar::fuzz::kMaxErrorMessageBytes);
    return 0;
  }
  FUZZ_CHECK(spec.page_size >= 1 && spec.page_size <= core::kMaxPageSize);
  FUZZ_CHECK(spec.tp_size >= 1 && spec.tp_size <= core::kMaxTpSize);
  // The tag and four strings, each length-prefixed, then four u32s.
  const std::string encoding = spec.CanonicalEncoding();
  FUZZ_CHECK(encoding.size() <= 4 + 14 + 4 * (4 + core::kMaxNamespaceStringBytes) + 4 * 4);
  if (!spec.opaque_keys && !f[9].empty()) CheckChain(spec, f[9][0], f[9].substr(1));
  return 0;
}
