// Tests server/rpc/grpc_status.h without a server: the status code and message of the gRPC status.
// The trailing metadata it adds on a live call is asserted end to end in cache_service_test.cc
// and cache_validation_test.cc (the harness reads both trailers of every call), where a real
// CallbackServerContext exists.
#include "server/rpc/grpc_status.h"

#include "gtest/gtest.h"

namespace kvcellar::server {
namespace {

TEST(GrpcStatusTest, OkIsOk) { EXPECT_TRUE(ToGrpcStatus(absl::OkStatus(), nullptr).ok()); }

TEST(GrpcStatusTest, KeepsTheCanonicalCodeAndTheMessage) {
  const struct {
    absl::Status in;
    grpc::StatusCode code;
  } cases[] = {
      {InvalidField("sequences[0]", "bad"), grpc::StatusCode::INVALID_ARGUMENT},
      {SessionUnknown(7), grpc::StatusCode::FAILED_PRECONDITION},
      {absl::UnavailableError("draining"), grpc::StatusCode::UNAVAILABLE},
      {absl::ResourceExhaustedError("full"), grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::InternalError("boom"), grpc::StatusCode::INTERNAL},
  };
  for (const auto& c : cases) {
    const grpc::Status g = ToGrpcStatus(c.in, nullptr);
    EXPECT_EQ(g.error_code(), c.code) << c.in;
    EXPECT_EQ(g.error_message(), std::string(c.in.message()));
  }
}

}  // namespace
}  // namespace kvcellar::server
