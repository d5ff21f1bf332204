// The Config's defaults, canonical YAML and digest, and the socket paths it resolves.
#include "server/config/config.h"

#include <openssl/evp.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "platform/runtime_paths.h"
#include "server/config/config_schema.h"

namespace kvcellar::server {

using config_schema::FindKey;
using config_schema::Formatted;
using config_schema::FormatValue;
using config_schema::GetSchema;
using config_schema::kAdminSocketNone;
using config_schema::kRedacted;
using config_schema::KeySpec;
using config_schema::LeafOf;
using config_schema::QuoteYaml;
using config_schema::SectionOf;

absl::string_view ConfigTypeName(ConfigType type) {
  switch (type) {
    case ConfigType::kString:
      return "string";
    case ConfigType::kInt:
      return "integer";
    case ConfigType::kDouble:
      return "number";
    case ConfigType::kSize:
      return "size";
    case ConfigType::kDurationMs:
      return "duration in ms";
    case ConfigType::kChoice:
      return "choice";
    case ConfigType::kFileMode:
      return "octal mode";
    case ConfigType::kBool:
      return "boolean";
  }
  return "unknown";
}

const std::vector<ConfigKeyInfo>& ConfigSchema() { return GetSchema().infos; }

Config DefaultConfig() { return GetSchema().defaults; }

namespace config_internal {

std::string ConfigToYaml(const Config& config,
                         absl::FunctionRef<bool(absl::string_view path)> redact) {
  std::string out;
  absl::string_view section;
  for (const KeySpec& spec : GetSchema().keys) {
    absl::string_view this_section = SectionOf(spec.path);
    if (this_section != section) {
      if (!section.empty()) out.push_back('\n');
      absl::StrAppend(&out, this_section, ":\n");
      section = this_section;
    }
    Formatted value = FormatValue(spec, config);
    if (redact(spec.path) && !value.text.empty()) value = {kRedacted, true};
    absl::StrAppend(&out, "  ", LeafOf(spec.path), ": ",
                    value.quote ? QuoteYaml(value.text) : value.text, "\n");
  }
  return out;
}

}  // namespace config_internal

std::string ConfigToYaml(const Config& config, bool redact_secrets) {
  return config_internal::ConfigToYaml(
      config, [&](absl::string_view path) { return redact_secrets && FindKey(path)->secret; });
}

std::string ConfigDigest(const Config& config) {
  const std::string yaml = ConfigToYaml(config, /*redact_secrets=*/true);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(yaml.data(), yaml.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    return "";  // Only on allocation failure inside OpenSSL.
  }
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&hex, "%02x", digest[i]);
  return hex;
}

std::string ResolveUnixSocketPath(const Config& config) {
  if (!config.listen.unix_socket.empty()) return config.listen.unix_socket;
  return platform::DefaultSocketPath(platform::kDefaultSocketName);
}

std::optional<std::string> ResolveAdminSocketPath(const Config& config) {
  const std::string& admin = config.listen.admin_socket;
  if (admin == kAdminSocketNone) return std::nullopt;
  if (!admin.empty()) return admin;
  if (config.listen.unix_socket.empty()) {
    return platform::DefaultSocketPath(platform::kDefaultAdminSocketName);
  }
  // Beside an explicit unix_socket.
  const std::string& socket = config.listen.unix_socket;
  size_t slash = socket.rfind('/');
  if (slash == std::string::npos) return std::string(platform::kDefaultAdminSocketName);
  return absl::StrCat(socket.substr(0, slash + 1), platform::kDefaultAdminSocketName);
}

}  // namespace kvcellar::server
