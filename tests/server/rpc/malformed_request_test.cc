// Tests server/rpc/malformed_request.h: a request that does not parse (invalid UTF-8 in a proto3
// string field) is an INVALID_ARGUMENT naming the field and one KVLOG line, not protobuf's raw
// "[libprotobuf ERROR ...]" on stderr and gRPC's bare UNIMPLEMENTED. The requests are written
// byte by byte and sent through the generic stub, as a foreign client would.
#include "server/rpc/malformed_request.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kvcellar/v1/admin_service.pb.h"
#include "kvcellar/v1/cache_service.pb.h"
#include "server/rpc/admin_service.h"
#include "server/config/config.h"
#include "server/rpc/grpc_status.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Reply {
  grpc::Status status;
  std::string reason;
  std::string field;
};

// An AdminService without a cache (its cache RPCs answer UNAVAILABLE once they run) behind the
// daemon's interceptor, on a temp Unix socket.
class MalformedRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    InstallProtobufLogHandler();
    config_ = DefaultConfig();
    service_ = std::make_unique<AdminServiceImpl>([] { return DaemonInfo(); }, config_, true);
    static std::atomic<int> counter{0};
    socket_ = absl::StrCat("/tmp/kvc-malformed-test-", getpid(), "-", counter++, ".sock");
    ::unlink(socket_.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", socket_), grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
    log_ = std::make_unique<MalformedRequestLog>(&registry_);
    f.push_back(std::make_unique<MalformedRequestInterceptorFactory>(log_.get()));
    builder.experimental().SetInterceptorCreators(std::move(f));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = std::make_unique<grpc::GenericStub>(
        grpc::CreateChannel(absl::StrCat("unix:", socket_), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ::unlink(socket_.c_str());
  }

  Reply Call(const std::string& method, const std::string& body) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice slice(body);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    absl::Notification done;
    Reply r;
    stub_->UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                     [&](grpc::Status s) {
                       r.status = std::move(s);
                       done.Notify();
                     });
    done.WaitForNotification();
    for (const auto& [key, value] : ctx.GetServerTrailingMetadata()) {
      if (key == kErrorReasonMetadataKey) r.reason = std::string(value.data(), value.size());
      if (key == kErrorFieldMetadataKey) r.field = std::string(value.data(), value.size());
    }
    return r;
  }

  Config config_;
  MetricsRegistry registry_;
  std::unique_ptr<MalformedRequestLog> log_;
  std::unique_ptr<AdminServiceImpl> service_;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

// Field 1, length-delimited: tag 0x0a, then the length (< 128 here) and the bytes.
std::string Field1(const std::string& bytes) {
  return absl::StrCat("\x0a", std::string(1, static_cast<char>(bytes.size())), bytes);
}

TEST_F(MalformedRequestTest, InvalidUtf8IsAnInvalidArgumentNamingTheFieldAndLogged) {
  const std::string bad_utf8 = "team-\xff\xfe";
  ::testing::internal::CaptureStderr();
  // ListNamespacesRequest.tenant (TenantFilter).tenant: a nested field.
  Reply nested = Call("/kvcellar.v1.AdminService/ListNamespaces", Field1(Field1(bad_utf8)));
  // ListEnginesRequest.instance_id.
  Reply top = Call("/kvcellar.v1.AdminService/ListEngines", Field1(bad_utf8));
  const std::string err = ::testing::internal::GetCapturedStderr();

  EXPECT_EQ(nested.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(nested.reason, "ERROR_REASON_INVALID_FIELD");
  EXPECT_EQ(nested.field, "tenant.tenant");
  EXPECT_THAT(nested.status.error_message(), HasSubstr("tenant.tenant: not valid UTF-8"));
  EXPECT_EQ(top.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(top.field, "instance_id");
  EXPECT_THAT(top.status.error_message(), HasSubstr("instance_id: not valid UTF-8"));

  EXPECT_THAT(err, Not(HasSubstr("[libprotobuf"))) << err;
  EXPECT_THAT(err, HasSubstr("level=warn msg=\"request rejected: does not parse\""));
  EXPECT_THAT(err,
              HasSubstr("method=/kvcellar.v1.AdminService/ListNamespaces field=tenant.tenant"));
  // The second, within the minute, is counted, not logged.
  EXPECT_THAT(err, Not(HasSubstr("field=instance_id"))) << err;
  EXPECT_EQ(log_->rejected(), 2u);

  // The same request in valid UTF-8 reaches the handler (which has no cache: UNAVAILABLE).
  Reply good = Call("/kvcellar.v1.AdminService/ListEngines", Field1("team-a"));
  EXPECT_EQ(good.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << good.status.error_message();
}

TEST_F(MalformedRequestTest, BytesThatDoNotParseAreAnInvalidArgument) {
  ::testing::internal::CaptureStderr();
  // Field 1 claims 100 bytes and the message ends after 2.
  Reply r = Call("/kvcellar.v1.AdminService/ListEngines", std::string("\x0a\x64xy", 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("not a valid ListEnginesRequest"));
  // Logged once the call closes uncancelled, which may be just after the client has its reply.
  absl::SleepFor(absl::Seconds(1));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("msg=\"request rejected: does not parse\" "
                             "method=/kvcellar.v1.AdminService/ListEngines"));
}

// One client sending garbage in a loop wrote 11,027 lines in 5 s (issue #24): the requests are
// all answered and counted, and logged once a minute.
TEST_F(MalformedRequestTest, AFloodOfMalformedRequestsIsCountedAndLoggedOnce) {
  constexpr int kRequests = 200;
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kRequests; ++i) {
    Reply r = Call("/kvcellar.v1.AdminService/ListEngines", Field1("team-\xff\xfe"));
    ASSERT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = err.find("does not parse"); at != std::string::npos;
       at = err.find("does not parse", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 1u) << err.substr(0, 2000);
  EXPECT_EQ(log_->rejected(), static_cast<uint64_t>(kRequests));
  EXPECT_THAT(registry_.Scrape(),
              HasSubstr(absl::StrCat("kvcellar_rpc_malformed_requests_total ", kRequests, "\n")));
}

TEST(MalformedRequestLogTest, TheNextLineSaysHowManyWentUnlogged) {
  MalformedRequestLog log(nullptr, absl::Milliseconds(200));
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 5; ++i) log.Record("/m", "f", "bad");
  absl::SleepFor(absl::Milliseconds(250));
  log.Record("/m", "f", "bad");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("unlogged_since_last=0 rejected_total=1"));
  EXPECT_THAT(err, HasSubstr("unlogged_since_last=4 rejected_total=6"));
  EXPECT_EQ(log.rejected(), 6u);
}

// A call whose request never arrives (the client cancelled it, its process was killed: an engine
// SIGKILLed mid-RPC in the soak) reaches the interceptor with a null message too. It is not a
// malformed request: nothing is logged as one. (Before the fix: 20 "does not parse" lines.)
TEST_F(MalformedRequestTest, ACallCancelledBeforeItsRequestIsNotAMalformedRequest) {
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 20; ++i) {
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub_->PrepareCall(&ctx, "/kvcellar.v1.AdminService/ListEngines", &cq);
    void* tag = nullptr;
    bool ok = false;
    call->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    ASSERT_TRUE(ok);  // The call's headers are out; its request never will be.
    ctx.TryCancel();
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(2));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
  }
  // The server has seen every call end: a call made after them is answered after them.
  Reply good = Call("/kvcellar.v1.AdminService/ListEngines", Field1("team-a"));
  EXPECT_EQ(good.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, Not(HasSubstr("does not parse"))) << err;
}

TEST(FieldPathTest, FindsTheShortestPathOfAField) {
  const auto* reg = v1::RegisterEngineRequest::descriptor();
  EXPECT_EQ(FieldPath(reg, "kvcellar.v1.NamespaceSpec.kv_dtype"), "namespace_spec.kv_dtype");
  EXPECT_EQ(FieldPath(reg, "kvcellar.v1.RegisterEngineRequest.instance_id"), "instance_id");
  EXPECT_EQ(FieldPath(reg, "kvcellar.v1.MemoryRegion.sim_shm_name"),
            "layout.regions[].sim_shm_name");
  EXPECT_EQ(FieldPath(reg, "kvcellar.v1.NoSuch.field"), "");
}

}  // namespace
}  // namespace kvcellar::server
