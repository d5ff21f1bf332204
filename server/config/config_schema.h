// The config schema: every key of kvcellard.yaml with its type, default, bounds and check, and
// the one path by which a value's text becomes a Config field (ParseAndStore) and back
// (FormatValue). Private to server/config/: config.cc (defaults, canonical YAML, digest) and
// config_loader.cc (the YAML file, --set, checks across keys) share it; everyone else reads
// config.h.
//
// Threads: the schema is built once, on first use, and read-only after.
#ifndef KVCELLAR_SERVER_CONFIG_CONFIG_SCHEMA_H_
#define KVCELLAR_SERVER_CONFIG_CONFIG_SCHEMA_H_

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"

namespace kvcellar::server::config_schema {

// ---- Bindings: how a schema entry reaches its Config field ----------------------------------

template <typename T>
struct Field {
  T& (*mut)(Config&);
  const T& (*get)(const Config&);
};

// Choice fields are enums; they are stored by index into the entry's choice list.
struct EnumField {
  int (*get)(const Config&);
  void (*set)(Config&, int);
};

template <typename Mut, typename Get>
auto MakeField(Mut mut, Get get) {
  using T = std::remove_reference_t<decltype(mut(std::declval<Config&>()))>;
  return Field<T>{+mut, +get};
}

using Binding = std::variant<Field<std::string>, Field<int64_t>, Field<uint64_t>, Field<double>,
                             Field<uint32_t>, Field<bool>, EnumField>;

// A check on a string value: returns "" when fine, else the reason, worded to follow the key
// ("must be host:port ...").
using StringCheck = std::string (*)(absl::string_view value);
using ModeCheck = std::string (*)(uint32_t mode);

struct KeySpec {
  std::string path;
  ConfigType type = ConfigType::kString;
  std::string default_text;
  std::string doc;
  bool secret = false;
  Binding binding;
  // kInt, kDurationMs: inclusive bounds.
  int64_t int_min = std::numeric_limits<int64_t>::min();
  int64_t int_max = std::numeric_limits<int64_t>::max();
  // kSize: inclusive bounds and granularity.
  uint64_t size_min = 0;
  uint64_t size_max = std::numeric_limits<uint64_t>::max();
  uint64_t size_multiple = 1;
  // kDouble: bounds, each open or closed.
  double double_min = 0;
  double double_max = 0;
  bool double_min_open = false;
  bool double_max_open = false;
  std::vector<std::string> choices;  // kChoice
  StringCheck string_check = nullptr;
  // kString holding a list: the file may give a YAML sequence, joined with this separator.
  char list_separator = '\0';
  ModeCheck mode_check = nullptr;
  std::string constraint;  // Human-readable; see ConfigKeyInfo.
};

struct Formatted {
  std::string text;  // Canonical, unquoted.
  bool quote;        // Written as a YAML string.
};

struct Schema {
  std::vector<KeySpec> keys;
  std::vector<ConfigKeyInfo> infos;
  std::vector<std::string> sections;  // In table order.
  absl::flat_hash_map<std::string, size_t> by_path;
  Config defaults;
};

// Shown for a redacted secret.
inline constexpr char kRedacted[] = "<redacted>";
// listen.admin_socket's value for "no admin socket".
inline constexpr char kAdminSocketNone[] = "none";
// How the size syntax is described in errors.
extern const char kSizeSyntax[];

const Schema& GetSchema();
const KeySpec* FindKey(absl::string_view path);  // nullptr when unknown.
bool IsSection(absl::string_view name);
absl::string_view SectionOf(absl::string_view path);  // "pool" of "pool.capacity".
absl::string_view LeafOf(absl::string_view path);     // "capacity" of "pool.capacity".
// Parses `text` as `spec`'s value and stores it; errors name the key and say what is allowed.
absl::Status ParseAndStore(const KeySpec& spec, absl::string_view text, Config* config);
// The canonical text of `spec`'s value in `config`.
Formatted FormatValue(const KeySpec& spec, const Config& config);
std::string FormatSize(uint64_t bytes);
std::string FormatDouble(double value);
std::string Quoted(absl::string_view s);    // 'like this', for messages.
std::string QuoteYaml(absl::string_view s);  // A double-quoted YAML scalar.
// "unknown key 'x' (did you mean 'y'?)".
std::string UnknownKey(absl::string_view path);

}  // namespace kvcellar::server::config_schema

#endif  // KVCELLAR_SERVER_CONFIG_CONFIG_SCHEMA_H_
