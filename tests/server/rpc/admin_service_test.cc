// Tests AdminService's GetStatus (server/rpc/admin_service.h) against the cache it reports on: every
// pool field is filled, and what it says equals what the Prometheus metrics say (the audit found
// pool.pinned_bytes and pool.in_flight_bytes never filled while kvcellar_l2_pinned_pages said 32).
#include <unistd.h>

#include <atomic>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kvcellar/v1/admin_service.grpc.pb.h"
#include "server/rpc/admin_service.h"
#include "tests/server/cache_test_harness.h"

namespace kvcellar::server::testing {
namespace {

// The unlabelled or exactly-labelled samples of a scrape: "name{labels}" -> value.
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &v)) {
      out[std::string(line.substr(0, space))] = v;
    }
  }
  return out;
}

// An AdminService over the harness's cache, with the cache's part of DaemonInfo filled the way
// Daemon::Info fills it, on a gRPC server of its own.
class AdminHarness {
 public:
  explicit AdminHarness(CacheHarness& cache, bool admin = true) : config_(DefaultConfig()) {
    service_ = std::make_unique<AdminServiceImpl>(
        [&cache] {
          DaemonInfo info;
          info.ready = true;
          cache.cache().FillInfo(&info);
          return info;
        },
        config_, /*allow_mutations=*/admin, &cache.cache().admin());
    static std::atomic<int> counter{0};
    socket_ = absl::StrCat("/tmp/kvc-admin-test-", getpid(), "-", counter.fetch_add(1), ".sock");
    ::unlink(socket_.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", socket_), grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = v1::AdminService::NewStub(
        grpc::CreateChannel(absl::StrCat("unix:", socket_), grpc::InsecureChannelCredentials()));
  }
  ~AdminHarness() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ::unlink(socket_.c_str());
  }

  v1::ListEnginesResponse Engines() {
    grpc::ClientContext ctx;
    v1::ListEnginesResponse resp;
    grpc::Status s = stub_->ListEngines(&ctx, v1::ListEnginesRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse resp;
    grpc::Status s = stub_->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

 private:
  Config config_;
  std::unique_ptr<AdminServiceImpl> service_;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AdminService::Stub> stub_;
};

TEST(AdminStatusTest, PoolFieldsEqualTheMetricsWithPinsAndCopiesInFlight) {
  CacheHarness h;
  AdminHarness admin(h);
  const v1::NamespaceSpec spec = Spec();
  TestEngine a(64, false, 1);
  h.Register(a, "inst-a", 0, spec);
  const uint64_t scheduler = h.RegisterScheduler("inst-s", spec);

  // 32 pages in L2, pinned by a Match.
  const std::vector<uint32_t> tokens = Tokens(1, 32);
  const auto keys = CacheHarness::Keys(spec, tokens);
  v1::OpResult done =
      h.Wait(a.session, h.Backup(a.session, keys, 0, 32, Blocks(0, 32)).op().op_id());
  ASSERT_EQ(done.sequences(0).leading_ok_pages(), 32u);
  const v1::MatchResponse m = h.MatchTokens(scheduler, tokens, /*pin=*/true);
  ASSERT_EQ(m.results(0).l2_hit_pages(), 32u);

  // 2 more pages in flight: the Backup waits for a ready signal the engine has not published.
  const std::vector<uint32_t> more = Tokens(2, 2);
  const auto more_keys = CacheHarness::Keys(spec, more);
  v1::BackupRequest req =
      CacheHarness::GatedBackup(a.session, more_keys, {40, 41}, 1, 7);
  v1::BackupResponse pending;
  ASSERT_TRUE(h.Backup(req, &pending).ok());
  ASSERT_EQ(pending.op().state(), v1::OP_STATE_PENDING);

  const v1::GetStatusResponse status = admin.Status();
  std::map<std::string, double> metrics = Samples(h.registry().Scrape());
  EXPECT_EQ(metrics["kvcellar_l2_pinned_pages"], 32);
  EXPECT_EQ(metrics["kvcellar_l2_objects{state=\"in_flight\"}"], 2);
  EXPECT_EQ(status.pool().pinned_bytes(), 32 * kObjectBytes);
  EXPECT_EQ(status.pool().pinned_bytes(), metrics["kvcellar_l2_pinned_bytes"]);
  EXPECT_EQ(status.pool().in_flight_bytes(), 2 * kObjectBytes);
  EXPECT_EQ(status.pool().in_flight_bytes(), metrics["kvcellar_l2_in_flight_bytes"]);
  EXPECT_LE(status.pool().pinned_bytes() + status.pool().in_flight_bytes(),
            metrics["kvcellar_l2_bytes"]);
  EXPECT_EQ(status.sessions(), metrics["kvcellar_sessions{role=\"worker\"}"] +
                                   metrics["kvcellar_sessions{role=\"scheduler\"}"]);
  EXPECT_EQ(status.instances(), metrics["kvcellar_instances"]);
  EXPECT_EQ(status.namespaces(), metrics["kvcellar_namespaces"]);

  // The copy lands and the pin is released: both go back to 0, in both places.
  a.PublishReady(1, 7);
  EXPECT_EQ(h.Wait(a.session, pending.op().op_id()).state(), v1::OP_STATE_DONE);
  v1::ReleaseRequest release;
  release.set_session_id(scheduler);
  release.add_pin_ids(m.results(0).pin_id());
  v1::ReleaseResponse rr;
  ASSERT_TRUE(h.Release(release, &rr).ok());
  const v1::GetStatusResponse after = admin.Status();
  metrics = Samples(h.registry().Scrape());
  EXPECT_EQ(after.pool().pinned_bytes(), 0u);
  EXPECT_EQ(after.pool().in_flight_bytes(), 0u);
  EXPECT_EQ(metrics["kvcellar_l2_pinned_bytes"], 0);
  EXPECT_EQ(metrics["kvcellar_l2_in_flight_bytes"], 0);
}

// Session ids are credentials: the engine socket's listing leaves them out, the admin socket's
// has them (#13: any peer could read every session's id and act as that session).
TEST(AdminServiceTest, OnlyAdminCallersSeeSessionIds) {
  CacheHarness h;
  TestEngine a(16, false, 1);
  h.Register(a, "inst-a", 0, Spec());
  AdminHarness admin(h, /*admin=*/true);
  AdminHarness engine_socket(h, /*admin=*/false);
  const v1::ListEnginesResponse full = admin.Engines();
  ASSERT_EQ(full.sessions_size(), 1);
  EXPECT_EQ(full.sessions(0).session_id(), a.session);
  const v1::ListEnginesResponse redacted = engine_socket.Engines();
  ASSERT_EQ(redacted.sessions_size(), 1);
  EXPECT_EQ(redacted.sessions(0).session_id(), 0u);
  EXPECT_EQ(redacted.sessions(0).instance_id(), "inst-a");
}

}  // namespace
}  // namespace kvcellar::server::testing
