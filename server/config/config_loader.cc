// Loading the effective config: the defaults, then the YAML file (every problem found, each
// with FILE:LINE:COL), then the --set overrides, then the checks across keys.
#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/config/config.h"
#include "server/config/config_schema.h"
#include "server/config/tenant_grant.h"
#include "server/config/tenant_quota.h"

namespace kvcellar::server {
namespace {

using config_schema::FindKey;
using config_schema::FormatDouble;
using config_schema::FormatSize;
using config_schema::FormatValue;
using config_schema::GetSchema;
using config_schema::IsSection;
using config_schema::KeySpec;
using config_schema::LeafOf;
using config_schema::ParseAndStore;
using config_schema::Quoted;
using config_schema::SectionOf;
using config_schema::UnknownKey;
using config_schema::kSizeSyntax;

// ---- The YAML file ------------------------------------------------------------------------

std::string NodeKind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Null:
      return "no value";
    case YAML::NodeType::Scalar:
      return Quoted(node.Scalar());
    default:
      return "nothing";
  }
}

std::string ExpectedValue(const KeySpec& spec) {
  switch (spec.type) {
    case ConfigType::kString:
      return "a string";
    case ConfigType::kInt:
      return "an integer";
    case ConfigType::kDurationMs:
      return "an integer number of milliseconds";
    case ConfigType::kSize:
      return kSizeSyntax;
    case ConfigType::kDouble:
      return "a number";
    case ConfigType::kChoice:
      return spec.constraint;
    case ConfigType::kFileMode:
      return "an octal mode string like \"0660\"";
    case ConfigType::kBool:
      return "true or false";
  }
  return "a value";
}

// Where the YAML parser stops making progress, if it does. yaml-cpp 0.7.0 (Debian 12) never
// consumes a ',' where a document's first node should be (a file that is just ",", or ", x"): its
// parser reports the same empty document again and again, and YAML::LoadAll collects them until
// memory runs out (found by tests/fuzz/config_yaml_fuzz.cc). So the documents are walked first
// with a handler that builds nothing and stops at a document starting where the previous one did.
class StuckDocumentFinder : public YAML::EventHandler {
 public:
  static std::optional<YAML::Mark> Find(const std::string& content) {
    std::istringstream in(content);
    YAML::Parser parser(in);
    StuckDocumentFinder finder;
    while (!finder.stuck_ && parser.HandleNextDocument(finder)) {
    }
    return finder.stuck_;
  }

 private:
  void OnDocumentStart(const YAML::Mark& mark) override {
    if (last_start_ && last_start_->pos >= mark.pos) stuck_ = mark;
    last_start_ = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

  std::optional<YAML::Mark> last_start_;
  std::optional<YAML::Mark> stuck_;
};

class FileLoader {
 public:
  FileLoader(absl::string_view file, Config* config, std::vector<std::string>* errors)
      : file_(file), config_(config), errors_(errors) {}

  void Load(absl::string_view content) {
    std::vector<YAML::Node> documents;
    try {
      const std::string text(content);
      if (std::optional<YAML::Mark> stuck = StuckDocumentFinder::Find(text)) {
        const size_t pos = static_cast<size_t>(stuck->pos);
        Error(*stuck, absl::StrCat("YAML syntax error: unexpected ",
                                   Quoted(pos < text.size() ? text.substr(pos, 1) : ""),
                                   " where a document should start"));
        return;
      }
      documents = YAML::LoadAll(text);
    } catch (const YAML::Exception& e) {
      Error(e.mark, absl::StrCat("YAML syntax error: ", e.msg, TabHint(content, e.mark)));
      return;
    }
    if (documents.empty()) return;  // An empty file: all defaults.
    if (documents.size() > 1) {
      Error(documents[1].Mark(),
            absl::StrCat("holds ", documents.size(), " YAML documents; expected one"));
      return;
    }
    const YAML::Node& root = documents[0];
    if (root.IsNull()) return;  // Only comments.
    if (!root.IsMap()) {
      Error(root.Mark(), absl::StrCat("expected a mapping of sections (listen:, pool:, ...), got ",
                                      NodeKind(root)));
      return;
    }
    absl::flat_hash_set<std::string> seen;
    for (auto it = root.begin(); it != root.end(); ++it) {
      std::optional<std::string> name = KeyName(it->first, "", &seen);
      if (name) LoadSection(*name, it->first, it->second);
    }
  }

 private:
  void LoadSection(const std::string& name, const YAML::Node& key, const YAML::Node& value) {
    if (!IsSection(name)) {
      if (FindKey(name) != nullptr) {
        Error(key.Mark(),
              absl::StrCat(Quoted(name), " must be nested: write ",
                           Quoted(absl::StrCat(SectionOf(name), ":")), " then ",
                           Quoted(absl::StrCat(LeafOf(name), ": ...")), " indented below it"));
      } else {
        Error(key.Mark(), UnknownKey(name));
      }
      return;
    }
    if (value.IsNull()) return;  // `pool:` with nothing under it.
    if (!value.IsMap()) {
      Error(value.Mark(), absl::StrCat(Quoted(name),
                                       " is a section and expects a mapping of its "
                                       "keys, got ",
                                       NodeKind(value)));
      return;
    }
    absl::flat_hash_set<std::string> seen;
    for (auto it = value.begin(); it != value.end(); ++it) {
      std::optional<std::string> leaf = KeyName(it->first, name, &seen);
      if (!leaf) continue;
      std::string path = absl::StrCat(name, ".", *leaf);
      const KeySpec* spec = FindKey(path);
      if (spec == nullptr) {
        Error(it->first.Mark(), UnknownKey(path));
        continue;
      }
      LoadLeaf(*spec, it->second);
    }
  }

  void LoadLeaf(const KeySpec& spec, const YAML::Node& value) {
    if (value.IsNull()) {
      const std::string& default_value =
          GetSchema().infos[GetSchema().by_path.at(spec.path)].default_value;
      Error(value.Mark(), absl::StrCat(Quoted(spec.path),
                                       " has no value; give one (\"\" for an empty string), "
                                       "or remove the key for the default (",
                                       default_value.empty() ? "\"\"" : default_value, ")"));
      return;
    }
    std::string text;
    if (spec.list_separator != '\0' && value.IsSequence()) {
      // A list key may also be written as a YAML sequence of scalars: joined into its string.
      for (const YAML::Node& item : value) {
        if (!item.IsScalar()) {
          Error(item.Mark(), absl::StrCat(Quoted(spec.path), " items must be strings, got ",
                                          NodeKind(item)));
          return;
        }
        if (!text.empty()) text += spec.list_separator;
        text += item.Scalar();
      }
    } else if (!value.IsScalar()) {
      Error(value.Mark(), absl::StrCat(Quoted(spec.path), " expects ", ExpectedValue(spec),
                                       ", got ", NodeKind(value)));
      return;
    } else {
      text = value.Scalar();
    }
    if (absl::Status st = ParseAndStore(spec, text, config_); !st.ok()) {
      Error(value.Mark(), std::string(st.message()));
    }
  }

  // YAML forbids tabs in indentation and yaml-cpp's message then says nothing of tabs.
  static std::string TabHint(absl::string_view content, const YAML::Mark& mark) {
    int line = 0;
    for (absl::string_view text : absl::StrSplit(content, '\n')) {
      ++line;
      if (mark.is_null() || line > mark.line + 1) break;
      absl::string_view indent = text.substr(0, text.find_first_not_of(" \t"));
      if (absl::StrContains(indent, '\t')) {
        return absl::StrCat(" (line ", line, " indents with a tab; YAML allows spaces only)");
      }
    }
    return "";
  }

  // The text of a mapping key, or nullopt after reporting why it is unusable.
  std::optional<std::string> KeyName(const YAML::Node& key, absl::string_view section,
                                     absl::flat_hash_set<std::string>* seen) {
    if (!key.IsScalar()) {
      Error(key.Mark(), absl::StrCat("keys must be plain names, got ", NodeKind(key)));
      return std::nullopt;
    }
    std::string name = key.Scalar();
    if (!seen->insert(name).second) {
      Error(key.Mark(),
            absl::StrCat("duplicate key ",
                         Quoted(section.empty() ? name : absl::StrCat(section, ".", name))));
      return std::nullopt;
    }
    return name;
  }

  void Error(const YAML::Mark& mark, absl::string_view message) {
    if (mark.is_null()) {
      errors_->push_back(absl::StrCat(file_, ": ", message));
    } else {
      errors_->push_back(
          absl::StrCat(file_, ":", mark.line + 1, ":", mark.column + 1, ": ", message));
    }
  }

  std::string file_;
  Config* config_;
  std::vector<std::string>* errors_;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open config file ", Quoted(path)));
  }
  std::string content;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("cannot read config file ", Quoted(path)));
    }
    if (n == 0) break;
    content.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return content;
}

// ---- --set --------------------------------------------------------------------------------

void ApplyOverride(absl::string_view arg, Config* config, std::vector<std::string>* errors) {
  std::string where = absl::StrCat("--set ", Quoted(arg), ": ");
  size_t eq = arg.find('=');
  if (eq == absl::string_view::npos) {
    errors->push_back(absl::StrCat(where, "expected key=value"));
    return;
  }
  absl::string_view path = absl::StripAsciiWhitespace(arg.substr(0, eq));
  absl::string_view value = arg.substr(eq + 1);
  if (path.empty()) {
    errors->push_back(absl::StrCat(where, "expected key=value"));
    return;
  }
  if (IsSection(path)) {
    std::string example;
    for (const KeySpec& spec : GetSchema().keys) {
      if (SectionOf(spec.path) == path) {
        example = spec.path;
        break;
      }
    }
    errors->push_back(absl::StrCat(where, Quoted(path),
                                   " is a section, not a key; set one of its keys, e.g. ",
                                   Quoted(example)));
    return;
  }
  const KeySpec* spec = FindKey(path);
  if (spec == nullptr) {
    errors->push_back(absl::StrCat(where, UnknownKey(path)));
    return;
  }
  if (absl::Status st = ParseAndStore(*spec, value, config); !st.ok()) {
    errors->push_back(absl::StrCat(where, st.message()));
  }
}

// ---- Checks across keys, on the merged config ---------------------------------------------

std::string CheckReadableFile(absl::string_view key, const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::StrCat(Quoted(key), " cannot be read: ", Quoted(path), ": ", strerror(errno));
  }
  struct stat st;
  std::string why;
  if (fstat(fd, &st) != 0) {
    why = absl::StrCat(Quoted(key), " cannot be read: ", Quoted(path), ": ", strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    why = absl::StrCat(Quoted(key), " must name a regular file: ", Quoted(path));
  } else if (st.st_size == 0) {
    why = absl::StrCat(Quoted(key), " names an empty file: ", Quoted(path));
  }
  close(fd);
  return why;
}

void CheckTls(const Config& config, std::vector<std::string>* errors) {
  const TlsConfig& tls = config.tls;
  const std::string mode = Quoted(FormatValue(*FindKey("tls.mode"), config).text);
  struct TlsFile {
    const char* key;
    const std::string& path;
    bool needed;  // By this mode.
  };
  const TlsFile files[] = {
      {"tls.cert_file", tls.cert_file, tls.mode != TlsMode::kPlaintext},
      {"tls.key_file", tls.key_file, tls.mode != TlsMode::kPlaintext},
      {"tls.client_ca_file", tls.client_ca_file, tls.mode == TlsMode::kMtls},
  };
  if (tls.mode != TlsMode::kPlaintext && config.listen.tcp_address.empty()) {
    errors->push_back(absl::StrCat("'tls.mode' is ", mode,
                                   " but 'listen.tcp_address' is \"\": TLS applies to the TCP "
                                   "listener only; set one, or set tls.mode to plaintext"));
  }
  for (const TlsFile& f : files) {
    if (f.needed && f.path.empty()) {
      errors->push_back(absl::StrCat("'tls.mode' ", mode, " needs ", Quoted(f.key)));
    } else if (!f.needed && !f.path.empty()) {
      // A security setting that silently does nothing misleads: refuse it.
      errors->push_back(absl::StrCat(
          Quoted(f.key), " is set but 'tls.mode' is ", mode, ", which does not use it; ",
          tls.mode == TlsMode::kTls ? "set tls.mode to mtls to verify client certificates"
                                    : "set tls.mode to tls or mtls",
          ", or remove it"));
    } else if (!f.path.empty()) {
      std::string why = CheckReadableFile(f.key, f.path);
      if (!why.empty()) errors->push_back(why);
    }
  }
}

// A subject grant matches only a verified client certificate, which only mtls asks for.
void CheckTenantGrants(const Config& config, std::vector<std::string>* errors) {
  if (config.tls.mode == TlsMode::kMtls) return;
  absl::StatusOr<std::vector<TenantGrant>> grants = ParseTenantGrants(config.tenants.allow);
  if (!grants.ok()) return;  // The key's own check reported it.
  for (const TenantGrant& g : *grants) {
    if (g.kind != TenantGrant::Kind::kSubject) continue;
    errors->push_back(absl::StrCat(
        "'tenants.allow' grants tenant ", Quoted(g.tenant.substr(0, 80)),
        " to a certificate subject, but 'tls.mode' is not mtls: no peer presents a verified "
        "certificate; set tls.mode to mtls, or grant a uid or gid"));
    return;
  }
}

// Quotas in bytes need the pool's size: a ceiling below its guarantee once both are bytes,
// guarantees summing above the pool.
void CheckTenantQuotaSums(const Config& config, std::vector<std::string>* errors) {
  absl::StatusOr<std::vector<TenantQuotaSpec>> quotas = ParseTenantQuotas(config.tenants.quotas);
  if (!quotas.ok()) return;  // The key's own check reported it.
  absl::StatusOr<std::vector<TenantQuotaBytes>> bytes =
      ResolveTenantQuotas(*quotas, config.pool.capacity);
  if (!bytes.ok()) errors->push_back(std::string(bytes.status().message()));
}

std::vector<std::string> CrossCheck(const Config& config) {
  std::vector<std::string> errors;
  const PoolConfig& pool = config.pool;
  if (!(pool.low_watermark < pool.high_watermark)) {
    errors.push_back(absl::StrCat("'pool.low_watermark' (", FormatDouble(pool.low_watermark),
                                  ") must be below 'pool.high_watermark' (",
                                  FormatDouble(pool.high_watermark), ")"));
  }
  if (pool.region_size != 0 && pool.capacity % pool.region_size != 0) {
    errors.push_back(absl::StrCat("'pool.capacity' (", FormatSize(pool.capacity),
                                  ") must be a multiple of 'pool.region_size' (",
                                  FormatSize(pool.region_size), ")"));
  }
  CheckTls(config, &errors);
  CheckTenantGrants(config, &errors);
  CheckTenantQuotaSums(config, &errors);
  const ListenConfig& listen = config.listen;
  if (!listen.unix_socket.empty() && listen.admin_socket == listen.unix_socket) {
    errors.push_back(absl::StrCat("'listen.admin_socket' and 'listen.unix_socket' are both ",
                                  Quoted(listen.unix_socket), "; admin needs its own socket"));
  }
  // Port 0 asks the kernel for a free port, so two listeners given ":0" never collide.
  if (!listen.tcp_address.empty() && listen.tcp_address == config.http.address &&
      !absl::EndsWith(listen.tcp_address, ":0")) {
    errors.push_back(absl::StrCat("'listen.tcp_address' and 'http.address' are both ",
                                  Quoted(listen.tcp_address)));
  }
  return errors;
}

}  // namespace

absl::StatusOr<Config> LoadConfig(const std::optional<std::string>& file,
                                  absl::Span<const std::string> overrides) {
  Config config = DefaultConfig();
  std::vector<std::string> errors;
  if (file.has_value()) {
    absl::StatusOr<std::string> content = ReadFile(*file);
    if (!content.ok()) return content.status();
    FileLoader(*file, &config, &errors).Load(*content);
  }
  for (const std::string& override : overrides) ApplyOverride(override, &config, &errors);
  // Checks across keys need every key valid first: their messages would only mislead.
  if (errors.empty()) errors = CrossCheck(config);
  if (!errors.empty()) return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
  return config;
}

}  // namespace kvcellar::server
