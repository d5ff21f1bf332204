// Tests server/session/session_registry.h: a Session's all-or-nothing reservations of blocks,
// slots and op counts, its two-step Close, and SessionRegistry's instance rules (one namespace and
// TP size per instance, one live session per seat, lapsed leases invisible at once).
#include "server/session/session_registry.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

// What Close() hands back: the session treats its mapping as opaque, so a stand-in whose
// identity the tests check is enough here (the sim device's real mapping is exercised by
// datapath/device_mover_test.cc).
class StandInMapping final : public gpu::EngineMapping {
 public:
  const core::KvLayout& layout() const override { return layout_; }
  uint64_t page_object_bytes() const override { return kObjectBytes; }

 private:
  core::KvLayout layout_ = TestLayout();
};

std::string BlockName(size_t i) { return absl::StrCat("sequences[0].device_blocks[", i, "]"); }

constexpr uint32_t kMaxInflight = 4;

class SessionTest : public ::testing::Test {
 protected:
  SessionTest() {
    SessionInfo info;
    info.id = 7;
    info.instance_id = "inst";
    info.ns = world_.namespaces().GetOrCreate(NsSpec());
    auto mapping = std::make_unique<StandInMapping>();
    mapping_ = mapping.get();
    session_ = std::make_unique<Session>(std::move(info), std::move(mapping),
                                         absl::Now() + absl::Seconds(10));
  }

  absl::Status Reserve(std::vector<uint32_t> blocks, std::optional<uint32_t> slot = std::nullopt,
                       uint32_t max_inflight = kMaxInflight) {
    return session_->Reserve(blocks, BlockName, slot, "load_slot", max_inflight);
  }

  L2World world_;
  StandInMapping* mapping_ = nullptr;
  std::unique_ptr<Session> session_;
};

TEST_F(SessionTest, ReserveTakesBlocksAndSlotUntilReleased) {
  ASSERT_TRUE(Reserve({1, 2, 3}, 0).ok());
  session_->EndSubmission(/*op_started=*/true);
  EXPECT_EQ(session_->busy_blocks(), 3u);
  EXPECT_EQ(session_->inflight_ops(), 1u);

  session_->ReleaseBlocks({1, 3});
  session_->ReleaseSlot(0);
  EXPECT_EQ(session_->busy_blocks(), 1u);
  ASSERT_TRUE(Reserve({1, 3}, 0).ok()) << "released blocks and slot are free again";
  session_->EndSubmission(true);
  EXPECT_EQ(session_->inflight_ops(), 2u);
  session_->OpFinished();
  session_->OpFinished();
  session_->OpFinished();  // One more than there are: stays at 0.
  EXPECT_EQ(session_->inflight_ops(), 0u);
}

TEST_F(SessionTest, BusyBlockIsRefusedNamingTheFirstAndNothingIsTaken) {
  ASSERT_TRUE(Reserve({5, 6}).ok());
  session_->EndSubmission(true);

  absl::Status s = Reserve({9, 6, 5});
  EXPECT_TRUE(IsCacheError(s, absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_BLOCK_BUSY,
                           "sequences[0].device_blocks[1]"));
  EXPECT_THAT(s.message(), HasSubstr("(6)"));
  EXPECT_EQ(session_->busy_blocks(), 2u) << "block 9 was not taken";
  EXPECT_EQ(session_->inflight_ops(), 1u);
  EXPECT_TRUE(Reserve({9}).ok());
  session_->EndSubmission(true);
}

TEST_F(SessionTest, BusySlotIsRefusedNamingTheSlotField) {
  ASSERT_TRUE(Reserve({1}, 2).ok());
  session_->EndSubmission(true);
  absl::Status s = Reserve({4}, 2);
  EXPECT_TRUE(IsCacheError(s, absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_SLOT_BUSY,
                           "load_slot"));
  EXPECT_EQ(session_->busy_blocks(), 1u) << "block 4 was not taken";
  EXPECT_TRUE(Reserve({4}, 3).ok()) << "another slot is free";
  session_->EndSubmission(true);
}

TEST_F(SessionTest, TooManyUnfinishedOpsIsResourceExhausted) {
  for (uint32_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(Reserve({i}, std::nullopt, 2).ok());
    session_->EndSubmission(true);
  }
  absl::Status s = Reserve({7}, std::nullopt, 2);
  EXPECT_TRUE(
      IsCacheError(s, absl::StatusCode::kResourceExhausted, v1::ERROR_REASON_TOO_MANY_OPS, ""));
  EXPECT_EQ(session_->busy_blocks(), 2u);
  session_->OpFinished();
  EXPECT_TRUE(Reserve({7}, std::nullopt, 2).ok()) << "an op finished: room for one more";
  session_->EndSubmission(true);
}

TEST_F(SessionTest, SubmissionThatStartedNoOpGivesItsCountBack) {
  ASSERT_TRUE(Reserve({1}).ok());
  EXPECT_EQ(session_->inflight_ops(), 1u);
  session_->EndSubmission(/*op_started=*/false);
  EXPECT_EQ(session_->inflight_ops(), 0u);
  EXPECT_EQ(session_->busy_blocks(), 1u) << "blocks go back through ReleaseBlocks only";
}

TEST_F(SessionTest, RenewKeepsTheLaterDeadline) {
  const absl::Time first = session_->lease_deadline();
  session_->Renew(first - absl::Seconds(5));
  EXPECT_EQ(session_->lease_deadline(), first);
  session_->Renew(first + absl::Seconds(5));
  EXPECT_EQ(session_->lease_deadline(), first + absl::Seconds(5));
}

TEST_F(SessionTest, CloseWaitsForSubmissionsThenHandsOverTheMappingOnce) {
  ASSERT_TRUE(Reserve({1}).ok());  // A submission in progress.
  std::atomic<bool> returned{false};
  std::unique_ptr<gpu::EngineMapping> handed;
  std::thread closer([&] {
    handed = session_->Close();
    returned = true;
  });
  while (!session_->closed()) std::this_thread::yield();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(returned) << "Close returned while a submission still used the mapping";
  EXPECT_EQ(session_->mapping(), mapping_) << "the submission may still use it";
  session_->EndSubmission(true);
  closer.join();
  EXPECT_TRUE(returned);
  EXPECT_EQ(handed.get(), mapping_);
  EXPECT_EQ(session_->mapping(), nullptr);
  EXPECT_EQ(session_->Close(), nullptr) << "a second Close hands over nothing";

  EXPECT_TRUE(IsCacheError(Reserve({2}), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_SESSION_UNKNOWN, "session_id"));
}

// ---- SessionRegistry ----------------------------------------------------------------------------

class SessionRegistryTest : public ::testing::Test {
 protected:
  std::shared_ptr<Session> Make(const std::string& instance, uint32_t rank,
                                const core::NamespaceSpec& spec = NsSpec(2),
                                absl::Duration lease = absl::Seconds(10),
                                v1::SessionRole role = v1::SESSION_ROLE_WORKER,
                                PeerIdentity owner = {}) {
    SessionInfo info;
    info.owner = std::move(owner);
    info.id = registry_.NewSessionId();
    info.instance_id = instance;
    info.rank = rank;
    info.role = role;
    info.ns = world_.namespaces().GetOrCreate(spec);
    info.tp_size = spec.tp_size;
    return std::make_shared<Session>(std::move(info), nullptr, absl::Now() + lease);
  }
  std::shared_ptr<Session> Scheduler(const std::string& instance) {
    return Make(instance, 0, NsSpec(2), absl::Seconds(10), v1::SESSION_ROLE_SCHEDULER);
  }
  absl::Status Add(const std::shared_ptr<Session>& s, bool replace = false,
                   std::shared_ptr<Session>* replaced = nullptr) {
    std::shared_ptr<Session> ignored;
    return registry_.Add(s, replace, replaced != nullptr ? replaced : &ignored);
  }

  L2World world_;
  SessionRegistry registry_;
};

TEST_F(SessionRegistryTest, SessionIdsAreNonZeroAndDistinct) {
  absl::flat_hash_set<uint64_t> ids;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id = registry_.NewSessionId();
    EXPECT_NE(id, 0u);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 1000u);
}

TEST_F(SessionRegistryTest, AddedSessionsAreFoundByIdWhileTheirLeaseRuns) {
  std::shared_ptr<Session> rank0 = Make("inst", 0);
  std::shared_ptr<Session> rank1 = Make("inst", 1);
  std::shared_ptr<Session> sched = Scheduler("inst");
  ASSERT_TRUE(Add(rank0).ok());
  ASSERT_TRUE(Add(rank1).ok());
  ASSERT_TRUE(Add(sched).ok()) << "a scheduler has a seat of its own";
  EXPECT_EQ(registry_.sessions(), 3u);
  EXPECT_EQ(registry_.instances(), 1u);
  EXPECT_TRUE(registry_.HasInstance("inst"));
  EXPECT_FALSE(registry_.HasInstance("other"));
  EXPECT_THAT(registry_.Snapshot(), UnorderedElementsAre(rank0, rank1, sched));

  const absl::Time now = absl::Now();
  EXPECT_EQ(registry_.Find(rank1->id(), now), rank1);
  EXPECT_EQ(registry_.Find(12345, now), nullptr);
  // At the deadline the session is unknown, before anything reaps it.
  EXPECT_EQ(registry_.Find(rank1->id(), rank1->lease_deadline()), nullptr);
  EXPECT_EQ(registry_.sessions(), 3u);
}

TEST_F(SessionRegistryTest, InstanceKeepsOneNamespace) {
  ASSERT_TRUE(Add(Make("inst", 0)).ok());
  std::shared_ptr<Session> other = Make("inst", 1, NsSpec(2, false, "other-model"));
  absl::Status check = registry_.CheckAdd(other->info(), /*replace_existing=*/true);
  EXPECT_TRUE(IsCacheError(check, absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "namespace_spec"));
  EXPECT_THAT(check.message(), HasSubstr("\"inst\""));
  EXPECT_TRUE(IsCacheError(Add(other, true), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "namespace_spec"));
  EXPECT_EQ(registry_.sessions(), 1u);
  EXPECT_EQ(registry_.Find(other->id(), absl::Now()), nullptr);
}

TEST_F(SessionRegistryTest, InstanceKeepsOneTpSize) {
  // MLA pages are shared across TP sizes (one shard), so tp 2 and tp 4 have one namespace; an
  // instance still has one TP size.
  ASSERT_TRUE(Add(Make("inst", 0, NsSpec(2, true))).ok());
  std::shared_ptr<Session> tp4 = Make("inst", 1, NsSpec(4, true));
  ASSERT_EQ(tp4->info().ns, registry_.Snapshot()[0]->info().ns);
  EXPECT_TRUE(IsCacheError(Add(tp4), absl::StatusCode::kFailedPrecondition,
                           v1::ERROR_REASON_GROUP_MISMATCH, "namespace_spec.tp_size"));
  EXPECT_TRUE(Add(Make("other-inst", 0, NsSpec(4, true))).ok()) << "another instance may";
}

TEST_F(SessionRegistryTest, SecondLiveSessionOfASeatIsRefusedUnlessReplacing) {
  std::shared_ptr<Session> first = Make("inst", 0);
  std::shared_ptr<Session> sched = Scheduler("inst");
  ASSERT_TRUE(Add(first).ok());
  ASSERT_TRUE(Add(sched).ok());

  std::shared_ptr<Session> second = Make("inst", 0);
  EXPECT_TRUE(IsCacheError(registry_.CheckAdd(second->info(), false),
                           absl::StatusCode::kAlreadyExists, v1::ERROR_REASON_SESSION_EXISTS,
                           "rank"));
  EXPECT_TRUE(IsCacheError(Add(second), absl::StatusCode::kAlreadyExists,
                           v1::ERROR_REASON_SESSION_EXISTS, "rank"));
  // One scheduler per instance: the instance_id collides, not the role (issue #24).
  EXPECT_TRUE(IsCacheError(Add(Scheduler("inst")), absl::StatusCode::kAlreadyExists,
                           v1::ERROR_REASON_SESSION_EXISTS, "instance_id"));
  EXPECT_EQ(registry_.sessions(), 2u);
  EXPECT_EQ(registry_.Find(first->id(), absl::Now()), first);

  std::shared_ptr<Session> replaced;
  ASSERT_TRUE(Add(second, /*replace=*/true, &replaced).ok());
  EXPECT_EQ(replaced, first);
  EXPECT_EQ(registry_.Find(first->id(), absl::Now()), nullptr);
  EXPECT_EQ(registry_.Find(second->id(), absl::Now()), second);
  EXPECT_EQ(registry_.sessions(), 2u);
  EXPECT_TRUE(registry_.HasInstance("inst")) << "the instance lives through the replacement";
}

TEST_F(SessionRegistryTest, AnInstanceBelongsToOnePrincipal) {
  const auto worker = v1::SESSION_ROLE_WORKER;
  std::shared_ptr<Session> victim =
      Make("inst", 0, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(1000, 1000, 41));
  ASSERT_TRUE(Add(victim).ok());
  // Another user can neither replace the victim's seat nor join its instance as another rank;
  // nor does it learn the instance's namespace from a GROUP_MISMATCH first.
  for (const std::shared_ptr<Session>& intruder :
       {Make("inst", 0, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(1001, 1000, 42)),
        Make("inst", 1, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(1000, 1001, 42)),
        Make("inst", 1, NsSpec(2, false, "other-model"), absl::Seconds(10), worker,
             PeerIdentity::Unix(1001, 1001, 42))}) {
    absl::Status s = Add(intruder, /*replace=*/true);
    EXPECT_TRUE(IsCacheError(s, absl::StatusCode::kPermissionDenied,
                             v1::ERROR_REASON_NOT_SESSION_OWNER, "instance_id"))
        << s;
    EXPECT_THAT(s.message(), HasSubstr("pid 42"));
    EXPECT_THAT(s.message(), Not(HasSubstr("pid 41"))) << "the owner is not named";
  }
  EXPECT_EQ(registry_.Find(victim->id(), absl::Now()), victim);
  // The same user in another process (the engine restarted, another rank) may.
  std::shared_ptr<Session> restarted =
      Make("inst", 0, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(1000, 1000, 43));
  std::shared_ptr<Session> replaced;
  ASSERT_TRUE(Add(restarted, /*replace=*/true, &replaced).ok());
  EXPECT_EQ(replaced, victim);
  EXPECT_TRUE(
      Add(Make("inst", 1, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(1000, 1000, 44)))
          .ok());
  // Once the instance's sessions have lapsed, its name is free for anyone.
  std::shared_ptr<Session> brief = Make("brief", 0, NsSpec(2), absl::Milliseconds(1), worker,
                                        PeerIdentity::Unix(1000, 1000, 45));
  ASSERT_TRUE(Add(brief).ok());
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(
      Add(Make("brief", 1, NsSpec(2), absl::Seconds(10), worker, PeerIdentity::Unix(7, 7, 46)))
          .ok());
}

TEST_F(SessionRegistryTest, LapsedHolderIsReplacedWithoutAsking) {
  std::shared_ptr<Session> lapsed = Make("inst", 0, NsSpec(2), absl::ZeroDuration());
  ASSERT_TRUE(Add(lapsed).ok());
  std::shared_ptr<Session> fresh = Make("inst", 0);
  EXPECT_TRUE(registry_.CheckAdd(fresh->info(), /*replace_existing=*/false).ok());
  std::shared_ptr<Session> replaced;
  ASSERT_TRUE(Add(fresh, /*replace=*/false, &replaced).ok());
  EXPECT_EQ(replaced, lapsed) << "the caller must end it";
  EXPECT_EQ(registry_.sessions(), 1u);
}

TEST_F(SessionRegistryTest, RemoveSaysWhenTheInstanceLostItsLastSession) {
  std::shared_ptr<Session> rank0 = Make("inst", 0);
  std::shared_ptr<Session> rank1 = Make("inst", 1);
  ASSERT_TRUE(Add(rank0).ok());
  ASSERT_TRUE(Add(rank1).ok());

  SessionRegistry::Removed r = registry_.Remove(rank0->id());
  EXPECT_EQ(r.session, rank0);
  EXPECT_FALSE(r.last_of_instance);
  EXPECT_TRUE(registry_.HasInstance("inst"));
  EXPECT_EQ(registry_.Remove(rank0->id()).session, nullptr) << "already removed";
  r = registry_.Remove(rank1->id());
  EXPECT_EQ(r.session, rank1);
  EXPECT_TRUE(r.last_of_instance);
  EXPECT_FALSE(registry_.HasInstance("inst"));
  EXPECT_EQ(registry_.instances(), 0u);
  // With the instance gone, another namespace may use its name.
  EXPECT_TRUE(Add(Make("inst", 0, NsSpec(1, false, "other-model"))).ok());
}

TEST_F(SessionRegistryTest, TakeExpiredRemovesOnlyLapsedSessions) {
  std::shared_ptr<Session> lapsing = Make("a", 0, NsSpec(2), absl::Seconds(1));
  std::shared_ptr<Session> living = Make("a", 1, NsSpec(2), absl::Seconds(100));
  std::shared_ptr<Session> alone = Make("b", 0, NsSpec(2), absl::Seconds(1));
  ASSERT_TRUE(Add(lapsing).ok());
  ASSERT_TRUE(Add(living).ok());
  ASSERT_TRUE(Add(alone).ok());

  std::vector<SessionRegistry::Removed> expired =
      registry_.TakeExpired(absl::Now() + absl::Seconds(2));
  ASSERT_EQ(expired.size(), 2u);
  for (const SessionRegistry::Removed& r : expired) {
    EXPECT_TRUE(r.session == lapsing || r.session == alone);
    EXPECT_EQ(r.last_of_instance, r.session == alone);
  }
  EXPECT_EQ(registry_.sessions(), 1u);
  EXPECT_EQ(registry_.Find(living->id(), absl::Now()), living);

  std::vector<SessionRegistry::Removed> all = registry_.TakeAll();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].session, living);
  EXPECT_TRUE(all[0].last_of_instance);
  EXPECT_EQ(registry_.sessions(), 0u);
  EXPECT_EQ(registry_.instances(), 0u);
}

}  // namespace
}  // namespace kvcellar::server::testing
