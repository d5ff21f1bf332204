// A hermetic CacheService for tests: a real CacheServiceImpl behind a real gRPC server on a temp
// Unix socket, a small host pool, the sim device, and engines whose "device memory" and SIM
// signal counters are shared memory created in this process. The geometry, specs and pool are
// component_fixtures.h's, which the per-component tests use without the service.
#ifndef KVCELLAR_TESTS_SERVER_CACHE_TEST_HARNESS_H_
#define KVCELLAR_TESTS_SERVER_CACHE_TEST_HARNESS_H_

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/host_pool.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"
#include "core/signal_layout.h"
#include "gmock/gmock.h"
#include "gpu/sim_device.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kvcellar/v1/cache_service.grpc.pb.h"
#include "platform/shm_mapping.h"
#include "platform/sim_engine_memory.h"
#include "server/config/config.h"
#include "server/l3/l3_tiers.h"
#include "server/metrics/metrics.h"
#include "server/rpc/cache_service.h"
#include "server/rpc/unix_listener.h"
#include "server/session/sim_counter_channel.h"
#include "server/rpc/grpc_status.h"
#include "tests/gpu/sim_test_util.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {

namespace v1 = ::kvcellar::v1;

// The outcome of one RPC: its status and the error trailers.
struct Rpc {
  grpc::Status status;
  std::string reason;
  std::string field;
  bool ok() const { return status.ok(); }
};

inline Rpc Outcome(const grpc::ClientContext& ctx, grpc::Status status) {
  Rpc r{std::move(status), "", ""};
  for (const auto& [key, value] : ctx.GetServerTrailingMetadata()) {
    if (key == kErrorReasonMetadataKey) r.reason = std::string(value.data(), value.size());
    if (key == kErrorFieldMetadataKey) r.field = std::string(value.data(), value.size());
  }
  return r;
}

// A KVCSIG01 region as an engine creates it (cache_service.proto, SimCounterSignals).
inline platform::ShmMapping CreateSignals(const std::string& name, uint32_t load_slots,
                                          uint32_t layers, uint32_t ready_slots) {
  absl::StatusOr<platform::ShmMapping> shm =
      platform::ShmMapping::Create(name, SimCounterChannel::Bytes(load_slots, layers, ready_slots));
  EXPECT_TRUE(shm.ok()) << shm.status();
  core::SignalLayout::WriteHeader(shm->data(), load_slots, layers, ready_slots);
  return *std::move(shm);
}

// One engine rank: its KV cache in shm, its signal counters, its session once registered.
class TestEngine {
 public:
  static constexpr uint32_t kLoadSlots = 4;
  static constexpr uint32_t kReadySlots = 2;

  // `bytes_per_block` other than kBytesPerBlock makes a model of another page object size.
  TestEngine(uint32_t num_blocks, bool mla, uint32_t seed,
             uint64_t bytes_per_block = kBytesPerBlock)
      : seed_(seed) {
    platform::SimKvShape shape;
    shape.num_layers = kLayers;
    shape.num_blocks = num_blocks;
    shape.bytes_per_block = mla ? 2 * bytes_per_block : bytes_per_block;  // Same object size.
    shape.mla = mla;
    absl::StatusOr<platform::SimEngineKvCache> kv =
        platform::SimEngineKvCache::Create(platform::UniqueShmName("eng"), shape, 0);
    EXPECT_TRUE(kv.ok()) << kv.status();
    kv_ = std::make_unique<platform::SimEngineKvCache>(*std::move(kv));
    signals_name_ = platform::UniqueShmName("sig");
    signals_ = CreateSignals(signals_name_, kLoadSlots, kLayers, kReadySlots);
    gpu::testing::FillEngine(*kv_, seed_);
  }

  platform::SimEngineKvCache& kv() { return *kv_; }
  uint32_t seed() const { return seed_; }
  // Empty when device block `block` holds the bytes block `source` of an engine seeded `seed`
  // had.
  std::string CheckBlock(uint32_t block, uint32_t seed, uint32_t source) {
    return gpu::testing::CheckBlock(*kv_, block, seed, source);
  }
  // The whole KV memory, to check that nothing changed.
  std::string Snapshot() {
    return std::string(reinterpret_cast<const char*>(kv_->memory().data()), kv_->memory().size());
  }
  uint64_t Word(uint64_t offset) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(signals_.data() + offset))
        .load(std::memory_order_acquire);
  }
  uint64_t LayerWord(uint32_t slot, uint32_t layer) const {
    return Word(SimCounterChannel::kHeaderBytes +
                slot * SimCounterChannel::LoadSlotStride(kLayers) + 8 * layer);
  }
  uint64_t OpWord(uint32_t slot) const { return LayerWord(slot, kLayers); }
  void PublishReady(uint32_t slot, uint64_t token) {
    const uint64_t offset = SimCounterChannel::kHeaderBytes +
                            kLoadSlots * SimCounterChannel::LoadSlotStride(kLayers) + slot * 64;
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(signals_.data() + offset))
        .store(token, std::memory_order_release);
  }

  v1::RegisterEngineRequest Register(const std::string& instance, uint32_t rank,
                                     const v1::NamespaceSpec& spec) const {
    v1::RegisterEngineRequest r;
    r.set_instance_id(instance);
    r.set_rank(rank);
    r.set_role(v1::SESSION_ROLE_WORKER);
    *r.mutable_namespace_spec() = spec;
    r.mutable_device()->set_kind(v1::DEVICE_KIND_SIM);
    r.mutable_device()->set_uuid(std::string(16, static_cast<char>(seed_)));
    r.mutable_device()->set_name("sim");
    SimLayoutProto(kv_->layout(), r.mutable_layout());
    v1::CompletionChannel* c = r.mutable_completion();
    c->set_num_load_slots(kLoadSlots);
    c->set_num_ready_slots(kReadySlots);
    c->mutable_sim_counters()->set_shm_name(signals_name_);
    c->mutable_sim_counters()->set_size_bytes(signals_.size());
    r.set_engine_name("test-engine");
    return r;
  }

  uint64_t session = 0;

 private:
  uint32_t seed_;
  std::unique_ptr<platform::SimEngineKvCache> kv_;
  std::string signals_name_;
  platform::ShmMapping signals_;
};

struct HarnessOptions {
  uint64_t pool_bytes = 4 * kRegionBytes;
  int64_t lease_ms = 10000;
  int64_t pin_lease_ms = 30000;
  int64_t max_batch_pages = 64;
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  absl::Duration housekeeping_interval = absl::Milliseconds(10);
  // storage.* (L3): tiers "" = none.
  StorageConfig storage = DefaultConfig().storage;
  // The devices: `primary` (e.g. a fake CUDA backend; not owned, outlives the harness) first when
  // set, then the harness's sim device unless `serve_sim` is false.
  gpu::DeviceBackend* primary = nullptr;
  bool serve_sim = true;
  // tenants.allow: "" = every tenant to every peer.
  std::string tenants_allow;
};

class CacheHarness {
 public:
  explicit CacheHarness(HarnessOptions o = {}) {
    pool_ = SmallPool(o.pool_bytes);
    gpu::SimDevice::Options sim;
    sim.copy_threads = 2;
    absl::StatusOr<std::unique_ptr<gpu::SimDevice>> d = gpu::SimDevice::Create(sim);
    EXPECT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);

    Config config = DefaultConfig();
    config.sessions.lease_ms = o.lease_ms;
    config.sessions.pin_lease_ms = o.pin_lease_ms;
    config.server.max_batch_pages = o.max_batch_pages;
    config.pool.high_watermark = o.high_watermark;
    config.pool.low_watermark = o.low_watermark;
    config.storage = o.storage;
    config.tenants.allow = o.tenants_allow;
    absl::StatusOr<std::unique_ptr<L3Tiers>> l3 = L3Tiers::Open(o.storage);
    EXPECT_TRUE(l3.ok()) << l3.status();
    if (l3.ok()) l3_ = *std::move(l3);
    CacheOptions options;
    options.config = config;
    options.pool = pool_.get();
    if (o.primary != nullptr) {
      EXPECT_TRUE(options.devices.Add(o.primary).ok());
    }
    if (o.serve_sim) {
      EXPECT_TRUE(options.devices.Add(device_.get()).ok());
    }
    options.daemon_epoch = 42;
    options.l3 = l3_.get();
    options.metrics = &registry_;
    options.housekeeping_interval = o.housekeeping_interval;
    cache_ = std::make_unique<Cache>(std::move(options));
    service_ = std::make_unique<CacheServiceImpl>(cache_.get(), &credentials_);

    // Served as the daemon serves its engine socket: UnixListener accepts, so every call carries
    // the kernel's peer credentials (this test process's uid, gid and pid).
    static std::atomic<int> counter{0};
    socket_ = absl::StrCat("/tmp/kvc-cache-test-", getpid(), "-", counter.fetch_add(1), ".sock");
    ::unlink(socket_.c_str());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    absl::StatusOr<std::unique_ptr<UnixListener>> listener =
        UnixListener::Start(socket_, server_.get(), &credentials_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (listener.ok()) listener_ = *std::move(listener);
    stub_ = v1::CacheService::NewStub(
        grpc::CreateChannel(absl::StrCat("unix:", socket_), grpc::InsecureChannelCredentials()));
  }

  ~CacheHarness() {
    listener_.reset();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_.reset();
    service_.reset();
    cache_.reset();
    l3_.reset();
    device_.reset();
    pool_.reset();
    ::unlink(socket_.c_str());
  }

  // The composition root behind the service: its components, counts and housekeeping.
  Cache& cache() { return *cache_; }
  core::HostPool& pool() { return *pool_; }
  L3Tiers& l3() { return *l3_; }
  MetricsRegistry& registry() { return registry_; }

#define KVC_RPC(Name, Req, Resp)                                                   \
  Rpc Name(const v1::Req& req, v1::Resp* resp) {                                   \
    grpc::ClientContext ctx;                                                       \
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30)); \
    grpc::Status s = stub_->Name(&ctx, req, resp);                                 \
    return Outcome(ctx, std::move(s));                                             \
  }
  KVC_RPC(RegisterEngine, RegisterEngineRequest, RegisterEngineResponse)
  KVC_RPC(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  KVC_RPC(UnregisterEngine, UnregisterEngineRequest, UnregisterEngineResponse)
  KVC_RPC(Match, MatchRequest, MatchResponse)
  KVC_RPC(Prefetch, PrefetchRequest, PrefetchResponse)
  KVC_RPC(Load, LoadRequest, LoadResponse)
  KVC_RPC(Backup, BackupRequest, BackupResponse)
  KVC_RPC(WaitOps, WaitOpsRequest, WaitOpsResponse)
  KVC_RPC(Release, ReleaseRequest, ReleaseResponse)
#undef KVC_RPC

  // Registers `engine`; returns the reply (and sets engine.session).
  v1::RegisterEngineResponse Register(TestEngine& engine, const std::string& instance,
                                      uint32_t rank, const v1::NamespaceSpec& spec) {
    v1::RegisterEngineResponse resp;
    Rpc r = RegisterEngine(engine.Register(instance, rank, spec), &resp);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    engine.session = resp.session_id();
    return resp;
  }

  uint64_t RegisterScheduler(const std::string& instance, const v1::NamespaceSpec& spec) {
    v1::RegisterEngineRequest req;
    req.set_instance_id(instance);
    req.set_role(v1::SESSION_ROLE_SCHEDULER);
    *req.mutable_namespace_spec() = spec;
    v1::RegisterEngineResponse resp;
    Rpc r = RegisterEngine(req, &resp);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    return resp.session_id();
  }

  // The keys of `tokens` in the namespace of `spec`.
  static std::vector<core::PageKey> Keys(const v1::NamespaceSpec& spec,
                                         const std::vector<uint32_t>& tokens) {
    const core::NamespaceSpec s = CoreSpec(spec);
    return core::ComputePageKeys(s.Digest(), tokens, s.page_size);
  }

  // Backs up keys[begin, end) from blocks, one sequence; returns the reply.
  v1::BackupResponse Backup(uint64_t session, const std::vector<core::PageKey>& keys, size_t begin,
                            size_t end, const std::vector<uint32_t>& blocks, Rpc* rpc = nullptr) {
    v1::BackupRequest req;
    req.set_session_id(session);
    v1::BackupSequence* seq = req.add_sequences();
    if (begin > 0) seq->set_parent_key(std::string(keys[begin - 1].AsBytes()));
    seq->set_page_keys(KeyBlob(keys, begin, end));
    for (uint32_t b : blocks) seq->add_device_blocks(b);
    v1::BackupResponse resp;
    Rpc r = Backup(req, &resp);
    if (rpc != nullptr) {
      *rpc = r;
    } else {
      EXPECT_TRUE(r.ok()) << r.status.error_message();
    }
    return resp;
  }

  // A Backup of `keys` (one sequence from page 0) from `blocks`, gated on ready token `token` of
  // ready slot `slot`: PENDING until the engine publishes it.
  static v1::BackupRequest GatedBackup(uint64_t session, const std::vector<core::PageKey>& keys,
                                       const std::vector<uint32_t>& blocks, uint32_t slot,
                                       uint64_t token) {
    v1::BackupRequest req;
    req.set_session_id(session);
    v1::BackupSequence* seq = req.add_sequences();
    seq->set_page_keys(KeyBlob(keys));
    for (uint32_t b : blocks) seq->add_device_blocks(b);
    req.mutable_ready()->set_slot(slot);
    req.mutable_ready()->set_sim_token(token);
    return req;
  }

  // Waits (up to 10 s) for op `id`; returns its result.
  v1::OpResult Wait(uint64_t session, uint64_t id) {
    v1::WaitOpsRequest req;
    req.set_session_id(session);
    req.add_op_ids(id);
    req.set_timeout_ms(10000);
    v1::WaitOpsResponse resp;
    Rpc r = WaitOps(req, &resp);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    return resp.ops_size() == 1 ? resp.ops(0) : v1::OpResult();
  }

  // A Match of one sequence by token ids, expected to succeed; with `pin`, the hit is pinned.
  v1::MatchResponse MatchTokens(uint64_t session, const std::vector<uint32_t>& tokens,
                                bool pin = false) {
    v1::MatchRequest req;
    req.set_session_id(session);
    req.set_pin(pin);
    req.add_sequences()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
    v1::MatchResponse resp;
    Rpc r = Match(req, &resp);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    return resp;
  }

  uint32_t L2Hits(uint64_t session, const std::vector<uint32_t>& tokens) {
    v1::MatchResponse resp = MatchTokens(session, tokens);
    return resp.results_size() == 1 ? resp.results(0).l2_hit_pages() : 0;
  }

  // Index statistics summed over namespaces.
  core::RadixIndexStats IndexStats() {
    core::RadixIndexStats total;
    for (const auto& ns : cache_->namespaces().Snapshot()) {
      if (ns->index() == nullptr) continue;
      core::RadixIndexStats s = ns->index()->Stats();
      total.pages += s.pages;
      total.l2_objects += s.l2_objects;
      total.l2_inflight_objects += s.l2_inflight_objects;
      total.pinned_pages += s.pinned_pages;
      total.pins += s.pins;
      total.evicted_pages += s.evicted_pages;
    }
    return total;
  }

  uint64_t PoolSlotsUsed() { return SlotsUsed(*pool_); }

  // Drops every page of every namespace (as an admin Clear would) and frees the slots.
  void ClearIndexes() {
    for (const auto& ns : cache_->namespaces().Snapshot()) {
      if (ns->index() == nullptr) continue;
      std::vector<core::ReleasedObject> released;
      ns->index()->Clear(&released);
      for (const core::ReleasedObject& r : released) {
        if (r.slot.valid()) {
          EXPECT_TRUE(pool_->Free(r.slot).ok());
        }
      }
    }
  }

 private:
  MetricsRegistry registry_;
  std::unique_ptr<core::HostPool> pool_;
  std::unique_ptr<gpu::SimDevice> device_;
  std::unique_ptr<L3Tiers> l3_;
  std::unique_ptr<Cache> cache_;
  std::unique_ptr<CacheServiceImpl> service_;
  std::string socket_;
  PeerCredentials credentials_;  // Outlives the service and the listener.
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> listener_;
  std::unique_ptr<v1::CacheService::Stub> stub_;
};

}  // namespace kvcellar::server::testing

#endif  // KVCELLAR_TESTS_SERVER_CACHE_TEST_HARNESS_H_
