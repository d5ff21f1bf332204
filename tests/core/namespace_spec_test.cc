// Tests for core/namespace_spec.h: validation per field and the digest's sensitivity to every
// field. Byte-level golden vectors are in page_key_test.cc.
#include "core/namespace_spec.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

NamespaceSpec Good() {
  return NamespaceSpec{.tenant = "acme",
                       .model_id = "meta-llama/Llama-3.1-8B-Instruct",
                       .model_revision = "0e9e39f249a16976918f6564b8830bc894c89659",
                       .kv_dtype = "bf16",
                       .page_size = 16,
                       .layout = LayoutKind::kMha,
                       .tp_size = 2,
                       .opaque_keys = false,
                       .groups = {}};
}

void ExpectInvalid(const NamespaceSpec& ns, absl::string_view field, absl::string_view detail) {
  const absl::Status s = ns.Validate();
  ASSERT_FALSE(s.ok()) << "expected " << field << " to be rejected";
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(std::string(field)));
  EXPECT_THAT(s.message(), HasSubstr(std::string(detail)));
}

TEST(NamespaceSpecTest, GoodSpecValidates) {
  EXPECT_TRUE(Good().Validate().ok()) << Good().Validate();
  NamespaceSpec ns = Good();
  ns.tenant = "";  // Single-tenant deployments.
  EXPECT_TRUE(ns.Validate().ok());
  ns.tenant = "équipe-δ";  // UTF-8 is hashed as given.
  EXPECT_TRUE(ns.Validate().ok());
  for (absl::string_view d : SupportedKvDtypes()) {
    ns.kv_dtype = std::string(d);
    EXPECT_TRUE(ns.Validate().ok()) << d;
  }
  ns.page_size = 1;
  EXPECT_TRUE(ns.Validate().ok());
  ns.page_size = kMaxPageSize;
  ns.tp_size = kMaxTpSize;
  EXPECT_TRUE(ns.Validate().ok());
}

TEST(NamespaceSpecTest, RejectsEachBadField) {
  NamespaceSpec ns = Good();
  ns.model_id = "";
  ExpectInvalid(ns, "model_id", "must not be empty");

  ns = Good();
  ns.model_revision = "";
  ExpectInvalid(ns, "model_revision", "must not be empty");

  ns = Good();
  ns.model_id = std::string(kMaxNamespaceStringBytes + 1, 'm');
  ExpectInvalid(ns, "model_id", "1025 bytes");

  ns = Good();
  ns.tenant = "ac\nme";
  ExpectInvalid(ns, "tenant", "control character 0x0a at offset 2");

  ns = Good();
  ns.kv_dtype = "BF16";
  ExpectInvalid(ns, "kv_dtype", "\"BF16\" is not supported");
  ns.kv_dtype = "";
  ExpectInvalid(ns, "kv_dtype", "expected one of: fp32, fp16, bf16");

  ns = Good();
  ns.page_size = 0;
  ExpectInvalid(ns, "page_size", "page_size 0 is out of range [1, 65536]");
  ns.page_size = kMaxPageSize + 1;
  ExpectInvalid(ns, "page_size", "65537");

  ns = Good();
  ns.tp_size = 0;
  ExpectInvalid(ns, "tp_size", "tp_size 0 is out of range [1, 1024]");
  ns.tp_size = kMaxTpSize + 1;
  ExpectInvalid(ns, "tp_size", "1025");

  ns = Good();
  ns.layout = static_cast<LayoutKind>(7);
  ExpectInvalid(ns, "layout", "7");
}

TEST(NamespaceSpecTest, ShardsPerPage) {
  NamespaceSpec ns = Good();
  ns.tp_size = 4;
  EXPECT_EQ(ns.ShardsPerPage(), 4u);
  ns.layout = LayoutKind::kMla;
  EXPECT_EQ(ns.ShardsPerPage(), 1u);
}

TEST(NamespaceSpecTest, DigestChangesWhenAnyFieldChanges) {
  std::vector<NamespaceSpec> variants;
  variants.push_back(Good());
  auto add = [&](auto mutate) {
    NamespaceSpec ns = Good();
    mutate(ns);
    ASSERT_TRUE(ns.Validate().ok()) << ns.Validate();
    variants.push_back(ns);
  };
  add([](NamespaceSpec& ns) { ns.tenant = "acme2"; });
  add([](NamespaceSpec& ns) { ns.tenant = ""; });
  add([](NamespaceSpec& ns) { ns.model_id = "meta-llama/Llama-3.1-70B-Instruct"; });
  add([](NamespaceSpec& ns) { ns.model_revision = "1e9e39f249a16976918f6564b8830bc894c89659"; });
  add([](NamespaceSpec& ns) { ns.kv_dtype = "fp8_e4m3"; });
  add([](NamespaceSpec& ns) { ns.page_size = 32; });
  add([](NamespaceSpec& ns) { ns.layout = LayoutKind::kMla; });
  add([](NamespaceSpec& ns) { ns.tp_size = 4; });
  add([](NamespaceSpec& ns) { ns.opaque_keys = true; });
  // Field boundaries are length-prefixed: moving a byte between adjacent fields changes the
  // encoding.
  add([](NamespaceSpec& ns) {
    ns.tenant = "acmem";
    ns.model_id = "eta-llama/Llama-3.1-8B-Instruct";
  });

  absl::flat_hash_set<PageKey> digests;
  absl::flat_hash_set<std::string> encodings;
  for (const NamespaceSpec& ns : variants) {
    digests.insert(ns.Digest());
    encodings.insert(ns.CanonicalEncoding());
  }
  EXPECT_EQ(digests.size(), variants.size());
  EXPECT_EQ(encodings.size(), variants.size());
}

TEST(NamespaceSpecTest, MlaSharesAcrossTpSizesMhaDoesNot) {
  NamespaceSpec a = Good();
  NamespaceSpec b = Good();
  a.layout = b.layout = LayoutKind::kMla;
  a.tp_size = 4;
  b.tp_size = 8;
  // One latent shard, byte-identical on every rank whatever the TP size.
  EXPECT_EQ(a.Digest(), b.Digest());
  a.layout = b.layout = LayoutKind::kMha;
  EXPECT_NE(a.Digest(), b.Digest());
}

TEST(NamespaceSpecTest, EncodingLayout) {
  const NamespaceSpec ns{.tenant = "t",
                         .model_id = "m",
                         .model_revision = "r",
                         .kv_dtype = "bf16",
                         .page_size = 0x01020304,
                         .layout = LayoutKind::kMla,
                         .tp_size = 8,
                         .opaque_keys = true,
                         .groups = {}};
  const std::string enc = ns.CanonicalEncoding();
  const std::string want = std::string("\x0e\0\0\0kvcellar-ns-v2", 18) +  //
                           std::string("\x01\0\0\0t", 5) +                // tenant
                           std::string("\x01\0\0\0m", 5) +                // model_id
                           std::string("\x01\0\0\0r", 5) +                // model_revision
                           std::string("\x04\0\0\0bf16", 8) +             // kv_dtype
                           std::string("\x04\x03\x02\x01", 4) +           // page_size
                           std::string("\x01\0\0\0", 4) +                 // layout: mla
                           std::string("\x01\0\0\0", 4) +                 // shards: 1
                           std::string("\x01\0\0\0", 4);                  // opaque
  EXPECT_EQ(enc, want);
  EXPECT_THAT(enc, StartsWith(std::string("\x0e\0\0\0kvcellar-ns-v2", 18)));
}

TEST(NamespaceSpecTest, LayoutNames) {
  EXPECT_EQ(LayoutKindName(LayoutKind::kMha), "mha");
  EXPECT_EQ(LayoutKindName(LayoutKind::kMla), "mla");
  EXPECT_EQ(*ParseLayoutKind("mha"), LayoutKind::kMha);
  EXPECT_EQ(*ParseLayoutKind("gqa"), LayoutKind::kMha);
  EXPECT_EQ(*ParseLayoutKind("mla"), LayoutKind::kMla);
  absl::StatusOr<LayoutKind> bad = ParseLayoutKind("MQA");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("\"MQA\""));
}

}  // namespace
}  // namespace kvcellar::core
