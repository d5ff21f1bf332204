#include "storage/file_layout.h"

#include <cstdio>
#include <cstring>

#include "storage/object_name.h"

namespace kvcellar::storage {

static_assert(sizeof(FileObjectId::ns_prefix) == kNamespaceTagBytes);

uint64_t NamespacePrefix(const core::PageKey& ns) {
  uint64_t v;
  std::memcpy(&v, ns.bytes.data(), sizeof(v));
  return v;
}

char* FormatLeafDir(uint64_t ns_prefix, const core::PageKey& key, char* out) {
  uint8_t ns8[kNamespaceTagBytes];
  std::memcpy(ns8, &ns_prefix, sizeof(ns8));
  out = AppendHex(ns8, sizeof(ns8), out);
  *out++ = '/';
  out = AppendHex(key.bytes.data(), 1, out);
  *out = '\0';
  return out;
}

char* FormatObjectPath(uint64_t ns_prefix, const core::PageKey& key, uint32_t shard, char* out) {
  out = FormatLeafDir(ns_prefix, key, out);
  *out++ = '/';
  out = AppendHex(key.bytes.data(), key.bytes.size(), out);
  *out++ = '.';
  return AppendDecimal(shard, out);
}

void FormatTempPath(const char* object_path, const std::string& host_id, pid_t pid, uint64_t seq,
                    char* out) {
  std::snprintf(out, kMaxRelPath, "%.100s%s%.64s-%d-%llu", object_path, kTempMarker,
                host_id.c_str(), static_cast<int>(pid), static_cast<unsigned long long>(seq));
}

std::string TempHostId(absl::string_view host) {
  std::string id(host);
  for (char& c : id) {
    if (c == '/' || c == '\0') c = '_';
  }
  if (id.size() > kMaxHostChars) id.resize(kMaxHostChars);
  return id;
}

bool ParseNamespaceDir(absl::string_view name, uint64_t* ns_prefix) {
  uint8_t ns8[kNamespaceTagBytes];
  if (name.size() != 2 * kNamespaceTagBytes || !ParseHex(name, ns8)) return false;
  std::memcpy(ns_prefix, ns8, sizeof(*ns_prefix));
  return true;
}

bool IsLeafDir(absl::string_view name) {
  uint8_t kk;
  return name.size() == 2 && ParseHex(name, &kk);
}

bool TempSuffix(absl::string_view name, absl::string_view* suffix) {
  const size_t marker = name.find(kTempMarker);
  if (marker == absl::string_view::npos) return false;
  *suffix = name.substr(marker + sizeof(kTempMarker) - 1);
  return true;
}

bool ParseTempWriter(absl::string_view suffix, absl::string_view* host, uint32_t* pid) {
  const size_t seq_dash = suffix.rfind('-');
  if (seq_dash == absl::string_view::npos || seq_dash == 0) return false;
  const size_t pid_dash = suffix.rfind('-', seq_dash - 1);
  if (pid_dash == absl::string_view::npos) return false;
  *host = suffix.substr(0, pid_dash);
  return ParseDecimal(suffix.substr(pid_dash + 1, seq_dash - pid_dash - 1), pid);
}

bool ParseObjectFile(absl::string_view name, core::PageKey* key, uint32_t* shard) {
  return ParseHex(name.substr(0, 64), key->bytes.data()) && ParseDecimal(name.substr(65), shard);
}

}  // namespace kvcellar::storage
