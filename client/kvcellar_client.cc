#include "client/kvcellar_client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client_core.h"
#include "client/session_impl.h"
#include "platform/runtime_paths.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvcellar::client {
namespace {

// The heartbeat thread re-checks at least this often even when nothing is due (lost sessions'
// lease deadlines, sessions registered meanwhile).
constexpr absl::Duration kMaxIdle = absl::Seconds(1);

}  // namespace

// ---- Enum names
// ----------------------------------------------------------------------------------

const char* SessionStateName(SessionState state) {
  switch (state) {
    case SessionState::kConnecting:
      return "connecting";
    case SessionState::kActive:
      return "active";
    case SessionState::kSuspect:
      return "suspect";
    case SessionState::kRefused:
      return "refused";
    case SessionState::kClosed:
      return "closed";
  }
  return "unknown";
}

const char* PageStatusName(PageStatus status) {
  switch (status) {
    case PageStatus::kUnspecified:
      return "UNSPECIFIED";
    case PageStatus::kOk:
      return "OK";
    case PageStatus::kPending:
      return "PENDING";
    case PageStatus::kMiss:
      return "MISS";
    case PageStatus::kAlreadyPresent:
      return "ALREADY_PRESENT";
    case PageStatus::kInFlight:
      return "IN_FLIGHT";
    case PageStatus::kSkipped:
      return "SKIPPED";
    case PageStatus::kNoSpace:
      return "NO_SPACE";
    case PageStatus::kThrottled:
      return "THROTTLED";
    case PageStatus::kParentMissing:
      return "PARENT_MISSING";
    case PageStatus::kTimeout:
      return "TIMEOUT";
    case PageStatus::kCancelled:
      return "CANCELLED";
    case PageStatus::kL3Error:
      return "L3_ERROR";
    case PageStatus::kChecksumError:
      return "CHECKSUM_ERROR";
    case PageStatus::kDeviceError:
      return "DEVICE_ERROR";
    case PageStatus::kInternalError:
      return "INTERNAL_ERROR";
  }
  return "INTERNAL_ERROR";
}

const char* OpStateName(OpState state) {
  switch (state) {
    case OpState::kUnspecified:
      return "UNSPECIFIED";
    case OpState::kPending:
      return "PENDING";
    case OpState::kDone:
      return "DONE";
    case OpState::kFailed:
      return "FAILED";
    case OpState::kCancelled:
      return "CANCELLED";
    case OpState::kUnknown:
      return "UNKNOWN";
  }
  return "FAILED";
}

// ---- ClientCore
// ----------------------------------------------------------------------------------

ClientStats StatsCounters::Snapshot() const {
  auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  ClientStats s;
  s.rpcs_ok = get(rpcs_ok);
  s.rpcs_failed = get(rpcs_failed);
  s.rpcs_unavailable = get(rpcs_unavailable);
  s.rpcs_deadline_exceeded = get(rpcs_deadline_exceeded);
  s.rpcs_unimplemented = get(rpcs_unimplemented);
  s.degraded_calls = get(degraded_calls);
  s.match_calls = get(match_calls);
  s.match_pages = get(match_pages);
  s.match_l2_hit_pages = get(match_l2_hit_pages);
  s.keyed_pages = get(keyed_pages);
  s.keyed_pages_reused = get(keyed_pages_reused);
  s.registrations = get(registrations);
  s.reregistrations = get(reregistrations);
  s.registration_failures = get(registration_failures);
  s.sessions_lost = get(sessions_lost);
  s.heartbeats_ok = get(heartbeats_ok);
  s.heartbeats_failed = get(heartbeats_failed);
  s.ns_digest_mismatches = get(ns_digest_mismatches);
  s.ops_failed_session_lost = get(ops_failed_session_lost);
  s.uncertain_submissions = get(uncertain_submissions);
  return s;
}

ClientCore::ClientCore(ClientOptions options, std::string target,
                       std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      target_(std::move(target)),
      channel_(std::move(channel)),
      stub_(v1::CacheService::NewStub(channel_)) {}

ClientCore::~ClientCore() { Stop(); }

void ClientCore::SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(absl::ToInt64Microseconds(timeout)));
}

void ClientCore::CountRpc(const grpc::Status& status) {
  if (status.ok()) {
    StatsCounters::Add(stats_.rpcs_ok);
    return;
  }
  StatsCounters::Add(stats_.rpcs_failed);
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      StatsCounters::Add(stats_.rpcs_unavailable);
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      StatsCounters::Add(stats_.rpcs_deadline_exceeded);
      break;
    case grpc::StatusCode::UNIMPLEMENTED:
      StatsCounters::Add(stats_.rpcs_unimplemented);
      break;
    default:
      break;
  }
}

void ClientCore::Start() {
  if (!options_.heartbeat) return;
  thread_ = std::thread([this] { Loop(); });
}

void ClientCore::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ClientCore::Track(std::weak_ptr<SessionImpl> session) {
  absl::MutexLock lock(&mu_);
  sessions_.push_back(std::move(session));
  wake_ = true;
}

void ClientCore::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void ClientCore::Loop() {
  absl::Time next = absl::Now();
  for (;;) {
    std::vector<std::shared_ptr<SessionImpl>> live;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, next]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || wake_ || absl::Now() >= next;
      };
      // Await with a deadline re-evaluates `ready` when a member it reads changes, and at least
      // when the deadline passes.
      mu_.AwaitWithDeadline(absl::Condition(&ready), next);
      if (stop_) return;
      wake_ = false;
      std::erase_if(sessions_, [](const std::weak_ptr<SessionImpl>& w) { return w.expired(); });
      for (const auto& w : sessions_) {
        if (auto s = w.lock()) live.push_back(std::move(s));
      }
    }
    const absl::Time now = absl::Now();
    next = now + kMaxIdle;
    for (const auto& s : live) next = std::min(next, s->Tick(now));
  }
}

// ---- Client
// --------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.addr.empty()) options.addr = platform::DefaultSocketPath();
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout must be > 0");
  }
  absl::StatusOr<std::string> target = NormalizeTarget(options.addr);
  if (!target.ok()) return target.status();
  // The engine's backoff, not gRPC's default that grows to 120 s, and a subchannel of its own.
  options.channel.reconnect_backoff_min = options.reconnect_backoff_min;
  options.channel.reconnect_backoff_max = options.reconnect_backoff_max;
  options.channel.private_subchannel = true;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(*target, options.channel);
  if (!channel.ok()) return channel.status();
  auto core = std::make_shared<ClientCore>(std::move(options), *target, *std::move(channel));
  core->Start();
  return std::unique_ptr<Client>(new Client(std::move(core)));
}

Client::~Client() { core_->Stop(); }

absl::StatusOr<std::unique_ptr<Session>> Client::Register(EngineRegistration registration) {
  auto impl = std::make_shared<SessionImpl>(core_, std::move(registration));
  if (absl::Status s = impl->Validate(); !s.ok()) return s;
  if (absl::Status s = impl->RegisterFirst(); !s.ok()) return s;
  core_->Track(impl);
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

ClientStats Client::stats() const { return core_->stats().Snapshot(); }

const std::string& Client::target() const { return core_->target(); }

std::vector<core::PageKey> ComputePageKeys(const core::NamespaceSpec& ns,
                                           absl::Span<const uint32_t> tokens) {
  return core::ComputePageKeys(ns.Digest(), tokens, ns.page_size);
}

}  // namespace kvcellar::client
