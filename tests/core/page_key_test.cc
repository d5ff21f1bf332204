// Tests for core/page_key.h: hex and raw parsing, the key chain, and the golden vectors that pin
// docs/keys.md (tests/data/keys_golden.json, written by an independent Python implementation).
#include "core/page_key.h"

#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/namespace_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::HasSubstr;

// ---- A tiny JSON reader for the golden file's fixed shape ---------------------------------------
// Objects, arrays, strings (with \uXXXX escapes), non-negative integers, true/false/null. Enough
// for keys_golden.json; anything else is a parse error, which fails the test.
struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  uint64_t number = 0;
  std::string str;
  std::vector<Json> array;
  std::vector<std::pair<std::string, Json>> object;

  const Json* Find(absl::string_view key) const {
    for (const auto& [k, v] : object) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

class JsonReader {
 public:
  explicit JsonReader(absl::string_view text) : text_(text) {}

  absl::StatusOr<Json> ParseDocument() {
    absl::StatusOr<Json> v = ParseValue();
    if (!v.ok()) return v;
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON: ", what, " at offset ", pos_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::StatusOr<Json> ParseValue() {
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end");
    Json v;
    const char c = text_[pos_];
    if (c == '{') {
      v.type = Json::Type::kObject;
      ++pos_;
      SkipSpace();
      if (Consume("}")) return v;
      while (true) {
        SkipSpace();
        absl::StatusOr<std::string> key = ParseString();
        if (!key.ok()) return key.status();
        SkipSpace();
        if (!Consume(":")) return Error("expected ':'");
        absl::StatusOr<Json> member = ParseValue();
        if (!member.ok()) return member;
        v.object.emplace_back(*std::move(key), *std::move(member));
        SkipSpace();
        if (Consume("}")) return v;
        if (!Consume(",")) return Error("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.type = Json::Type::kArray;
      ++pos_;
      SkipSpace();
      if (Consume("]")) return v;
      while (true) {
        absl::StatusOr<Json> element = ParseValue();
        if (!element.ok()) return element;
        v.array.push_back(*std::move(element));
        SkipSpace();
        if (Consume("]")) return v;
        if (!Consume(",")) return Error("expected ',' or ']'");
      }
    }
    if (c == '"') {
      absl::StatusOr<std::string> s = ParseString();
      if (!s.ok()) return s.status();
      v.type = Json::Type::kString;
      v.str = *std::move(s);
      return v;
    }
    if (Consume("true") || Consume("false")) {
      v.type = Json::Type::kBool;
      v.boolean = text_[pos_ - 1] == 'e' && text_[pos_ - 2] == 'u';
      return v;
    }
    if (Consume("null")) return v;
    if (c >= '0' && c <= '9') {
      v.type = Json::Type::kNumber;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        if (v.number > (UINT64_MAX - 9) / 10) return Error("number too large");
        v.number = v.number * 10 + static_cast<uint64_t>(text_[pos_++] - '0');
      }
      if (pos_ < text_.size() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
        return Error("only integers are supported");
      }
      return v;
    }
    return Error(absl::StrCat("unexpected character '", text_.substr(pos_, 1), "'"));
  }

  absl::StatusOr<std::string> ParseString() {
    if (!Consume("\"")) return Error("expected '\"'");
    std::string out;
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) break;
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out.push_back(e);
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'u': {
          absl::StatusOr<uint32_t> cp = ParseHex4();
          if (!cp.ok()) return cp.status();
          uint32_t code = *cp;
          if (code >= 0xd800 && code < 0xdc00) {  // High surrogate: a low one must follow.
            if (!Consume("\\u")) return Error("lone surrogate");
            absl::StatusOr<uint32_t> low = ParseHex4();
            if (!low.ok()) return low.status();
            code = 0x10000 + ((code - 0xd800) << 10) + (*low - 0xdc00);
          }
          AppendUtf8(code, &out);
          break;
        }
        default:
          return Error("unsupported escape");
      }
    }
    return Error("unterminated string");
  }

  absl::StatusOr<uint32_t> ParseHex4() {
    if (pos_ + 4 > text_.size()) return Error("short \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        v |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        v |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        return Error("bad \\u escape");
      }
    }
    return v;
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// ---- Helpers ------------------------------------------------------------------------------------

PageKey KeyOf(absl::string_view hex) {
  absl::StatusOr<PageKey> k = PageKey::FromHex(hex);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? *k : PageKey{};
}

std::vector<uint32_t> RandomTokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(rng());
  return t;
}

const PageKey& TestRoot() {
  static const PageKey root = [] {
    NamespaceSpec ns{.tenant = "t",
                     .model_id = "m",
                     .model_revision = "r",
                     .kv_dtype = "bf16",
                     .page_size = 16,
                     .layout = LayoutKind::kMha,
                     .tp_size = 1,
                     .opaque_keys = false,
                     .groups = {}};
    return ns.Digest();
  }();
  return root;
}

// ---- Hex and raw bytes --------------------------------------------------------------------------

TEST(PageKeyTest, HexRoundTrip) {
  PageKey k;
  for (size_t i = 0; i < kPageKeyBytes; ++i) k.bytes[i] = static_cast<uint8_t>(i * 37 + 5);
  const std::string hex = k.Hex();
  EXPECT_EQ(hex.size(), 64u);
  EXPECT_EQ(hex, absl::BytesToHexString(k.AsBytes()));
  absl::StatusOr<PageKey> back = PageKey::FromHex(hex);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, k);
}

TEST(PageKeyTest, HexIsLowercaseAndParsesEitherCase) {
  PageKey k;
  k.bytes.fill(0xab);
  std::string lower, upper;
  for (int i = 0; i < 32; ++i) {
    lower += "ab";
    upper += "AB";
  }
  EXPECT_EQ(k.Hex(), lower);
  absl::StatusOr<PageKey> parsed = PageKey::FromHex(upper);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, k);
}

TEST(PageKeyTest, FromHexRejectsWrongLength) {
  for (size_t n : {0u, 1u, 63u, 65u, 128u}) {
    absl::StatusOr<PageKey> k = PageKey::FromHex(std::string(n, '0'));
    ASSERT_FALSE(k.ok()) << n;
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(k.status().message(), HasSubstr(absl::StrCat("got ", n)));
  }
}

TEST(PageKeyTest, FromHexNamesTheBadCharacterAndOffset) {
  std::string hex(64, '0');
  hex[17] = 'g';
  absl::StatusOr<PageKey> k = PageKey::FromHex(hex);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(k.status().message(), HasSubstr("'g'"));
  EXPECT_THAT(k.status().message(), HasSubstr("offset 17"));

  hex[17] = '\x01';
  k = PageKey::FromHex(hex);
  ASSERT_FALSE(k.ok());
  EXPECT_THAT(k.status().message(), HasSubstr("0x01"));
}

TEST(PageKeyTest, FromBytes) {
  std::string raw(32, '\0');
  for (int i = 0; i < 32; ++i) raw[i] = static_cast<char>(255 - i);
  absl::StatusOr<PageKey> k = PageKey::FromBytes(raw);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->AsBytes(), raw);

  for (size_t n : {0u, 31u, 33u, 64u}) {
    absl::StatusOr<PageKey> bad = PageKey::FromBytes(std::string(n, 'x'));
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr(absl::StrCat("got ", n)));
  }
}

TEST(PageKeyTest, HashAndOrderingUseAllBytes) {
  PageKey a, b;
  b.bytes[31] = 1;
  EXPECT_NE(a, b);
  EXPECT_LT(a, b);
  absl::flat_hash_set<PageKey> set = {a, b};
  EXPECT_EQ(set.size(), 2u);
}

// ---- Key chain ----------------------------------------------------------------------------------

// ComputePageKeys runs the token blocks of four pages at a time on the SHA extensions where the
// CPU has them (core/sha256_lanes.h); every key must be ChainPageKey's (OpenSSL, one page at a
// time), for page sizes whose tail takes one block or two, with and without whole token blocks
// before the parent key, and for every page count modulo four.
TEST(KeyChainTest, ChainMatchesDefinition) {
  for (uint32_t page_size :
       {1u, 5u, 6u, 8u, 15u, 16u, 17u, 21u, 22u, 31u, 32u, 33u, 64u, 100u, 128u, 256u}) {
    for (size_t pages : {1u, 2u, 3u, 4u, 5u, 8u, 9u, 70u}) {
      const std::vector<uint32_t> tokens = RandomTokens(pages * page_size, page_size + pages);
      const std::vector<PageKey> keys = ComputePageKeys(TestRoot(), tokens, page_size);
      ASSERT_EQ(keys.size(), pages);
      PageKey parent = TestRoot();
      for (size_t i = 0; i < keys.size(); ++i) {
        const PageKey k =
            ChainPageKey(parent, absl::MakeConstSpan(tokens).subspan(i * page_size, page_size));
        ASSERT_EQ(keys[i], k) << "page_size " << page_size << ", pages " << pages << ", page " << i;
        parent = k;
      }
    }
  }
}

TEST(KeyChainTest, ExtendingFromAParentEqualsTheFullChain) {
  for (uint32_t page_size : {1u, 3u, 16u, 64u}) {
    const std::vector<uint32_t> tokens = RandomTokens(page_size * 9 + page_size / 2, page_size);
    const std::vector<PageKey> full = ComputePageKeys(TestRoot(), tokens, page_size);
    ASSERT_EQ(full.size(), 9u);
    for (size_t i = 1; i < full.size(); ++i) {
      const std::vector<PageKey> tail = ComputePageKeys(
          full[i - 1], absl::MakeConstSpan(tokens).subspan(i * page_size), page_size);
      ASSERT_EQ(tail.size(), full.size() - i) << "page_size " << page_size << " from " << i;
      for (size_t j = 0; j < tail.size(); ++j) EXPECT_EQ(tail[j], full[i + j]);
    }
  }
}

TEST(KeyChainTest, PartialTrailingPageIsNotKeyed) {
  const std::vector<uint32_t> tokens = RandomTokens(16 * 4 + 15, 7);
  const std::vector<PageKey> with_partial = ComputePageKeys(TestRoot(), tokens, 16);
  const std::vector<PageKey> exact =
      ComputePageKeys(TestRoot(), absl::MakeConstSpan(tokens).first(64), 16);
  EXPECT_EQ(with_partial.size(), 4u);
  EXPECT_EQ(with_partial, exact);
  EXPECT_TRUE(ComputePageKeys(TestRoot(), absl::MakeConstSpan(tokens).first(15), 16).empty());
  EXPECT_EQ(FullPages(79, 16), 4u);
  EXPECT_EQ(FullPages(79, 0), 0u);
}

TEST(KeyChainTest, SpanApiWritesAPrefixWhenOutIsShort) {
  const std::vector<uint32_t> tokens = RandomTokens(16 * 6, 9);
  const std::vector<PageKey> full = ComputePageKeys(TestRoot(), tokens, 16);
  std::vector<PageKey> out(3);
  EXPECT_EQ(ComputePageKeys(TestRoot(), tokens, 16, absl::MakeSpan(out)), 3u);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), full.begin()));

  std::vector<PageKey> big(10);
  EXPECT_EQ(ComputePageKeys(TestRoot(), tokens, 16, absl::MakeSpan(big)), 6u);
  EXPECT_TRUE(std::equal(full.begin(), full.end(), big.begin()));
  EXPECT_EQ(big[6], PageKey{}) << "entries past the full pages are untouched";

  EXPECT_EQ(ComputePageKeys(TestRoot(), tokens, 0, absl::MakeSpan(big)), 0u);
}

TEST(KeyChainTest, EveryTokenAndThePrefixMatter) {
  const std::vector<uint32_t> tokens = RandomTokens(64, 11);
  const std::vector<PageKey> base = ComputePageKeys(TestRoot(), tokens, 16);
  // Changing a token in page 1 changes keys 1..3 and leaves key 0 alone.
  std::vector<uint32_t> edited = tokens;
  edited[20] ^= 1;
  const std::vector<PageKey> changed = ComputePageKeys(TestRoot(), edited, 16);
  EXPECT_EQ(changed[0], base[0]);
  for (size_t i = 1; i < 4; ++i) EXPECT_NE(changed[i], base[i]) << i;
  // Another namespace roots a different chain.
  PageKey other = TestRoot();
  other.bytes[0] ^= 1;
  const std::vector<PageKey> elsewhere = ComputePageKeys(other, tokens, 16);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(elsewhere[i], base[i]) << i;
  // Page boundaries matter: the same tokens paged by 8 give different keys than by 16.
  EXPECT_NE(ComputePageKeys(TestRoot(), tokens, 8)[1], base[0]);
}

TEST(KeyChainTest, TokensAreHashedLittleEndian) {
  // One page of one token 0x01020304 hashes the bytes 04 03 02 01, as docs/keys.md says.
  const std::vector<uint32_t> tokens = {0x01020304u};
  const PageKey key = ComputePageKeys(PageKey{}, tokens, 1)[0];
  // sha256(04 03 02 01 || 32 zero bytes), from Python: hashlib.sha256(b"\x04\x03\x02\x01" +
  // bytes(32)).
  EXPECT_EQ(key.Hex(), "eb6fd60b9d43793a30d7a0d14267d3f38be725eea7e7c62912bf4ff425d38e1f");
}

// ScopeOpaqueKeys runs four keys at a time on the SHA extensions where the CPU has them; each
// result must be ScopeOpaqueKey's (OpenSSL), for every count (whole groups of four and short
// last groups) and in place.
TEST(KeyChainTest, ScopingManyOpaqueKeysEqualsScopingEachOne) {
  std::mt19937 rng(11);
  PageKey ns;
  for (uint8_t& b : ns.bytes) b = static_cast<uint8_t>(rng());
  for (size_t n : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 8u, 9u, 63u, 64u, 1000u}) {
    std::vector<PageKey> keys(n), out(n);
    for (PageKey& k : keys) {
      for (uint8_t& b : k.bytes) b = static_cast<uint8_t>(rng());
    }
    ScopeOpaqueKeys(ns, keys, absl::MakeSpan(out));
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], ScopeOpaqueKey(ns, keys[i])) << n << " " << i;
    std::vector<PageKey> in_place = keys;
    ScopeOpaqueKeys(ns, in_place, absl::MakeSpan(in_place));
    EXPECT_EQ(in_place, out) << n;
  }
}

TEST(KeyChainTest, OpaqueKeysAreScopedByNamespace) {
  const PageKey engine_key = KeyOf(std::string(64, '7'));
  PageKey ns_a = TestRoot();
  PageKey ns_b = TestRoot();
  ns_b.bytes[5] ^= 0x40;
  EXPECT_NE(ScopeOpaqueKey(ns_a, engine_key), ScopeOpaqueKey(ns_b, engine_key));
  EXPECT_EQ(ScopeOpaqueKey(ns_a, engine_key), ScopeOpaqueKey(ns_a, engine_key));
}

// ---- Golden vectors -----------------------------------------------------------------------------

class GoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = std::string(KVCELLAR_TEST_DATA_DIR) + "/keys_golden.json";
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << "cannot open " << path;
    std::stringstream buf;
    buf << in.rdbuf();
    text_ = buf.str();
    absl::StatusOr<Json> doc = JsonReader(text_).ParseDocument();
    ASSERT_TRUE(doc.ok()) << path << ": " << doc.status();
    doc_ = *std::move(doc);
  }

  static const Json& Field(const Json& obj, absl::string_view key) {
    static const Json kMissing;
    const Json* v = obj.Find(key);
    EXPECT_NE(v, nullptr) << "golden file lacks field " << key;
    return v != nullptr ? *v : kMissing;
  }

  static NamespaceSpec SpecOf(const Json& j) {
    NamespaceSpec ns;
    ns.tenant = Field(j, "tenant").str;
    ns.model_id = Field(j, "model_id").str;
    ns.model_revision = Field(j, "model_revision").str;
    ns.kv_dtype = Field(j, "kv_dtype").str;
    ns.page_size = static_cast<uint32_t>(Field(j, "page_size").number);
    absl::StatusOr<LayoutKind> layout = ParseLayoutKind(Field(j, "layout").str);
    EXPECT_TRUE(layout.ok()) << layout.status();
    ns.layout = layout.value_or(LayoutKind::kMha);
    ns.tp_size = static_cast<uint32_t>(Field(j, "tp_size").number);
    ns.opaque_keys = Field(j, "opaque_keys").boolean;
    if (const Json* groups = j.Find("groups"); groups != nullptr) {
      for (const Json& g : groups->array) {
        const std::string kind = Field(g, "kind").str;
        KvGroup group;
        group.kind = kind == "window"  ? GroupKind::kWindow
                     : kind == "state" ? GroupKind::kState
                                       : GroupKind::kFull;
        EXPECT_EQ(GroupKindName(group.kind), kind);
        group.window_tokens = static_cast<uint32_t>(Field(g, "window_tokens").number);
        ns.groups.push_back(group);
      }
    }
    return ns;
  }

  // Checks what every case has: the encoding and the digest. Returns the digest.
  static PageKey CheckNamespace(const Json& c, const std::string& name) {
    const NamespaceSpec ns = SpecOf(Field(c, "namespace"));
    EXPECT_TRUE(ns.Validate().ok()) << name << ": " << ns.Validate();
    EXPECT_EQ(absl::BytesToHexString(ns.CanonicalEncoding()), Field(c, "encoding_hex").str) << name;
    EXPECT_EQ(ns.Digest().Hex(), Field(c, "ns_digest").str) << name;
    return ns.Digest();
  }

  std::string text_;
  Json doc_;
};

TEST_F(GoldenTest, FileHasTheExpectedCases) {
  EXPECT_EQ(Field(doc_, "encoding_tag").str, "kvcellar-ns-v2");
  EXPECT_EQ(Field(doc_, "hybrid_encoding_tag").str, "kvcellar-ns-v3");
  // Guards against an emptied or truncated file passing vacuously.
  EXPECT_GE(Field(doc_, "cases").array.size(), 8u);
  EXPECT_GE(Field(doc_, "opaque_cases").array.size(), 2u);
  size_t keys = 0;
  for (const Json& c : Field(doc_, "cases").array) keys += Field(c, "page_keys").array.size();
  EXPECT_GE(keys, 20u);
}

TEST_F(GoldenTest, NamespaceEncodingDigestAndPageKeysMatchByteForByte) {
  for (const Json& c : Field(doc_, "cases").array) {
    const std::string name = Field(c, "name").str;
    SCOPED_TRACE(name);
    const PageKey digest = CheckNamespace(c, name);
    const uint32_t page_size =
        static_cast<uint32_t>(Field(Field(c, "namespace"), "page_size").number);

    std::vector<uint32_t> tokens;
    for (const Json& t : Field(c, "tokens").array) {
      ASSERT_LE(t.number, uint64_t{UINT32_MAX});
      tokens.push_back(static_cast<uint32_t>(t.number));
    }
    const std::vector<Json>& want = Field(c, "page_keys").array;

    std::vector<PageKey> out(want.size() + 2);
    const size_t n = ComputePageKeys(digest, tokens, page_size, absl::MakeSpan(out));
    ASSERT_EQ(n, want.size());
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(out[i].Hex(), want[i].str) << "page " << i;

    const std::vector<PageKey> v = ComputePageKeys(digest, tokens, page_size);
    ASSERT_EQ(v.size(), want.size());
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], KeyOf(want[i].str)) << "page " << i;
  }
}

TEST_F(GoldenTest, HybridNamespacesTakeTheV3EncodingAndOneFullGroupDoesNot) {
  std::map<std::string, std::string> digests;
  size_t hybrids = 0;
  for (const Json& c : Field(doc_, "cases").array) {
    digests[Field(c, "name").str] = Field(c, "ns_digest").str;
    const NamespaceSpec ns = SpecOf(Field(c, "namespace"));
    if (!ns.Hybrid()) continue;
    ++hybrids;
    // "kvcellar-ns-v3", length-prefixed, then the groups at the end.
    EXPECT_EQ(Field(c, "encoding_hex").str.substr(0, 36),
              absl::BytesToHexString(std::string("\x0e\0\0\0kvcellar-ns-v3", 18)));
    EXPECT_EQ(ns.ObjectsPerPage(), ns.NumGroups() * ns.ShardsPerPage());
  }
  EXPECT_GE(hybrids, 2u);
  EXPECT_EQ(digests["one_full_group_is_v2"], digests["docs_example"]);
}

TEST(NamespaceGroupsTest, BadGroupsAreRefusedNamingTheField) {
  NamespaceSpec ns;
  ns.model_id = "m";
  ns.model_revision = "r";
  ns.kv_dtype = "bf16";
  ns.page_size = 16;
  ns.groups = {KvGroup{GroupKind::kFull, 0}, KvGroup{GroupKind::kWindow, 0}};
  EXPECT_THAT(ns.Validate().message(),
              ::testing::HasSubstr("groups[1].window_tokens 0 is out of range"));
  ns.groups[1] = KvGroup{GroupKind::kState, 64};
  EXPECT_THAT(ns.Validate().message(),
              ::testing::HasSubstr("groups[1].window_tokens is 64 for a state group"));
  ns.groups[1] = KvGroup{static_cast<GroupKind>(9), 0};
  EXPECT_THAT(ns.Validate().message(), ::testing::HasSubstr("groups[1].kind 9 is not a known"));
  ns.groups = std::vector<KvGroup>(17, KvGroup{});
  EXPECT_THAT(ns.Validate().message(), ::testing::HasSubstr("17 groups, more than the limit"));
  ns.groups = {KvGroup{}, KvGroup{GroupKind::kState, 0}};
  ns.tp_size = 32;
  EXPECT_TRUE(ns.Validate().ok()) << ns.Validate();
  ns.tp_size = 33;
  EXPECT_THAT(ns.Validate().message(), ::testing::HasSubstr("66 objects per page"));
  // A window of W tokens needs the pages holding its last W - 1 tokens before a boundary.
  EXPECT_EQ((KvGroup{GroupKind::kWindow, 1}.WindowPages(16)), 0u);
  EXPECT_EQ((KvGroup{GroupKind::kWindow, 2}.WindowPages(16)), 1u);
  EXPECT_EQ((KvGroup{GroupKind::kWindow, 17}.WindowPages(16)), 1u);
  EXPECT_EQ((KvGroup{GroupKind::kWindow, 18}.WindowPages(16)), 2u);
  EXPECT_EQ((KvGroup{GroupKind::kWindow, 4096}.WindowPages(16)), 256u);
}

TEST_F(GoldenTest, OpaqueNamespacesAndScopedKeysMatch) {
  absl::flat_hash_set<std::string> chained_digests;
  for (const Json& c : Field(doc_, "cases").array)
    chained_digests.insert(Field(c, "ns_digest").str);
  for (const Json& c : Field(doc_, "opaque_cases").array) {
    const std::string name = Field(c, "name").str;
    SCOPED_TRACE(name);
    const PageKey digest = CheckNamespace(c, name);
    EXPECT_FALSE(chained_digests.contains(digest.Hex())) << "opaque digest equals a chained one";
    const std::vector<Json>& engine = Field(c, "engine_keys").array;
    const std::vector<Json>& scoped = Field(c, "scoped_keys").array;
    ASSERT_EQ(engine.size(), scoped.size());
    ASSERT_FALSE(engine.empty());
    for (size_t i = 0; i < engine.size(); ++i) {
      EXPECT_EQ(ScopeOpaqueKey(digest, KeyOf(engine[i].str)).Hex(), scoped[i].str) << i;
    }
  }
}

}  // namespace
}  // namespace kvcellar::core
