// Tests server/rpc/tls.h: which files each tls.mode reads, and the errors naming the config key
// whose file is missing or holds no PEM block.
#include "server/rpc/tls.h"

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvcellar::server {
namespace {

using storage::testing::TempDir;
using ::testing::HasSubstr;

constexpr char kPem[] = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

std::string Write(const TempDir& dir, const std::string& name, const std::string& content) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << content;
  return path;
}

TEST(TlsTest, ReadPemFileReturnsTheWholeFile) {
  TempDir dir;
  const std::string path = Write(dir, "cert.pem", std::string("# comment\n") + kPem);
  absl::StatusOr<std::string> pem = ReadPemFile("tls.cert_file", path);
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_EQ(*pem, std::string("# comment\n") + kPem);
}

TEST(TlsTest, ReadPemFileErrorsNameTheKeyAndThePath) {
  TempDir dir;
  absl::StatusOr<std::string> missing = ReadPemFile("tls.key_file", dir.path() + "/absent.pem");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("'tls.key_file': cannot read"));
  EXPECT_THAT(missing.status().message(), HasSubstr("absent.pem"));

  const std::string not_pem = Write(dir, "key.der", "\x30\x82\x01\x0a binary");
  absl::StatusOr<std::string> binary = ReadPemFile("tls.key_file", not_pem);
  EXPECT_EQ(binary.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(binary.status().message(), HasSubstr("does not contain a PEM block"));
}

TEST(TlsTest, PlaintextReadsNoFile) {
  TlsConfig tls;
  tls.mode = TlsMode::kPlaintext;
  tls.cert_file = "/nonexistent/cert.pem";
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeServerCredentials(tls);
  ASSERT_TRUE(creds.ok()) << creds.status();
  EXPECT_NE(*creds, nullptr);
}

TEST(TlsTest, TlsNeedsCertAndKey) {
  TempDir dir;
  TlsConfig tls;
  tls.mode = TlsMode::kTls;
  tls.cert_file = dir.path() + "/absent-cert.pem";
  tls.key_file = Write(dir, "key.pem", kPem);
  EXPECT_THAT(MakeServerCredentials(tls).status().message(), HasSubstr("'tls.cert_file'"));
  tls.cert_file = Write(dir, "cert.pem", kPem);
  tls.key_file = dir.path() + "/absent-key.pem";
  EXPECT_THAT(MakeServerCredentials(tls).status().message(), HasSubstr("'tls.key_file'"));
  tls.key_file = Write(dir, "key.pem", kPem);
  tls.client_ca_file = dir.path() + "/absent-ca.pem";  // Not read without mTLS.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeServerCredentials(tls);
  ASSERT_TRUE(creds.ok()) << creds.status();
  EXPECT_NE(*creds, nullptr);
}

TEST(TlsTest, MutualTlsNeedsTheClientCa) {
  TempDir dir;
  TlsConfig tls;
  tls.mode = TlsMode::kMtls;
  tls.cert_file = Write(dir, "cert.pem", kPem);
  tls.key_file = Write(dir, "key.pem", kPem);
  tls.client_ca_file = dir.path() + "/absent-ca.pem";
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeServerCredentials(tls);
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(creds.status().message(), HasSubstr("'tls.client_ca_file'"));
  tls.client_ca_file = Write(dir, "ca.pem", kPem);
  creds = MakeServerCredentials(tls);
  ASSERT_TRUE(creds.ok()) << creds.status();
  EXPECT_NE(*creds, nullptr);
}

}  // namespace
}  // namespace kvcellar::server
