#include "tests/bench/cuda/cuda_bench_env.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/splitmix.h"

namespace kvcellar::bench {
namespace {

// Host pages are allocated in huge-page-sized steps, as the daemon's pool regions are.
constexpr uint64_t kHostAlign = 2ull << 20;
// Starting kvcellard pins and registers its pool (about 1 s per 4 GiB); generous for a busy host.
constexpr absl::Duration kDaemonStartTimeout = absl::Seconds(120);
// kvcellard's pool region (and so its largest slot): the largest page object here is 2 MiB blocks
// x 80 layers x K/V = 320 MiB, above the default 64 MiB.
constexpr uint64_t kDaemonRegionBytes = 512ull << 20;
// Registration maps the engine's pool in the daemon (cudaIpcOpenMemHandle per region).
constexpr absl::Duration kRegisterTimeout = absl::Seconds(30);

void DestroyBackend(Backend& b) {
  b.mappings.clear();  // Each waits for its streams to drain.
  if (b.host != nullptr) {
    b.device->UnregisterHostMemory(b.host).IgnoreError();
    ::free(b.host);
  }
  b.host = nullptr;
  b.host_bytes = 0;
}

}  // namespace

std::string BackendKey::Name() const {
  switch (path) {
    case gpu::CudaDeviceOptions::CopyPath::kMemcpy:
      return "copy engine";
    case gpu::CudaDeviceOptions::CopyPath::kKernel:
      return absl::StrCat("kernel x", kernel_blocks);
    case gpu::CudaDeviceOptions::CopyPath::kAuto:
      break;
  }
  return "auto";
}

CudaBenchEnv::~CudaBenchEnv() {
  daemon_engines_.clear();  // Sessions close first: kvcellard unmaps the pools.
  for (auto& [key, b] : backends_) DestroyBackend(*b);
  backends_.clear();
  for (auto& e : engines_) {
    if (e != nullptr) e->Finish();
  }
  engines_.clear();
  if (daemon_) daemon_->Stop();
  if (!options_.keep_dir && !dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

void CudaBenchEnv::ReleaseEngine(int i) {
  daemon_engines_.erase(i);
  for (auto& [key, b] : backends_) b->mappings.erase(i);
}

absl::StatusOr<gpu::testing::CudaEngineProcess*> CudaBenchEnv::Engine(
    int i, const gpu::testing::PoolShape& shape) {
  if (i < 0) return absl::InvalidArgumentError("engine index");
  if (engines_.size() <= static_cast<size_t>(i)) {
    engines_.resize(i + 1);
    layouts_.resize(i + 1);
  }
  if (engines_[i] == nullptr || !engines_[i]->running()) {
    // First use, or the engine died or was ended for not answering: a fresh one.
    ReleaseEngine(i);
    engines_[i].reset();
    absl::StatusOr<std::unique_ptr<gpu::testing::CudaEngineProcess>> e =
        gpu::testing::CudaEngineProcess::Spawn({options_.self});
    if (!e.ok()) return e.status();
    engines_[i] = *std::move(e);
  }
  gpu::testing::CudaEngineProcess* e = engines_[i].get();
  if (e->shape().has_value() && *e->shape() == shape) return e;
  ReleaseEngine(i);
  absl::StatusOr<core::KvLayout> layout = e->Alloc(shape, kPoolSeed);
  if (!layout.ok()) return layout.status();
  layouts_[i] = *std::move(layout);
  return e;
}

absl::StatusOr<Backend*> CudaBenchEnv::GetBackend(const BackendKey& key, uint64_t host_bytes) {
  std::unique_ptr<Backend>& slot = backends_[key];
  if (slot == nullptr) {
    gpu::CudaDeviceOptions o;
    o.copy_path = key.path;
    o.kernel_max_blocks = key.kernel_blocks;
    absl::StatusOr<std::unique_ptr<gpu::DeviceBackend>> dev = gpu::CreateCudaDevice(o);
    if (!dev.ok()) {
      backends_.erase(key);
      return dev.status();
    }
    slot = std::make_unique<Backend>();
    slot->key = key;
    slot->device = *std::move(dev);
  }
  Backend* b = slot.get();
  if (b->host_bytes >= host_bytes) return b;
  DestroyBackend(*b);
  const uint64_t bytes = (host_bytes + kHostAlign - 1) / kHostAlign * kHostAlign;
  b->host = static_cast<uint8_t*>(::aligned_alloc(kHostAlign, bytes));
  if (b->host == nullptr) return absl::ResourceExhaustedError("host pages: aligned_alloc failed");
  std::memset(b->host, 0x3c, bytes);  // Faults every page in before it is pinned.
  if (absl::Status s = b->device->RegisterHostMemory(b->host, bytes); !s.ok()) {
    ::free(b->host);
    b->host = nullptr;
    return s;
  }
  b->host_bytes = bytes;
  return b;
}

absl::StatusOr<gpu::EngineMapping*> CudaBenchEnv::Mapping(Backend* backend, int i) {
  if (i < 0 || static_cast<size_t>(i) >= engines_.size() || engines_[i] == nullptr ||
      !engines_[i]->shape().has_value()) {
    return absl::FailedPreconditionError("engine has no pool");
  }
  auto it = backend->mappings.find(i);
  if (it != backend->mappings.end()) return it->second.get();
  gpu::EngineSpec spec;
  spec.device_uuid = engines_[i]->device_uuid();
  spec.layout = layouts_[i];
  spec.cuda_load_events =
      engines_[i]->load_events(gpu::testing::kLoadSlots, engines_[i]->shape()->layers);
  absl::StatusOr<std::unique_ptr<gpu::EngineMapping>> m = backend->device->OpenEngine(spec);
  if (!m.ok()) return m.status();
  gpu::EngineMapping* out = m->get();
  backend->mappings[i] = *std::move(m);
  return out;
}

absl::Status CudaBenchEnv::StartDaemon() {
  char tmpl[] = "/tmp/kvcellar-bench-cuda-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  dir_ = tmpl;
  daemon_socket_ = dir_ + "/kvcellard.sock";
  std::vector<std::string> argv = {
      options_.kvcellard,
      "--set",
      absl::StrCat("listen.unix_socket=", daemon_socket_),
      "--set",
      absl::StrCat("listen.admin_socket=", dir_, "/kvcellard-admin.sock"),
      "--set",
      "http.address=127.0.0.1:0",
      "--set",
      absl::StrCat("pool.capacity=", options_.daemon_pool_bytes >> 20, "MiB"),
      "--set",
      absl::StrCat("pool.region_size=", kDaemonRegionBytes >> 20, "MiB"),
      "--set",
      "device.kind=cuda",
  };
  absl::StatusOr<ChildProcess> daemon = ChildProcess::Spawn(argv, dir_ + "/kvcellard.log");
  if (!daemon.ok()) return daemon.status();
  daemon_.emplace(*std::move(daemon));
  if (absl::Status s = daemon_->WaitForLogLine("msg=ready", kDaemonStartTimeout); !s.ok()) {
    daemon_.reset();
    return absl::Status(s.code(), absl::StrCat("kvcellard: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<client::Session*> CudaBenchEnv::Session(int i) {
  if (i < 0 || static_cast<size_t>(i) >= engines_.size() || engines_[i] == nullptr ||
      !engines_[i]->shape().has_value()) {
    return absl::FailedPreconditionError("engine has no pool");
  }
  auto it = daemon_engines_.find(i);
  if (it != daemon_engines_.end()) return it->second.session.get();
  if (!daemon_) {
    if (absl::Status s = StartDaemon(); !s.ok()) return s;
  }
  gpu::testing::CudaEngineProcess& e = *engines_[i];
  const gpu::testing::PoolShape shape = *e.shape();
  DaemonEngine de;
  client::ClientOptions co;
  co.addr = daemon_socket_;
  co.key_cache_bytes = 0;
  // A Load or Backup of a few hundred MiB is submitted, not waited for, within the RPC; the
  // library's 250 ms default would still be tight for a loaded host.
  co.rpc_timeout = absl::Seconds(5);
  co.register_timeout = kRegisterTimeout;
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(co);
  if (!c.ok()) return c.status();
  de.client = *std::move(c);

  absl::StatusOr<std::string> uuid = gpu::NormalizeDeviceUuid(e.device_uuid());
  if (!uuid.ok()) return uuid.status();
  client::EngineRegistration reg;
  reg.instance_id = absl::StrCat("bench-cuda-", ::getpid(), "-", next_instance_++);
  // One namespace per pool geometry: a namespace's page object size is fixed.
  reg.ns.model_id = absl::StrCat("bench-cuda-", shape.bytes_per_block, "b-", shape.layers, "l");
  reg.ns.model_revision = "rev1";
  reg.ns.kv_dtype = "bf16";
  reg.ns.page_size = 16;
  reg.ns.layout = core::LayoutKind::kMha;
  reg.ns.tp_size = 1;
  reg.ns.opaque_keys = true;
  reg.engine_name = "kvcellar_bench_cuda";
  reg.device_kind = client::DeviceKind::kCuda;
  reg.device_uuid = absl::HexStringToBytes(*uuid);
  reg.layout = layouts_[i];
  reg.completion.num_load_slots = gpu::testing::kLoadSlots;
  reg.completion.num_ready_slots = gpu::testing::kReadySlots;
  for (const std::string& h : e.load_events(gpu::testing::kLoadSlots, shape.layers)) {
    reg.completion.cuda_load_event_handles += h;
  }
  for (uint32_t r = 0; r < gpu::testing::kReadySlots; ++r) {
    reg.completion.cuda_ready_event_handles += e.ready_event(r);
  }
  absl::StatusOr<std::unique_ptr<client::Session>> session = de.client->Register(reg);
  if (!session.ok()) return session.status();
  de.session = *std::move(session);
  if (!de.session->WaitUntilActive(absl::Seconds(10))) {
    return absl::UnavailableError(
        absl::StrCat("session not active: ", client::SessionStateName(de.session->state())));
  }
  if (de.session->info().page_object_bytes != shape.object_bytes()) {
    return absl::InternalError(absl::StrCat("daemon page_object_bytes ",
                                            de.session->info().page_object_bytes,
                                            " != ", shape.object_bytes()));
  }
  client::Session* out = de.session.get();
  daemon_engines_.emplace(i, std::move(de));
  return out;
}

std::vector<core::PageKey> CudaBenchEnv::Keys(size_t n) {
  std::vector<core::PageKey> keys(n);
  for (core::PageKey& k : keys) {
    const uint64_t id = next_key_.fetch_add(1);
    for (int w = 0; w < 4; ++w) {
      const uint64_t v = core::SplitMix64(id * 4 + w);
      std::memcpy(k.bytes.data() + 8 * w, &v, sizeof(v));
    }
  }
  return keys;
}

}  // namespace kvcellar::bench
