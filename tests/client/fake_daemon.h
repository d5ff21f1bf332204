// FakeDaemon: an in-process kvcellar.v1.CacheService on a Unix socket whose answers a test
// scripts (slow calls, forgotten sessions, a wrong ns_digest, a restart with a new epoch), so
// the client's failure handling is tested deterministically and without the real daemon.
//
// It keeps no data: Match answers `l2_hits` hits, Load/Backup ops are PENDING at submission and
// DONE at the first WaitOps.
#ifndef KVCELLAR_TESTS_CLIENT_FAKE_DAEMON_H_
#define KVCELLAR_TESTS_CLIENT_FAKE_DAEMON_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/namespace_spec.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"

namespace kvcellar::client::testing {

struct FakeConfig {
  uint64_t epoch = 1;
  bool wrong_digest = false;
  uint32_t lease_ms = 1000;
  uint32_t heartbeat_interval_ms = 100;
  uint32_t l2_hits = 0;
};

class FakeDaemon final : public v1::CacheService::Service {
 public:
  FakeDaemon(std::string socket, FakeConfig config) : socket_(std::move(socket)), config_(config) {
    grpc::ServerBuilder b;
    b.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    b.RegisterService(this);
    server_ = b.BuildAndStart();
  }
  ~FakeDaemon() override { Stop(); }

  bool ok() const { return server_ != nullptr; }
  void Stop() {
    stopping_ = true;
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      server_->Wait();
      server_.reset();
    }
  }

  // Scripted behaviour.
  std::atomic<int64_t> match_delay_ms{0};
  std::atomic<int64_t> backup_delay_ms{0};
  std::atomic<int64_t> heartbeat_delay_ms{0};
  std::atomic<bool> heartbeat_draining{false};

  // Observations.
  std::atomic<int> registers{0};
  std::atomic<int> replaces{0};
  std::atomic<int> matches{0};
  std::atomic<int> heartbeats{0};
  std::atomic<int> backups{0};
  std::atomic<int> unregisters{0};

  // Simulates lease expiry: every session becomes unknown.
  void ForgetSessions() {
    absl::MutexLock lock(&mu_);
    sessions_.clear();
  }
  size_t live_sessions() {
    absl::MutexLock lock(&mu_);
    return sessions_.size();
  }

  grpc::Status RegisterEngine(grpc::ServerContext*, const v1::RegisterEngineRequest* req,
                              v1::RegisterEngineResponse* resp) override {
    ++registers;
    if (req->replace_existing()) ++replaces;
    core::NamespaceSpec ns;
    const v1::NamespaceSpec& p = req->namespace_spec();
    ns.tenant = p.tenant();
    ns.model_id = p.model_id();
    ns.model_revision = p.model_revision();
    ns.kv_dtype = p.kv_dtype();
    ns.page_size = p.page_size_tokens();
    ns.layout =
        p.layout_kind() == v1::LAYOUT_KIND_MLA ? core::LayoutKind::kMla : core::LayoutKind::kMha;
    ns.tp_size = p.tp_size();
    ns.opaque_keys = p.opaque_keys();
    std::string digest(ns.Digest().AsBytes());
    if (config_.wrong_digest) digest[0] ^= 1;
    absl::MutexLock lock(&mu_);
    const uint64_t id = config_.epoch * 1000 + next_session_++;
    sessions_.insert(id);
    resp->set_session_id(id);
    resp->set_lease_ms(config_.lease_ms);
    resp->set_heartbeat_interval_ms(config_.heartbeat_interval_ms);
    resp->set_ns_digest(digest);
    resp->set_shard_index(req->rank());
    resp->set_num_shards(p.tp_size());
    resp->set_is_shard_writer(true);
    resp->set_daemon_epoch(config_.epoch);
    resp->set_api_revision(1);
    resp->mutable_limits()->set_max_batch_pages(65536);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    ++heartbeats;
    Delay(ctx, heartbeat_delay_ms);
    resp->set_daemon_epoch(config_.epoch);
    resp->set_draining(heartbeat_draining);
    if (!Known(req->session_id())) {
      resp->set_state(v1::SESSION_STATE_UNKNOWN);
      return grpc::Status::OK;
    }
    resp->set_state(v1::SESSION_STATE_ACTIVE);
    resp->set_lease_remaining_ms(config_.lease_ms);
    return grpc::Status::OK;
  }

  grpc::Status UnregisterEngine(grpc::ServerContext*, const v1::UnregisterEngineRequest* req,
                                v1::UnregisterEngineResponse*) override {
    ++unregisters;
    absl::MutexLock lock(&mu_);
    sessions_.erase(req->session_id());
    return grpc::Status::OK;
  }

  grpc::Status Match(grpc::ServerContext* ctx, const v1::MatchRequest* req,
                     v1::MatchResponse* resp) override {
    ++matches;
    Delay(ctx, match_delay_ms);
    if (!Known(req->session_id())) return Unknown(ctx);
    for (const v1::MatchSequence& s : req->sequences()) {
      v1::MatchResult* r = resp->add_results();
      const uint32_t pages = static_cast<uint32_t>(s.page_keys().size() / 32);
      r->set_total_pages(pages);
      r->set_l2_hit_pages(std::min(pages, config_.l2_hits));
      if (req->pin() && r->l2_hit_pages() > 0) r->set_pin_id(++next_pin_);
    }
    return grpc::Status::OK;
  }

  grpc::Status Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                    v1::LoadResponse* resp) override {
    if (!Known(req->session_id())) return Unknown(ctx);
    Submit(v1::OP_KIND_LOAD, req->sequences(), resp->mutable_op());
    return grpc::Status::OK;
  }

  grpc::Status Backup(grpc::ServerContext* ctx, const v1::BackupRequest* req,
                      v1::BackupResponse* resp) override {
    ++backups;
    Delay(ctx, backup_delay_ms);
    if (!Known(req->session_id())) return Unknown(ctx);
    Submit(v1::OP_KIND_BACKUP, req->sequences(), resp->mutable_op());
    return grpc::Status::OK;
  }

  grpc::Status WaitOps(grpc::ServerContext* ctx, const v1::WaitOpsRequest* req,
                       v1::WaitOpsResponse* resp) override {
    if (!Known(req->session_id())) return Unknown(ctx);
    absl::MutexLock lock(&mu_);
    for (uint64_t id : req->op_ids()) {
      v1::OpResult* r = resp->add_ops();
      r->set_op_id(id);
      if (!ops_.contains(id)) {
        r->set_state(v1::OP_STATE_UNKNOWN);
        continue;
      }
      r->set_state(v1::OP_STATE_DONE);
      r->add_sequences()->set_leading_ok_pages(1);
    }
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req,
                       v1::ReleaseResponse* resp) override {
    if (!Known(req->session_id())) return Unknown(ctx);
    for (int i = 0; i < req->pin_ids_size(); ++i) {
      resp->add_pin_outcomes(v1::RELEASE_OUTCOME_RELEASED);
    }
    for (int i = 0; i < req->cancel_op_ids_size(); ++i) {
      resp->add_op_outcomes(v1::RELEASE_OUTCOME_NOT_CANCELLABLE);
    }
    return grpc::Status::OK;
  }

 private:
  template <typename Seqs>
  void Submit(v1::OpKind kind, const Seqs& seqs, v1::OpResult* op) {
    absl::MutexLock lock(&mu_);
    const uint64_t id = ++next_id_;
    ops_.insert(id);
    op->set_op_id(id);
    op->set_kind(kind);
    op->set_state(v1::OP_STATE_PENDING);
    for (const auto& s : seqs) {
      v1::SequenceResult* r = op->add_sequences();
      const int pages = static_cast<int>(s.page_keys().size() / 32);
      for (int i = 0; i < pages; ++i) r->add_page_status(v1::PAGE_STATUS_PENDING);
      r->set_leading_ok_pages(pages);
    }
  }
  bool Known(uint64_t id) {
    absl::MutexLock lock(&mu_);
    return sessions_.contains(id);
  }
  static grpc::Status Unknown(grpc::ServerContext* ctx) {
    ctx->AddTrailingMetadata("kvcellar-error-reason", "ERROR_REASON_SESSION_UNKNOWN");
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "session_id unknown");
  }
  void Delay(grpc::ServerContext* ctx, const std::atomic<int64_t>& ms) {
    const absl::Time end = absl::Now() + absl::Milliseconds(ms.load());
    while (absl::Now() < end && !stopping_ && !ctx->IsCancelled()) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  const std::string socket_;
  const FakeConfig config_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_pin_{1u << 20};
  absl::Mutex mu_;
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint64_t> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> ops_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcellar::client::testing

#endif  // KVCELLAR_TESTS_CLIENT_FAKE_DAEMON_H_
