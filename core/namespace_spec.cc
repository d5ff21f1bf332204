// NamespaceSpec validation and the canonical "kvcellar-ns-v2" / "-v3" encodings (spec:
// docs/keys.md).
#include "core/namespace_spec.h"

#include <openssl/sha.h>

#include <array>

#include "absl/strings/str_cat.h"
#include "core/quote.h"

namespace kvcellar::core {
namespace {

// Version tag, the first field of every encoding. A change to the field list or to any field's
// meaning takes a new tag, so old and new digests can never be confused.
constexpr absl::string_view kEncodingTag = "kvcellar-ns-v2";
// v2's fields, then the KV groups of a hybrid model. A model that is not hybrid keeps v2, so
// its digest, and every page stored under it, stay as they were.
constexpr absl::string_view kHybridEncodingTag = "kvcellar-ns-v3";

constexpr std::array<absl::string_view, 8> kKvDtypes = {
    "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4", "mxfp4",
};

void AppendU32LE(std::string* out, uint32_t v) {
  const char b[4] = {static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 24)};
  out->append(b, sizeof(b));
}

void AppendString(std::string* out, absl::string_view s) {
  AppendU32LE(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

// Control characters are rejected so that two specs that print the same never hash differently
// through an invisible byte. Everything else (UTF-8 included) is hashed as given, unnormalized.
absl::Status CheckString(absl::string_view field, absl::string_view value, bool required) {
  if (required && value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("namespace ", field, " must not be empty"));
  }
  if (value.size() > kMaxNamespaceStringBytes) {
    return absl::InvalidArgumentError(absl::StrCat("namespace ", field, " is ", value.size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxNamespaceStringBytes));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("namespace ", field, " has control character 0x",
                       absl::Hex(c, absl::kZeroPad2), " at offset ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view LayoutKindName(LayoutKind layout) {
  switch (layout) {
    case LayoutKind::kMha:
      return "mha";
    case LayoutKind::kMla:
      return "mla";
  }
  return "unknown";
}

absl::StatusOr<LayoutKind> ParseLayoutKind(absl::string_view name) {
  if (name == "mha" || name == "gqa") return LayoutKind::kMha;
  if (name == "mla") return LayoutKind::kMla;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV layout ", Quote(name), "; expected mha, gqa or mla"));
}

absl::Span<const absl::string_view> SupportedKvDtypes() { return kKvDtypes; }

absl::string_view GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kFull:
      return "full";
    case GroupKind::kWindow:
      return "window";
    case GroupKind::kState:
      return "state";
  }
  return "unknown";
}

absl::Status NamespaceSpec::Validate() const {
  if (absl::Status s = CheckString("tenant", tenant, /*required=*/false); !s.ok()) return s;
  if (absl::Status s = CheckString("model_id", model_id, /*required=*/true); !s.ok()) return s;
  if (absl::Status s = CheckString("model_revision", model_revision, /*required=*/true); !s.ok()) {
    return s;
  }
  bool dtype_ok = false;
  for (absl::string_view d : kKvDtypes) dtype_ok = dtype_ok || kv_dtype == d;
  if (!dtype_ok) {
    std::string list;
    for (absl::string_view d : kKvDtypes) absl::StrAppend(&list, list.empty() ? "" : ", ", d);
    return absl::InvalidArgumentError(absl::StrCat("namespace kv_dtype ", Quote(kv_dtype),
                                                   " is not supported; expected one of: ", list));
  }
  if (page_size == 0 || page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("namespace page_size ", page_size,
                                                   " is out of range [1, ", kMaxPageSize, "]"));
  }
  if (layout != LayoutKind::kMha && layout != LayoutKind::kMla) {
    return absl::InvalidArgumentError(absl::StrCat("namespace layout ",
                                                   static_cast<uint32_t>(layout),
                                                   " is not a known LayoutKind (0=mha, 1=mla)"));
  }
  if (tp_size == 0 || tp_size > kMaxTpSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace tp_size ", tp_size, " is out of range [1, ", kMaxTpSize, "]"));
  }
  if (groups.size() > kMaxKvGroups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace groups: ", groups.size(), " groups, more than the limit of ", kMaxKvGroups));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const KvGroup& group = groups[g];
    const std::string field = absl::StrCat("namespace groups[", g, "]");
    switch (group.kind) {
      case GroupKind::kWindow:
        if (group.window_tokens == 0 || group.window_tokens > kMaxWindowTokens) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".window_tokens ", group.window_tokens, " is out of range [1, ",
                           kMaxWindowTokens, "] for a window group"));
        }
        break;
      case GroupKind::kFull:
      case GroupKind::kState:
        if (group.window_tokens != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".window_tokens is ", group.window_tokens, " for a ",
                           GroupKindName(group.kind), " group; only window groups have one"));
        }
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".kind ", static_cast<uint32_t>(group.kind),
                         " is not a known GroupKind (0=full, 1=window, 2=state)"));
    }
  }
  // (Without groups the shard limit is the server's, which names tp_size: server/rpc.)
  if (Hybrid() && ObjectsPerPage() > kMaxObjectsPerPage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace groups: ", NumGroups(), " groups of ", ShardsPerPage(), " shards are ",
        ObjectsPerPage(), " objects per page, more than the limit of ", kMaxObjectsPerPage));
  }
  return absl::OkStatus();
}

std::string NamespaceSpec::CanonicalEncoding() const {
  std::string out;
  // Five length prefixes and four integers, all u32.
  out.reserve(9 * sizeof(uint32_t) + kEncodingTag.size() + tenant.size() + model_id.size() +
              model_revision.size() + kv_dtype.size());
  AppendString(&out, Hybrid() ? kHybridEncodingTag : kEncodingTag);
  AppendString(&out, tenant);
  AppendString(&out, model_id);
  AppendString(&out, model_revision);
  AppendString(&out, kv_dtype);
  AppendU32LE(&out, page_size);
  AppendU32LE(&out, static_cast<uint32_t>(layout));
  AppendU32LE(&out, ShardsPerPage());
  AppendU32LE(&out, opaque_keys ? 1 : 0);
  if (Hybrid()) {
    AppendU32LE(&out, static_cast<uint32_t>(groups.size()));
    for (const KvGroup& group : groups) {
      AppendU32LE(&out, static_cast<uint32_t>(group.kind));
      AppendU32LE(&out, group.window_tokens);
    }
  }
  return out;
}

PageKey NamespaceSpec::Digest() const {
  const std::string enc = CanonicalEncoding();
  PageKey key;
  SHA256(reinterpret_cast<const unsigned char*>(enc.data()), enc.size(), key.bytes.data());
  return key;
}

}  // namespace kvcellar::core
