#include "server/config/config.h"

#include <grp.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "platform/runtime_paths.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

std::string Fixture(const std::string& name) {
  return absl::StrCat(KVCELLAR_TEST_DATA_DIR, "/config/", name);
}

std::string ShippedConfig() { return absl::StrCat(KVCELLAR_SOURCE_DIR, "/config/kvcellard.yaml"); }

// A fresh directory per test; files written there vanish with the test's temp dir.
class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = absl::StrCat(::testing::TempDir(), "/config_test.XXXXXX");
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << strerror(errno);
    dir_ = templ;
  }

  void TearDown() override {
    for (const std::string& path : files_) unlink(path.c_str());
    rmdir(dir_.c_str());
  }

  std::string WriteFile(const std::string& name, const std::string& content) {
    std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path) << content;
    files_.push_back(path);
    return path;
  }

  absl::StatusOr<Config> LoadText(const std::string& yaml,
                                  const std::vector<std::string>& overrides = {}) {
    return LoadConfig(WriteFile("config.yaml", yaml), overrides);
  }

  absl::StatusOr<Config> LoadSets(const std::vector<std::string>& overrides) {
    return LoadConfig(std::nullopt, overrides);
  }

  std::string dir_;
  std::vector<std::string> files_;
};

std::string ErrorOf(const absl::StatusOr<Config>& result) {
  EXPECT_FALSE(result.ok());
  return std::string(result.status().message());
}

// ---- Defaults and the shipped file --------------------------------------------------------

TEST_F(ConfigTest, DefaultsMatchTheSpec) {
  Config c = DefaultConfig();
  EXPECT_EQ(c.listen.unix_socket, "");
  EXPECT_EQ(c.listen.unix_socket_mode, 0660u);
  EXPECT_EQ(c.listen.unix_socket_group, "");
  EXPECT_EQ(c.listen.admin_socket, "");
  EXPECT_EQ(c.listen.admin_socket_mode, 0600u);
  EXPECT_EQ(c.listen.tcp_address, "");
  EXPECT_EQ(c.tls.mode, TlsMode::kPlaintext);
  EXPECT_EQ(c.http.address, "127.0.0.1:9740");
  EXPECT_EQ(c.log.level, platform::LogLevel::kInfo);
  EXPECT_EQ(c.log.format, LogFormat::kKv);
  EXPECT_EQ(c.server.drain_timeout_ms, 5000);
  EXPECT_EQ(c.server.max_batch_pages, 65536);
  EXPECT_EQ(c.server.max_message_bytes, 64 * kMiB);
  EXPECT_EQ(c.pool.capacity, kGiB);
  EXPECT_EQ(c.pool.region_size, 64 * kMiB);
  EXPECT_EQ(c.pool.huge_pages, HugePages::kAuto);
  EXPECT_EQ(c.pool.shm_name, "");
  EXPECT_DOUBLE_EQ(c.pool.high_watermark, 0.95);
  EXPECT_DOUBLE_EQ(c.pool.low_watermark, 0.90);
  EXPECT_EQ(c.eviction.policy, EvictionPolicy::kAdaptive);
  EXPECT_EQ(c.sessions.lease_ms, 10000);
  EXPECT_EQ(c.sessions.pin_lease_ms, 30000);
  EXPECT_EQ(c.device.kind, DeviceKind::kAuto);
  EXPECT_TRUE(c.device.host_memory_engines);

  absl::StatusOr<Config> loaded = LoadConfig(std::nullopt, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, c);
}

TEST_F(ConfigTest, ShippedFileEqualsDefaults) {
  absl::StatusOr<Config> shipped = LoadConfig(ShippedConfig(), {});
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  EXPECT_EQ(ConfigToYaml(*shipped, false), ConfigToYaml(DefaultConfig(), false));
  EXPECT_EQ(*shipped, DefaultConfig());
}

TEST_F(ConfigTest, ShippedFileSpellsOutEveryKey) {
  YAML::Node root = YAML::LoadFile(ShippedConfig());
  for (const ConfigKeyInfo& key : ConfigSchema()) {
    std::string section = key.path.substr(0, key.path.find('.'));
    std::string leaf = key.path.substr(key.path.find('.') + 1);
    ASSERT_TRUE(root[section].IsMap()) << "config/kvcellard.yaml lacks section " << section;
    EXPECT_TRUE(root[section][leaf].IsDefined()) << "config/kvcellard.yaml lacks " << key.path;
  }
}

TEST_F(ConfigTest, SchemaIsWellFormed) {
  std::map<std::string, int> seen;
  for (const ConfigKeyInfo& key : ConfigSchema()) {
    EXPECT_EQ(seen[key.path]++, 0) << "duplicate " << key.path;
    EXPECT_FALSE(key.doc.empty()) << key.path;
    EXPECT_EQ(std::count(key.path.begin(), key.path.end(), '.'), 1) << key.path;
    EXPECT_EQ(key.type == ConfigType::kChoice, !key.choices.empty()) << key.path;
    EXPECT_EQ(key.type == ConfigType::kDurationMs, absl::EndsWith(key.path, "_ms")) << key.path;
    // Secrets are strings: redaction replaces a string.
    if (key.secret) {
      EXPECT_EQ(key.type, ConfigType::kString) << key.path;
    }
    EXPECT_FALSE(ConfigTypeName(key.type).empty());
    // Every default, as listed, reads back through --set to the defaults.
    absl::StatusOr<Config> c = LoadSets({absl::StrCat(key.path, "=", key.default_value)});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(*c, DefaultConfig()) << key.path;
  }
}

TEST_F(ConfigTest, EmptyFileIsDefaults) {
  for (const char* name : {"empty.yaml", "comments_only.yaml"}) {
    absl::StatusOr<Config> c = LoadConfig(Fixture(name), {});
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(*c, DefaultConfig()) << name;
  }
  // A section with nothing under it is empty, not an error.
  absl::StatusOr<Config> c = LoadText("pool:\nlog:\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, DefaultConfig());
}

// ---- Files --------------------------------------------------------------------------------

TEST_F(ConfigTest, ValidFile) {
  absl::StatusOr<Config> c = LoadConfig(Fixture("valid.yaml"), {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.unix_socket, "/run/kvcellar/engines.sock");
  EXPECT_EQ(c->listen.unix_socket_mode, 0640u);
  EXPECT_EQ(c->listen.admin_socket, "none");
  EXPECT_EQ(c->listen.tcp_address, "0.0.0.0:9741");
  EXPECT_EQ(c->http.address, "");
  EXPECT_EQ(c->log.level, platform::LogLevel::kDebug);
  EXPECT_EQ(c->server.drain_timeout_ms, 20000);
  EXPECT_EQ(c->server.max_batch_pages, 4096);
  EXPECT_EQ(c->server.max_message_bytes, 128 * kMiB);
  EXPECT_EQ(c->pool.capacity, 8 * kGiB);
  EXPECT_EQ(c->pool.region_size, 256 * kMiB);
  EXPECT_EQ(c->pool.huge_pages, HugePages::kOn);
  EXPECT_EQ(c->pool.shm_name, "/kvcellar-pool");
  EXPECT_DOUBLE_EQ(c->pool.high_watermark, 0.9);
  EXPECT_DOUBLE_EQ(c->pool.low_watermark, 0.8);
  EXPECT_EQ(c->eviction.policy, EvictionPolicy::kLru);
  EXPECT_EQ(c->sessions.lease_ms, 5000);
  EXPECT_EQ(c->sessions.pin_lease_ms, 15000);
  EXPECT_EQ(c->device.kind, DeviceKind::kSim);
  // Keys the file leaves out keep their defaults.
  EXPECT_EQ(c->listen.admin_socket_mode, 0600u);
  EXPECT_EQ(c->tls.mode, TlsMode::kPlaintext);
}

TEST_F(ConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<Config> c = LoadConfig(absl::StrCat(dir_, "/absent.yaml"), {});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("absent.yaml"));
}

TEST_F(ConfigTest, UnknownKeySuggestsTheNearestKey) {
  std::string error = ErrorOf(LoadConfig(Fixture("unknown_key.yaml"), {}));
  EXPECT_THAT(error, HasSubstr("unknown key 'listen.unix_sockt' (did you mean "
                               "'listen.unix_socket'?)"));
  EXPECT_THAT(error, HasSubstr("unknown_key.yaml:3:3: "));  // Where the key is.

  EXPECT_THAT(ErrorOf(LoadText("pool:\n  capactiy: 1GiB\n")),
              HasSubstr("unknown key 'pool.capactiy' (did you mean 'pool.capacity'?)"));
  EXPECT_THAT(ErrorOf(LoadText("pol:\n  capacity: 1GiB\n")),
              HasSubstr("unknown key 'pol' (did you mean 'pool'?)"));
  // The right key name in the wrong section.
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  policy: lru\n")),
              HasSubstr("unknown key 'pool.policy' (did you mean 'eviction.policy'?)"));
  // A dotted key at the top level is a known key written flat.
  EXPECT_THAT(ErrorOf(LoadText("pool.capacity: 1GiB\n")),
              HasSubstr("'pool.capacity' must be nested"));
}

TEST_F(ConfigTest, UnknownKeyWithoutNearMissHasNoSuggestion) {
  std::string error = ErrorOf(LoadConfig(Fixture("unknown_key_far.yaml"), {}));
  EXPECT_THAT(error, HasSubstr("unknown key 'pool.zebra_stripes'"));
  EXPECT_THAT(error, HasSubstr("unknown key 'bogus'"));
  EXPECT_THAT(error, Not(HasSubstr("did you mean")));
}

TEST_F(ConfigTest, WrongType) {
  std::string error = ErrorOf(LoadConfig(Fixture("wrong_type.yaml"), {}));
  EXPECT_THAT(error, HasSubstr("'server.max_batch_pages' expects an integer, got 'abc'"));
  EXPECT_THAT(error, HasSubstr("wrong_type.yaml:2:20: "));

  EXPECT_THAT(ErrorOf(LoadText("pool:\n  high_watermark: lots\n")),
              HasSubstr("'pool.high_watermark' expects a number, got 'lots'"));
  EXPECT_THAT(ErrorOf(LoadText("sessions:\n  lease_ms: 10s\n")),
              HasSubstr("'sessions.lease_ms' expects an integer number of milliseconds, got "
                        "'10s'"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  capacity: [1, 2]\n")),
              HasSubstr("'pool.capacity' expects a size"));
  EXPECT_THAT(ErrorOf(LoadText("log:\n  level: {a: b}\n")),
              HasSubstr("'log.level' expects one of debug, info, warn, error, got a mapping"));
  EXPECT_THAT(ErrorOf(LoadText("listen:\n  unix_socket_mode: rw-rw----\n")),
              HasSubstr("'listen.unix_socket_mode' expects an octal mode string like \"0660\", "
                        "got 'rw-rw----'"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  shm_name:\n")), HasSubstr("'pool.shm_name' has no value"));
}

TEST_F(ConfigTest, OutOfRange) {
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  high_watermark: 1.5\n")),
              HasSubstr("'pool.high_watermark' must be in (0, 1], got 1.5"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  high_watermark: 0\n")),
              HasSubstr("'pool.high_watermark' must be in (0, 1], got 0"));
  EXPECT_THAT(ErrorOf(LoadText("server:\n  drain_timeout_ms: 600001\n")),
              HasSubstr("'server.drain_timeout_ms' must be in [0, 600000], got 600001"));
  EXPECT_THAT(ErrorOf(LoadText("server:\n  max_batch_pages: 0\n")),
              HasSubstr("'server.max_batch_pages' must be in [1, 1048576], got 0"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  capacity: 32MiB\n")),
              HasSubstr("'pool.capacity' must be at least 64MiB, got 32MiB"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  region_size: 3MiB\n")),
              HasSubstr("'pool.region_size' must be a multiple of 2MiB, got 3MiB"));
  EXPECT_THAT(ErrorOf(LoadText("server:\n  max_message_bytes: 2GiB\n")),
              HasSubstr("'server.max_message_bytes' must be in [1MiB, 1GiB], got 2GiB"));
  EXPECT_THAT(ErrorOf(LoadText("listen:\n  unix_socket_mode: \"4755\"\n")),
              HasSubstr("'listen.unix_socket_mode' must be at most 0777"));
  EXPECT_THAT(ErrorOf(LoadText("listen:\n  admin_socket_mode: \"0666\"\n")),
              HasSubstr("'listen.admin_socket_mode' must grant nothing to others (whoever can "
                        "connect may call admin RPCs), got '0666'"));
  EXPECT_THAT(
      ErrorOf(LoadText(absl::StrCat("listen:\n  unix_socket: /", std::string(120, 'a'), "\n"))),
      HasSubstr("'listen.unix_socket' is 121 bytes long"));
}

TEST_F(ConfigTest, InvalidChoice) {
  EXPECT_THAT(ErrorOf(LoadText("log:\n  level: verbose\n")),
              HasSubstr("'log.level' must be one of debug, info, warn, error, got 'verbose'"));
  EXPECT_THAT(ErrorOf(LoadText("log:\n  format: json\n")),
              HasSubstr("'log.format' must be one of kv, got 'json'"));
  // Choices are case-sensitive words, not YAML booleans.
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  huge_pages: yes\n")),
              HasSubstr("'pool.huge_pages' must be one of auto, on, off, got 'yes'"));
}

TEST_F(ConfigTest, EveryChoiceMapsToItsEnumerator) {
  struct Case {
    std::string set;
    bool (*check)(const Config&);
  };
  const Case cases[] = {
      {"log.level=debug",
       [](const Config& c) { return c.log.level == platform::LogLevel::kDebug; }},
      {"log.level=info", [](const Config& c) { return c.log.level == platform::LogLevel::kInfo; }},
      {"log.level=warn", [](const Config& c) { return c.log.level == platform::LogLevel::kWarn; }},
      {"log.level=error",
       [](const Config& c) { return c.log.level == platform::LogLevel::kError; }},
      {"log.format=kv", [](const Config& c) { return c.log.format == LogFormat::kKv; }},
      {"tls.mode=plaintext", [](const Config& c) { return c.tls.mode == TlsMode::kPlaintext; }},
      {"pool.huge_pages=auto",
       [](const Config& c) { return c.pool.huge_pages == HugePages::kAuto; }},
      {"pool.huge_pages=on", [](const Config& c) { return c.pool.huge_pages == HugePages::kOn; }},
      {"pool.huge_pages=off", [](const Config& c) { return c.pool.huge_pages == HugePages::kOff; }},
      {"eviction.policy=s3fifo",
       [](const Config& c) { return c.eviction.policy == EvictionPolicy::kS3Fifo; }},
      {"eviction.policy=lru",
       [](const Config& c) { return c.eviction.policy == EvictionPolicy::kLru; }},
      {"eviction.policy=adaptive",
       [](const Config& c) { return c.eviction.policy == EvictionPolicy::kAdaptive; }},
      {"device.kind=auto", [](const Config& c) { return c.device.kind == DeviceKind::kAuto; }},
      {"device.kind=cuda", [](const Config& c) { return c.device.kind == DeviceKind::kCuda; }},
      {"device.kind=sim", [](const Config& c) { return c.device.kind == DeviceKind::kSim; }},
  };
  for (const Case& tc : cases) {
    absl::StatusOr<Config> c = LoadSets({tc.set});
    ASSERT_TRUE(c.ok()) << tc.set << ": " << c.status();
    EXPECT_TRUE(tc.check(*c)) << tc.set;
  }
  // The log level names are core's names.
  for (auto level : {platform::LogLevel::kDebug, platform::LogLevel::kInfo, platform::LogLevel::kWarn,
                     platform::LogLevel::kError}) {
    absl::StatusOr<Config> c = LoadSets({absl::StrCat("log.level=", platform::LogLevelName(level))});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->log.level, level);
  }
}

TEST_F(ConfigTest, CudaCopyPathDefaultsToTheCopyEngines) {
  EXPECT_EQ(DefaultConfig().device.cuda_copy_path, CudaCopyPath::kCopyEngine);
  for (const auto& [text, path] :
       {std::pair{"copy_engine", CudaCopyPath::kCopyEngine},
        std::pair{"kernel", CudaCopyPath::kKernel}, std::pair{"auto", CudaCopyPath::kAuto}}) {
    absl::StatusOr<Config> c = LoadSets({absl::StrCat("device.cuda_copy_path=", text)});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->device.cuda_copy_path, path) << text;
    EXPECT_THAT(ConfigToYaml(*c, false),
                HasSubstr(absl::StrCat("  cuda_copy_path: \"", text, "\"\n")));
  }
  const std::string err = ErrorOf(LoadSets({"device.cuda_copy_path=memcpy"}));
  EXPECT_THAT(err, HasSubstr("device.cuda_copy_path"));
  EXPECT_THAT(err, HasSubstr("copy_engine"));
}

TEST_F(ConfigTest, HostMemoryEnginesIsABoolean) {
  absl::StatusOr<Config> off = LoadText("device:\n  kind: cuda\n  host_memory_engines: false\n");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->device.host_memory_engines);
  EXPECT_EQ(off->device.kind, DeviceKind::kCuda);
  absl::StatusOr<Config> on =
      LoadSets({"device.host_memory_engines=false", "device.host_memory_engines=True"});
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->device.host_memory_engines);
  // A boolean prints bare and loads back.
  EXPECT_THAT(ConfigToYaml(*off, false), HasSubstr("  host_memory_engines: false\n"));
  EXPECT_THAT(ConfigToYaml(DefaultConfig(), false), HasSubstr("  host_memory_engines: true\n"));
  EXPECT_NE(ConfigDigest(*off), ConfigDigest(DefaultConfig()));
  // YAML 1.1's yes/no/on/off are not booleans here: ambiguous across YAML readers.
  for (const char* bad : {"yes", "1", "on", ""}) {
    EXPECT_THAT(ErrorOf(LoadSets({absl::StrCat("device.host_memory_engines=", bad)})),
                HasSubstr("'device.host_memory_engines' expects true or false"))
        << bad;
  }
}

TEST_F(ConfigTest, YamlSyntaxErrorHasLineAndColumn) {
  std::string error = ErrorOf(LoadConfig(Fixture("syntax_error.yaml"), {}));
  EXPECT_THAT(error, HasSubstr("syntax_error.yaml:"));
  EXPECT_THAT(error, HasSubstr("YAML syntax error"));
  EXPECT_THAT(error, ::testing::ContainsRegex(R"(syntax_error\.yaml:[0-9]+:[0-9]+: )"));

  std::string indent = ErrorOf(LoadText("pool:\n  capacity: 1GiB\n   region_size: 64MiB\n"));
  EXPECT_THAT(indent, HasSubstr("config.yaml:3:"));
  EXPECT_THAT(ErrorOf(LoadText("pool:\n\tcapacity: 1GiB\n")),
              HasSubstr("line 2 indents with a tab"));
}

// yaml-cpp 0.7.0 loops for ever on a document that starts with ',' (tests/fuzz found it: the
// daemon ran out of memory on a config file of one comma). Each is an error naming the place.
TEST_F(ConfigTest, CommaWhereADocumentStartsIsASyntaxError) {
  for (const char* yaml : {",", " ,", ",x\n", "pool:\n  capacity: 1GiB\n---\n,\n"}) {
    std::string error = ErrorOf(LoadText(yaml));
    EXPECT_THAT(error, HasSubstr("YAML syntax error: unexpected ','")) << yaml;
    EXPECT_THAT(error, ::testing::ContainsRegex(R"(config\.yaml:[0-9]+:[0-9]+: )")) << yaml;
  }
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  capacity: 1GiB\n,\n")), HasSubstr("YAML syntax error"));
}

TEST_F(ConfigTest, SectionGivenAsScalar) {
  std::string error = ErrorOf(LoadConfig(Fixture("section_scalar.yaml"), {}));
  EXPECT_THAT(error,
              HasSubstr("'pool' is a section and expects a mapping of its keys, got '1GiB'"));
  EXPECT_THAT(ErrorOf(LoadText("- pool\n")), HasSubstr("expected a mapping of sections"));
}

TEST_F(ConfigTest, DuplicateKeysAreErrors) {
  EXPECT_THAT(ErrorOf(LoadText("pool:\n  capacity: 1GiB\n  capacity: 2GiB\n")),
              HasSubstr("duplicate key 'pool.capacity'"));
}

TEST_F(ConfigTest, ReportsEveryProblemAtOnce) {
  std::string error =
      ErrorOf(LoadText("log:\n  level: loud\npool:\n  capacity: huge\n", {"device.kind=tpu"}));
  EXPECT_THAT(error, AllOf(HasSubstr("'log.level'"), HasSubstr("'pool.capacity'"),
                           HasSubstr("'device.kind'")));
  EXPECT_EQ(std::count(error.begin(), error.end(), '\n'), 2) << error;
}

// ---- Checks across keys -------------------------------------------------------------------

TEST_F(ConfigTest, WatermarksMustBeOrdered) {
  EXPECT_THAT(ErrorOf(LoadSets({"pool.low_watermark=0.95"})),
              HasSubstr("'pool.low_watermark' (0.95) must be below 'pool.high_watermark' (0.95)"));
  EXPECT_THAT(ErrorOf(LoadSets({"pool.high_watermark=0.5"})),
              HasSubstr("must be below 'pool.high_watermark' (0.5)"));
  // The merged config is checked: a later --set may fix what an earlier one broke.
  EXPECT_TRUE(LoadSets({"pool.high_watermark=0.5", "pool.low_watermark=0.4"}).ok());
}

TEST_F(ConfigTest, CapacityIsWholeRegions) {
  EXPECT_THAT(ErrorOf(LoadSets({"pool.capacity=4GB"})),
              HasSubstr("'pool.capacity' (4GB) must be a multiple of 'pool.region_size' (64MiB)"));
  EXPECT_FALSE(LoadSets({"pool.capacity=4GB", "pool.region_size=2MiB"}).ok());
  EXPECT_TRUE(LoadSets({"pool.capacity=96MiB", "pool.region_size=32MiB"}).ok());
}

TEST_F(ConfigTest, TlsNeedsItsFiles) {
  const std::string tcp = "listen.tcp_address=127.0.0.1:0";
  std::string error = ErrorOf(LoadSets({tcp, "tls.mode=tls"}));
  EXPECT_THAT(error, HasSubstr("'tls.mode' 'tls' needs 'tls.cert_file'"));
  EXPECT_THAT(error, HasSubstr("'tls.mode' 'tls' needs 'tls.key_file'"));
  EXPECT_THAT(error, Not(HasSubstr("client_ca_file")));

  EXPECT_THAT(ErrorOf(LoadSets({tcp, "tls.mode=mtls"})),
              HasSubstr("'tls.mode' 'mtls' needs 'tls.client_ca_file'"));

  std::string missing = absl::StrCat(dir_, "/missing.pem");
  error = ErrorOf(
      LoadSets({tcp, "tls.mode=tls", "tls.cert_file=" + missing, "tls.key_file=" + missing}));
  EXPECT_THAT(error, HasSubstr(absl::StrCat("'tls.cert_file' cannot be read: '", missing,
                                            "': No such file or directory")));
  EXPECT_THAT(error, HasSubstr("'tls.key_file' cannot be read"));

  // A directory and an empty file are not certificates.
  std::string empty = WriteFile("empty.pem", "");
  error =
      ErrorOf(LoadSets({tcp, "tls.mode=tls", "tls.cert_file=" + dir_, "tls.key_file=" + empty}));
  EXPECT_THAT(error, HasSubstr("'tls.cert_file' must name a regular file"));
  EXPECT_THAT(error, HasSubstr("'tls.key_file' names an empty file"));

  std::string cert = WriteFile("cert.pem", "-----BEGIN CERTIFICATE-----\n");
  std::string key = WriteFile("key.pem", "-----BEGIN PRIVATE KEY-----\n");
  std::string ca = WriteFile("ca.pem", "-----BEGIN CERTIFICATE-----\n");
  absl::StatusOr<Config> tls =
      LoadSets({tcp, "tls.mode=tls", "tls.cert_file=" + cert, "tls.key_file=" + key});
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_EQ(tls->tls.mode, TlsMode::kTls);
  EXPECT_EQ(tls->tls.cert_file, cert);
  absl::StatusOr<Config> mtls = LoadSets({tcp, "tls.mode=mtls", "tls.cert_file=" + cert,
                                          "tls.key_file=" + key, "tls.client_ca_file=" + ca});
  ASSERT_TRUE(mtls.ok()) << mtls.status();

  if (geteuid() != 0) {  // root reads anything.
    chmod(key.c_str(), 0);
    EXPECT_THAT(
        ErrorOf(LoadSets({tcp, "tls.mode=tls", "tls.cert_file=" + cert, "tls.key_file=" + key})),
        HasSubstr("'tls.key_file' cannot be read: '" + key + "': Permission denied"));
  }
}

TEST_F(ConfigTest, TlsSettingsThatWouldDoNothingAreRefused) {
  std::string cert = WriteFile("cert.pem", "x");
  std::string key = WriteFile("key.pem", "x");
  std::string ca = WriteFile("ca.pem", "x");
  // TLS applies to TCP only.
  EXPECT_THAT(ErrorOf(LoadSets({"tls.mode=tls", "tls.cert_file=" + cert, "tls.key_file=" + key})),
              HasSubstr("'tls.mode' is 'tls' but 'listen.tcp_address' is \"\""));
  // A client CA without mtls would look like client authentication and not be.
  EXPECT_THAT(
      ErrorOf(LoadSets({"listen.tcp_address=127.0.0.1:0", "tls.mode=tls", "tls.cert_file=" + cert,
                        "tls.key_file=" + key, "tls.client_ca_file=" + ca})),
      HasSubstr("'tls.client_ca_file' is set but 'tls.mode' is 'tls'"));
  EXPECT_THAT(ErrorOf(LoadSets({"tls.cert_file=" + cert})),
              HasSubstr("'tls.cert_file' is set but 'tls.mode' is 'plaintext'"));
}

TEST_F(ConfigTest, ListenersMustDiffer) {
  EXPECT_THAT(
      ErrorOf(LoadSets({"listen.unix_socket=/tmp/k.sock", "listen.admin_socket=/tmp/k.sock"})),
      HasSubstr("'listen.admin_socket' and 'listen.unix_socket' are both"));
  EXPECT_THAT(ErrorOf(LoadSets({"listen.tcp_address=127.0.0.1:9740"})),
              HasSubstr("'listen.tcp_address' and 'http.address' are both '127.0.0.1:9740'"));
}

TEST_F(ConfigTest, AddressesAreHostPort) {
  for (const char* ok :
       {"127.0.0.1:9740", "0.0.0.0:0", "[::]:9741", "[::1]:65535", "localhost:80"}) {
    EXPECT_TRUE(LoadSets({absl::StrCat("http.address=", ok)}).ok()) << ok;
  }
  for (const char* bad :
       {"9740", ":9740", "::1:9740", "host:", "host:port", "host:70000", "a b:80", "[::1:80"}) {
    EXPECT_THAT(ErrorOf(LoadSets({absl::StrCat("http.address=", bad)})),
                HasSubstr("'http.address' "))
        << bad;
  }
}

TEST_F(ConfigTest, SocketGroupMustExist) {
  EXPECT_TRUE(LoadSets({"listen.unix_socket_group=12345"}).ok());
  group* own = getgrgid(getgid());
  if (own != nullptr) {
    EXPECT_TRUE(LoadSets({absl::StrCat("listen.unix_socket_group=", own->gr_name)}).ok());
  }
  EXPECT_THAT(ErrorOf(LoadSets({"listen.unix_socket_group=no-such-group-kvcellar"})),
              HasSubstr("'listen.unix_socket_group' names no group known on this host"));
}

TEST_F(ConfigTest, ShmNameIsOneComponent) {
  EXPECT_TRUE(LoadSets({"pool.shm_name=/kvcellar-pool"}).ok());
  EXPECT_TRUE(LoadSets({"pool.shm_name=kvcellar-pool"}).ok());
  EXPECT_THAT(ErrorOf(LoadSets({"pool.shm_name=/dev/shm/x"})),
              HasSubstr("'pool.shm_name' must be a POSIX shared memory name"));
  EXPECT_FALSE(LoadSets({"pool.shm_name=/"}).ok());
}

// ---- --set --------------------------------------------------------------------------------

TEST_F(ConfigTest, OverridePrecedence) {
  // default < file < --set; among --set, the later wins.
  std::string file = WriteFile("p.yaml", "log:\n  level: warn\npool:\n  capacity: 2GiB\n");
  absl::StatusOr<Config> from_file = LoadConfig(file, {});
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->log.level, platform::LogLevel::kWarn);
  EXPECT_EQ(from_file->pool.capacity, 2 * kGiB);
  EXPECT_EQ(from_file->eviction.policy, EvictionPolicy::kAdaptive);  // Default.

  absl::StatusOr<Config> c = LoadConfig(
      file, {"log.level=error", "pool.capacity=3GiB", "log.level=debug", "eviction.policy=lru"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->log.level, platform::LogLevel::kDebug);
  EXPECT_EQ(c->pool.capacity, 3 * kGiB);
  EXPECT_EQ(c->eviction.policy, EvictionPolicy::kLru);
}

TEST_F(ConfigTest, OverrideErrors) {
  EXPECT_THAT(ErrorOf(LoadSets({"listen.unix_sockt=/x"})),
              HasSubstr("--set 'listen.unix_sockt=/x': unknown key 'listen.unix_sockt' (did you "
                        "mean 'listen.unix_socket'?)"));
  EXPECT_THAT(ErrorOf(LoadSets({"frobnicate=1"})),
              AllOf(HasSubstr("unknown key 'frobnicate'"), Not(HasSubstr("did you mean"))));
  EXPECT_THAT(ErrorOf(LoadSets({"pool.capacity=lots"})),
              HasSubstr("--set 'pool.capacity=lots': 'pool.capacity' expects a size"));
  EXPECT_THAT(ErrorOf(LoadSets({"pool=1GiB"})),
              HasSubstr("'pool' is a section, not a key; set one of its keys, e.g. "
                        "'pool.capacity'"));
  EXPECT_THAT(ErrorOf(LoadSets({"pool.capacity"})), HasSubstr("expected key=value"));
  EXPECT_THAT(ErrorOf(LoadSets({"=1"})), HasSubstr("expected key=value"));
  // The value is verbatim: everything after the first '='.
  absl::StatusOr<Config> c = LoadSets({"listen.unix_socket=/run/a=b.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.unix_socket, "/run/a=b.sock");
}

// ---- Values -------------------------------------------------------------------------------

TEST_F(ConfigTest, SizesWithUnits) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"67108864", 64 * kMiB},
      {"64MiB", 64 * kMiB},
      {"65536KiB", 64 * kMiB},
      {"1GiB", kGiB},
      {"1 GiB", kGiB},
      {"1024MiB", kGiB},
      {"128000000B", 128000000ULL},
      {"100MB", 100000000ULL},
      {"1000000KB", 1000000000ULL},
      {"1GB", 1000000000ULL},
      {" 2MiB ", 2 * kMiB},
  };
  for (const auto& [text, bytes] : cases) {
    absl::StatusOr<Config> c = LoadSets({absl::StrCat("server.max_message_bytes=", text)});
    ASSERT_TRUE(c.ok()) << text << ": " << c.status();
    EXPECT_EQ(c->server.max_message_bytes, bytes) << text;
  }
  absl::StatusOr<Config> tib = LoadSets({"pool.capacity=1TiB"});
  ASSERT_TRUE(tib.ok()) << tib.status();
  EXPECT_EQ(tib->pool.capacity, uint64_t{1} << 40);
  // GB is 10^9: 4GB is 4000000000 bytes, more than 1GiB.
  EXPECT_THAT(ErrorOf(LoadSets({"server.max_message_bytes=4GB"})),
              HasSubstr("must be in [1MiB, 1GiB], got 4GB"));
  EXPECT_THAT(ErrorOf(LoadSets({"server.max_message_bytes=4000000000"})),
              HasSubstr("must be in [1MiB, 1GiB], got 4GB"));
  for (const char* bad : {"1.5GiB", "64mib", "64 M", "-1", "GiB", "64MiBs", "",
                          "99999999999999999999", "20000000TiB"}) {
    EXPECT_THAT(ErrorOf(LoadSets({absl::StrCat("pool.capacity=", bad)})),
                HasSubstr("'pool.capacity' expects a size"))
        << bad;
  }
  // Sizes print in the largest exact unit.
  absl::StatusOr<Config> c =
      LoadSets({"server.max_message_bytes=1048576000", "pool.capacity=4194304KiB"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::string yaml = ConfigToYaml(*c, false);
  EXPECT_THAT(yaml, HasSubstr("  max_message_bytes: \"1000MiB\"\n"));
  EXPECT_THAT(yaml, HasSubstr("  capacity: \"4GiB\"\n"));
}

TEST_F(ConfigTest, ModesAreOctalText) {
  absl::StatusOr<Config> c = LoadText(
      "listen:\n  unix_socket_mode: 0640\n  admin_socket_mode: "
      "\"0700\"\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.unix_socket_mode, 0640u);
  EXPECT_EQ(c->listen.admin_socket_mode, 0700u);
  c = LoadSets({"listen.unix_socket_mode=666"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.unix_socket_mode, 0666u);
  EXPECT_THAT(ConfigToYaml(*c, false), HasSubstr("  unix_socket_mode: \"0666\"\n"));
  EXPECT_FALSE(LoadSets({"listen.unix_socket_mode=0680"}).ok());
  EXPECT_FALSE(LoadSets({"listen.unix_socket_mode=66"}).ok());
}

// ---- Output -------------------------------------------------------------------------------

TEST_F(ConfigTest, YamlRoundTrips) {
  absl::StatusOr<Config> c =
      LoadConfig(Fixture("valid.yaml"),
                 {"listen.unix_socket_group=0", "listen.unix_socket=/run/we\"ird\\path\t.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::string yaml = ConfigToYaml(*c, false);
  absl::StatusOr<Config> again = LoadText(yaml);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << yaml;
  EXPECT_EQ(*again, *c);
  EXPECT_EQ(ConfigToYaml(*again, false), yaml);
  // Every key is present, in schema order.
  size_t at = 0;
  for (const ConfigKeyInfo& key : ConfigSchema()) {
    std::string leaf = absl::StrCat("\n  ", key.path.substr(key.path.find('.') + 1), ": ");
    size_t found = yaml.find(leaf, at);
    ASSERT_NE(found, std::string::npos) << key.path;
    at = found;
  }
  // Defaults print as the schema's default values.
  std::string defaults = ConfigToYaml(DefaultConfig(), false);
  EXPECT_THAT(defaults, HasSubstr("pool:\n  capacity: \"1GiB\"\n  region_size: \"64MiB\"\n"));
  EXPECT_THAT(defaults, HasSubstr("  high_watermark: 0.95\n  low_watermark: 0.9\n"));
  EXPECT_THAT(defaults, HasSubstr("  huge_pages: \"auto\"\n"));
}

TEST_F(ConfigTest, DigestIsStableAndTracksValues) {
  std::string digest = ConfigDigest(DefaultConfig());
  EXPECT_EQ(digest.size(), 64u);
  EXPECT_EQ(digest.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(ConfigDigest(DefaultConfig()), digest);
  // Spelling does not matter, values do.
  absl::StatusOr<Config> same = LoadSets({"pool.capacity=1024MiB", "pool.low_watermark=0.900"});
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(ConfigDigest(*same), digest);
  absl::StatusOr<Config> other = LoadSets({"pool.capacity=2GiB"});
  ASSERT_TRUE(other.ok());
  EXPECT_NE(ConfigDigest(*other), digest);
  absl::StatusOr<Config> level = LoadSets({"log.level=debug"});
  ASSERT_TRUE(level.ok());
  EXPECT_NE(ConfigDigest(*level), digest);
}

TEST_F(ConfigTest, RedactionHidesSecretValues) {
  Config c = DefaultConfig();
  c.tls.key_file = "/etc/kvcellar/hunter2.key";
  auto tls_key_is_secret = [](absl::string_view path) { return path == "tls.key_file"; };
  std::string redacted = config_internal::ConfigToYaml(c, tls_key_is_secret);
  EXPECT_THAT(redacted, HasSubstr("  key_file: \"<redacted>\"\n"));
  EXPECT_THAT(redacted, Not(HasSubstr("hunter2")));
  EXPECT_THAT(redacted, HasSubstr("  address: \"127.0.0.1:9740\"\n"));  // Others untouched.
  // An unset secret shows as unset.
  EXPECT_THAT(config_internal::ConfigToYaml(DefaultConfig(), tls_key_is_secret),
              HasSubstr("  key_file: \"\"\n"));

  // The public entry point redacts exactly the schema's secret keys.
  for (const ConfigKeyInfo& key : ConfigSchema()) {
    if (!key.secret) continue;
    absl::StatusOr<Config> set = LoadSets({absl::StrCat(key.path, "=s3cr3t-", key.path)});
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_THAT(ConfigToYaml(*set, true), Not(HasSubstr("s3cr3t")));
    EXPECT_THAT(ConfigToYaml(*set, false), HasSubstr("s3cr3t"));
  }
  auto schema_secret = [](absl::string_view path) {
    for (const ConfigKeyInfo& key : ConfigSchema()) {
      if (key.path == path) return key.secret;
    }
    return false;
  };
  EXPECT_EQ(ConfigToYaml(c, true), config_internal::ConfigToYaml(c, schema_secret));
  EXPECT_EQ(ConfigToYaml(c, false),
            config_internal::ConfigToYaml(c, [](absl::string_view) { return false; }));
}

// ---- Socket paths -------------------------------------------------------------------------

TEST_F(ConfigTest, UnixSocketPathResolution) {
  // The environment rule itself is platform/runtime_paths' (shared with the client); here, that the
  // config defers to it and puts the admin socket beside the engine socket.
  Config c = DefaultConfig();
  EXPECT_EQ(ResolveUnixSocketPath(c), platform::DefaultSocketPath(platform::kDefaultSocketName));
  EXPECT_EQ(ResolveAdminSocketPath(c), platform::DefaultSocketPath(platform::kDefaultAdminSocketName));

  c.listen.unix_socket = "/srv/k/engines.sock";
  EXPECT_EQ(ResolveUnixSocketPath(c), "/srv/k/engines.sock");
  EXPECT_EQ(ResolveAdminSocketPath(c), "/srv/k/kvcellard-admin.sock");
  c.listen.unix_socket = "engines.sock";
  EXPECT_EQ(ResolveAdminSocketPath(c), "kvcellard-admin.sock");
  c.listen.admin_socket = "/srv/k/admin.sock";
  EXPECT_EQ(ResolveAdminSocketPath(c), "/srv/k/admin.sock");
  c.listen.admin_socket = "none";
  EXPECT_EQ(ResolveAdminSocketPath(c), std::nullopt);
}

}  // namespace
}  // namespace kvcellar::server
