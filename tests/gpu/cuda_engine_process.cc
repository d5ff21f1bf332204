#include "tests/gpu/cuda_engine_process.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gpu/device_backend.h"
#include "tests/gpu/sim_test_util.h"
#include "tests/gpu/tiled_gemm.h"

extern char** environ;

namespace kvcellar::gpu::testing {
namespace {

// The engine's ends of its pipes are moved to these fds (dup2 clears close-on-exec), far above
// what a test process has open, so that no other fd of the parent is inherited.
constexpr int kChildInFd = 200;
constexpr int kChildOutFd = 201;
// Elements of C the first GEMM of a size is checked on against float64.
constexpr int kGemmSamples = 64;
// float32 accumulation over n terms of magnitude <= 1: the relative bound used is loose enough
// for any summation order and tight enough to catch a wrong index.
constexpr double kGemmTolerance = 1e-4;
// GEMMs timed per command at least (a median of fewer says little), and at most.
constexpr int kMinGemms = 3;
constexpr int kMaxGemms = 100000;

std::string Hex(const void* p, size_t n) {
  return absl::BytesToHexString(absl::string_view(static_cast<const char*>(p), n));
}

absl::Status Cuda(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

bool WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Reads one line (without '\n') from `fd` through `buffer`; false at EOF or on error.
bool ReadLine(int fd, std::string* buffer, std::string* line) {
  while (true) {
    const size_t nl = buffer->find('\n');
    if (nl != std::string::npos) {
      *line = buffer->substr(0, nl);
      buffer->erase(0, nl + 1);
      return true;
    }
    char chunk[4096];
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    buffer->append(chunk, static_cast<size_t>(n));
  }
}

// ---- The engine's side -------------------------------------------------------------------------

class Engine {
 public:
  ~Engine() {
    // Best effort at exit: the process is ending anyway.
    FreePool().IgnoreError();
    for (void* p : {static_cast<void*>(a_), static_cast<void*>(b_), static_cast<void*>(c_)}) {
      if (p != nullptr) cudaFree(p);
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Creates the events and the stream; the hello line's text after "hello ".
  absl::StatusOr<std::string> Start() {
    if (absl::Status s = Cuda(cudaSetDevice(0), "cudaSetDevice"); !s.ok()) return s;
    if (absl::Status s = Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    cudaDeviceProp prop;
    if (absl::Status s = Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
        !s.ok()) {
      return s;
    }
    std::string ready, load;
    for (uint32_t i = 0; i < kReadySlots + kLoadSlots * kEventLayers; ++i) {
      cudaEvent_t ev;
      if (absl::Status s = Cuda(cudaEventCreateWithFlags(
                                    &ev, cudaEventDisableTiming | cudaEventInterprocess),
                                "cudaEventCreateWithFlags");
          !s.ok()) {
        return s;
      }
      events_.push_back(ev);
      // Recorded once: a daemon waiting on a ready event finds "the forward pass is done".
      if (absl::Status s = Cuda(cudaEventRecord(ev, stream_), "cudaEventRecord"); !s.ok()) {
        return s;
      }
      cudaIpcEventHandle_t h;
      if (absl::Status s = Cuda(cudaIpcGetEventHandle(&h, ev), "cudaIpcGetEventHandle");
          !s.ok()) {
        return s;
      }
      absl::StrAppend(i < kReadySlots ? &ready : &load, Hex(&h, sizeof(h)));
    }
    if (absl::Status s = Cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); !s.ok()) {
      return s;
    }
    return absl::StrCat(FormatGpuUuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes)), " ",
                        ready, " ", load);
  }

  // One command line; the answer's text after "ok" (possibly empty).
  absl::StatusOr<std::string> Handle(const std::string& line) {
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    std::vector<uint64_t> n(w.size(), 0);
    for (size_t i = 1; i < w.size(); ++i) {
      if (!absl::SimpleAtoi(w[i], &n[i])) {
        return absl::InvalidArgumentError(absl::StrCat("not a number: ", w[i]));
      }
    }
    if (w.size() == 5 && w[0] == "alloc") {
      return Alloc({static_cast<uint32_t>(n[1]), n[2], static_cast<uint32_t>(n[3])},
                   static_cast<uint32_t>(n[4]));
    }
    if (w.size() == 5 && w[0] == "check") {
      absl::Status s = Check(static_cast<uint32_t>(n[1]), static_cast<uint32_t>(n[2]),
                             static_cast<uint32_t>(n[3]), static_cast<uint32_t>(n[4]));
      if (!s.ok()) return s;
      return std::string();
    }
    if (w.size() == 3 && w[0] == "gemm") {
      return Gemm(static_cast<int>(n[1]), static_cast<int>(n[2]));
    }
    if (w.size() == 1 && w[0] == "free") {
      if (absl::Status s = FreePool(); !s.ok()) return s;
      return std::string();
    }
    return absl::InvalidArgumentError(absl::StrCat("unknown command: ", line));
  }

 private:
  absl::Status FreePool() {
    if (pool_ == nullptr) return absl::OkStatus();
    const absl::Status s = Cuda(cudaFree(pool_), "cudaFree(pool)");
    pool_ = nullptr;
    return s;
  }

  absl::StatusOr<std::string> Alloc(const PoolShape& shape, uint32_t seed) {
    if (shape.layers == 0 || shape.layers > kEventLayers || shape.bytes_per_block == 0 ||
        shape.bytes_per_block % 8 != 0 || shape.blocks == 0) {
      return absl::InvalidArgumentError("alloc: bad shape");
    }
    if (absl::Status s = FreePool(); !s.ok()) return s;
    if (absl::Status s = Cuda(cudaMalloc(reinterpret_cast<void**>(&pool_), shape.pool_bytes()), "cudaMalloc(pool)");
        !s.ok()) {
      pool_ = nullptr;
      return s;
    }
    shape_ = shape;
    // One (layer, buffer) at a time through a host staging buffer: every block's own pattern.
    const uint64_t span = uint64_t{shape.blocks} * shape.bytes_per_block;
    std::vector<uint8_t> host(span);
    for (uint32_t l = 0; l < shape.layers; ++l) {
      for (uint32_t b = 0; b < 2; ++b) {
        for (uint32_t k = 0; k < shape.blocks; ++k) {
          FillPattern(host.data() + uint64_t{k} * shape.bytes_per_block, shape.bytes_per_block,
                      seed, l, b, k);
        }
        if (absl::Status s = Cuda(cudaMemcpy(pool_ + LayerFirstOffset(shape, l, b, 0),
                                             host.data(), span, cudaMemcpyHostToDevice),
                                  "cudaMemcpy(fill)");
            !s.ok()) {
          return s;
        }
      }
    }
    // A cudaMemcpy from pageable memory may return once the bytes are staged, before they reach
    // the pool; the daemon reads them from another process, which no stream order covers.
    if (absl::Status s = Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(fill)"); !s.ok()) {
      return s;
    }
    cudaIpcMemHandle_t h;
    if (absl::Status s = Cuda(cudaIpcGetMemHandle(&h, pool_), "cudaIpcGetMemHandle"); !s.ok()) {
      return s;
    }
    return Hex(&h, sizeof(h));
  }

  absl::Status Check(uint32_t dst, uint32_t src, uint32_t n, uint32_t seed) {
    if (pool_ == nullptr) return absl::FailedPreconditionError("check: no pool");
    if (uint64_t{dst} + n > shape_.blocks || uint64_t{src} + n > shape_.blocks) {
      return absl::InvalidArgumentError("check: blocks out of range");
    }
    const uint64_t bpb = shape_.bytes_per_block;
    std::vector<uint8_t> host(uint64_t{n} * bpb);
    for (uint32_t l = 0; l < shape_.layers; ++l) {
      for (uint32_t b = 0; b < 2; ++b) {
        if (absl::Status s = Cuda(cudaMemcpy(host.data(), pool_ + LayerFirstOffset(shape_, l, b, dst),
                                             host.size(), cudaMemcpyDeviceToHost),
                                  "cudaMemcpy(check)");
            !s.ok()) {
          return s;
        }
        for (uint32_t i = 0; i < n; ++i) {
          if (!HoldsPattern(host.data() + uint64_t{i} * bpb, bpb, seed, l, b, src + i)) {
            return absl::DataLossError(absl::StrCat("block ", dst + i, " layer ", l, " buffer ",
                                                    b, " does not hold block ", src + i, "'s"));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status PrepareGemm(int n) {
    if (n == gemm_n_) return absl::OkStatus();
    for (float** p : {&a_, &b_, &c_}) {
      if (*p != nullptr) cudaFree(*p);
      *p = nullptr;
    }
    gemm_n_ = 0;
    const size_t count = size_t(n) * n;
    for (float** p : {&a_, &b_, &c_}) {
      if (absl::Status s = Cuda(cudaMalloc(reinterpret_cast<void**>(p), count * sizeof(float)), "cudaMalloc(gemm)");
          !s.ok()) {
        *p = nullptr;
        return s;
      }
    }
    if (absl::Status s = Cuda(LaunchFillUniform(a_, count, 1, stream_), "fill A"); !s.ok()) {
      return s;
    }
    if (absl::Status s = Cuda(LaunchFillUniform(b_, count, 2, stream_), "fill B"); !s.ok()) {
      return s;
    }
    if (absl::Status s = Cuda(LaunchTiledGemm(a_, b_, c_, n, stream_), "gemm"); !s.ok()) return s;
    if (absl::Status s = Cuda(cudaStreamSynchronize(stream_), "gemm sync"); !s.ok()) return s;
    // Sampled elements against float64, so that a timing never comes from a wrong kernel.
    std::vector<float> a(count), b(count), c(count);
    for (auto [dst, src] : {std::pair{&a, a_}, std::pair{&b, b_}, std::pair{&c, c_}}) {
      if (absl::Status s = Cuda(
              cudaMemcpy(dst->data(), src, count * sizeof(float), cudaMemcpyDeviceToHost),
              "cudaMemcpy(gemm check)");
          !s.ok()) {
        return s;
      }
    }
    for (int s = 0; s < kGemmSamples; ++s) {
      const size_t i = (size_t(s) * 7919) % n;
      const size_t j = (size_t(s) * 104729 + 13) % n;
      double ref = 0, scale = 0;
      for (int k = 0; k < n; ++k) {
        ref += double(a[i * n + k]) * double(b[size_t(k) * n + j]);
        scale += std::fabs(double(a[i * n + k]) * double(b[size_t(k) * n + j]));
      }
      if (std::fabs(double(c[i * n + j]) - ref) > kGemmTolerance * scale + 1e-6) {
        return absl::InternalError(absl::StrCat("gemm: C[", i, "][", j, "] = ", c[i * n + j],
                                                ", float64 reference ", ref));
      }
    }
    gemm_n_ = n;
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Gemm(int n, int millis) {
    if (n <= 0 || n % kGemmTile != 0) {
      return absl::InvalidArgumentError(absl::StrCat("gemm: n must be a multiple of ", kGemmTile));
    }
    if (absl::Status s = PrepareGemm(n); !s.ok()) return s;
    cudaEvent_t start, stop;
    if (absl::Status s = Cuda(cudaEventCreate(&start), "cudaEventCreate"); !s.ok()) return s;
    if (absl::Status s = Cuda(cudaEventCreate(&stop), "cudaEventCreate"); !s.ok()) {
      cudaEventDestroy(start);
      return s;
    }
    std::vector<double> ms;
    absl::Status st;
    const absl::Time end = absl::Now() + absl::Milliseconds(millis);
    while (st.ok() && ms.size() < kMaxGemms &&
           (absl::Now() < end || ms.size() < static_cast<size_t>(kMinGemms))) {
      st = Cuda(cudaEventRecord(start, stream_), "cudaEventRecord");
      if (st.ok()) st = Cuda(LaunchTiledGemm(a_, b_, c_, n, stream_), "gemm");
      if (st.ok()) st = Cuda(cudaEventRecord(stop, stream_), "cudaEventRecord");
      if (st.ok()) st = Cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      if (st.ok()) st = Cuda(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      if (st.ok()) ms.push_back(t);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!st.ok()) return st;
    double sum = 0;
    for (double t : ms) sum += t;
    std::sort(ms.begin(), ms.end());
    return absl::StrCat(ms.size(), " ", ms[ms.size() / 2], " ", sum / ms.size());
  }

  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // Ready events, then load events.
  uint8_t* pool_ = nullptr;
  PoolShape shape_;
  int gemm_n_ = 0;
  float* a_ = nullptr;
  float* b_ = nullptr;
  float* c_ = nullptr;
};

int RunEngine(int in, int out) {
  Engine engine;
  absl::StatusOr<std::string> hello = engine.Start();
  if (!WriteAll(out, hello.ok() ? absl::StrCat("hello ", *hello, "\n")
                                : absl::StrCat("err ", hello.status().message(), "\n"))) {
    return 1;
  }
  if (!hello.ok()) return 1;
  std::string buffer, line;
  int rc = 0;
  while (ReadLine(in, &buffer, &line)) {
    absl::StatusOr<std::string> r = engine.Handle(line);
    if (!r.ok()) rc = 1;
    std::string answer = r.ok() ? (r->empty() ? "ok\n" : absl::StrCat("ok ", *r, "\n"))
                                : absl::StrCat("err ", r.status().message(), "\n");
    std::replace(answer.begin(), answer.end() - 1, '\n', ' ');
    if (!WriteAll(out, answer)) break;
  }
  return rc;
}

}  // namespace

core::KvLayout LayerFirstLayout(const std::string& mem_handle, const PoolShape& shape) {
  core::KvLayout l;
  l.num_blocks = shape.blocks;
  const uint64_t span = uint64_t{shape.blocks} * shape.bytes_per_block;
  for (uint32_t i = 0; i < shape.layers; ++i) {
    l.regions.push_back({mem_handle, LayerFirstOffset(shape, i, 0, 0), 2 * span});
    l.layers.push_back({core::BufferLayout{i, 0, shape.bytes_per_block, shape.bytes_per_block},
                        core::BufferLayout{i, span, shape.bytes_per_block, shape.bytes_per_block}});
  }
  return l;
}

uint64_t LayerFirstOffset(const PoolShape& shape, uint32_t layer, uint32_t buffer,
                          uint32_t block) {
  const uint64_t span = uint64_t{shape.blocks} * shape.bytes_per_block;
  return (uint64_t{layer} * 2 + buffer) * span + uint64_t{block} * shape.bytes_per_block;
}

std::optional<int> MaybeRunCudaEngineProcess() {
  const char* fds = ::getenv(kEngineFdsEnv);
  if (fds == nullptr) return std::nullopt;
  std::vector<std::string> parts = absl::StrSplit(fds, ',');
  int in = -1, out = -1;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &in) || !absl::SimpleAtoi(parts[1], &out)) {
    return 2;
  }
  return RunEngine(in, out);
}

// ---- The daemon's side -------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<CudaEngineProcess>> CudaEngineProcess::Spawn(
    const std::vector<std::string>& argv, absl::Duration start_timeout) {
  if (argv.empty()) return absl::InvalidArgumentError("argv: empty");
  // A write to an engine that has died must fail (EPIPE) rather than kill this process with
  // SIGPIPE; a handler the caller installed is left alone.
  struct sigaction old_pipe;
  if (::sigaction(SIGPIPE, nullptr, &old_pipe) == 0 && old_pipe.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  int to_child[2], to_parent[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  if (::pipe2(to_parent, O_CLOEXEC) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return absl::InternalError("pipe2 failed");
  }
  auto p = std::unique_ptr<CudaEngineProcess>(new CudaEngineProcess());
  p->to_engine_ = to_child[1];
  p->from_engine_ = to_parent[0];
  if (std::max({to_child[0], to_child[1], to_parent[0], to_parent[1]}) >= kChildInFd) {
    ::close(to_child[0]);
    ::close(to_parent[1]);
    return absl::InternalError("too many open fds to spawn an engine");
  }

  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, absl::StrCat(kEngineFdsEnv, "="))) env_strings.push_back(*e);
  }
  env_strings.push_back(absl::StrCat(kEngineFdsEnv, "=", kChildInFd, ",", kChildOutFd));
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (std::string& a : args) argp.push_back(a.data());
  argp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], kChildInFd);
  posix_spawn_file_actions_adddup2(&actions, to_parent[1], kChildOutFd);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, argp[0], &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(to_parent[1]);
  if (err != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(err)));
  }
  p->pid_ = pid;

  absl::StatusOr<std::string> hello = p->Reply(start_timeout);
  if (!hello.ok()) {
    return absl::Status(hello.status().code(),
                        absl::StrCat("engine process start: ", hello.status().message()));
  }
  return p;
}

CudaEngineProcess::~CudaEngineProcess() { Finish(); }

absl::Status CudaEngineProcess::Send(const std::string& line) {
  if (to_engine_ < 0 || !WriteAll(to_engine_, line + "\n")) {
    return absl::UnavailableError("engine process: command pipe closed");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CudaEngineProcess::Reply(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (buffer_.find('\n') == std::string::npos) {
    if (from_engine_ < 0) return absl::UnavailableError("engine process: not running");
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      Finish(absl::ZeroDuration());
      return absl::DeadlineExceededError("engine process: no answer in time; killed it");
    }
    pollfd pfd{from_engine_, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(from_engine_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Finish(absl::Seconds(5));  // Reaped now, not at destruction.
      return absl::UnavailableError("engine process: exited");
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
  const size_t nl = buffer_.find('\n');
  std::string line = buffer_.substr(0, nl);
  buffer_.erase(0, nl + 1);
  if (absl::StartsWith(line, "hello ")) {
    std::vector<std::string> w = absl::StrSplit(line, ' ');
    if (w.size() != 4 || w[2].size() != 2 * kReadySlots * kCudaIpcHandleBytes ||
        w[3].size() != 2 * kLoadSlots * kEventLayers * kCudaIpcHandleBytes) {
      return absl::InternalError("engine process: malformed hello");
    }
    device_uuid_ = w[1];
    ready_handles_ = absl::HexStringToBytes(w[2]);
    load_handles_ = absl::HexStringToBytes(w[3]);
    return std::string();
  }
  if (line == "ok") return std::string();
  if (absl::StartsWith(line, "ok ")) return line.substr(3);
  if (absl::StartsWith(line, "err ")) {
    return absl::InternalError(absl::StrCat("engine process: ", line.substr(4)));
  }
  return absl::InternalError(absl::StrCat("engine process: unexpected answer: ", line));
}

std::string CudaEngineProcess::ready_event(uint32_t slot) const {
  return ready_handles_.substr(size_t{slot} * kCudaIpcHandleBytes, kCudaIpcHandleBytes);
}

std::vector<std::string> CudaEngineProcess::load_events(uint32_t slots, uint32_t layers) const {
  std::vector<std::string> out;
  for (uint32_t s = 0; s < slots && s < kLoadSlots; ++s) {
    for (uint32_t l = 0; l < layers && l < kEventLayers; ++l) {
      out.push_back(load_handles_.substr((size_t{s} * kEventLayers + l) * kCudaIpcHandleBytes,
                                         kCudaIpcHandleBytes));
    }
  }
  return out;
}

absl::StatusOr<core::KvLayout> CudaEngineProcess::Alloc(const PoolShape& shape, uint32_t seed) {
  shape_.reset();
  if (absl::Status s = Send(absl::StrCat("alloc ", shape.layers, " ", shape.bytes_per_block, " ",
                                         shape.blocks, " ", seed));
      !s.ok()) {
    return s;
  }
  // Filling a pool of a few hundred MiB through host staging takes about a second.
  absl::StatusOr<std::string> r = Reply(absl::Seconds(120));
  if (!r.ok()) return r.status();
  const std::string handle = absl::HexStringToBytes(*r);
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InternalError("engine process: malformed memory handle");
  }
  shape_ = shape;
  return LayerFirstLayout(handle, shape);
}

absl::Status CudaEngineProcess::Free() {
  shape_.reset();
  if (absl::Status s = Send("free"); !s.ok()) return s;
  return Reply(absl::Seconds(60)).status();
}

absl::Status CudaEngineProcess::Check(uint32_t dst, uint32_t src, uint32_t n, uint32_t seed) {
  if (absl::Status s = Send(absl::StrCat("check ", dst, " ", src, " ", n, " ", seed)); !s.ok()) {
    return s;
  }
  return Reply(absl::Seconds(120)).status();
}

absl::Status CudaEngineProcess::StartGemm(int n, int millis) {
  return Send(absl::StrCat("gemm ", n, " ", millis));
}

bool CudaEngineProcess::GemmDone() {
  if (buffer_.find('\n') != std::string::npos || from_engine_ < 0) return true;
  pollfd pfd{from_engine_, POLLIN, 0};
  if (::poll(&pfd, 1, 0) <= 0) return false;
  char chunk[4096];
  const ssize_t n = ::read(from_engine_, chunk, sizeof(chunk));
  if (n <= 0) return true;  // EOF or error: FinishGemm reports it.
  buffer_.append(chunk, static_cast<size_t>(n));
  return buffer_.find('\n') != std::string::npos;
}

absl::StatusOr<GemmTiming> CudaEngineProcess::FinishGemm() {
  // The first GEMM of a size is also checked on the CPU (a few seconds for n = 8192).
  absl::StatusOr<std::string> r = Reply(absl::Seconds(300));
  if (!r.ok()) return r.status();
  std::vector<std::string> w = absl::StrSplit(*r, ' ');
  GemmTiming t;
  if (w.size() != 3 || !absl::SimpleAtoi(w[0], &t.count) || !absl::SimpleAtod(w[1], &t.median_ms) ||
      !absl::SimpleAtod(w[2], &t.mean_ms)) {
    return absl::InternalError(absl::StrCat("engine process: malformed gemm answer: ", *r));
  }
  return t;
}

absl::StatusOr<GemmTiming> CudaEngineProcess::Gemm(int n, int millis) {
  if (absl::Status s = StartGemm(n, millis); !s.ok()) return s;
  return FinishGemm();
}

int CudaEngineProcess::Finish(absl::Duration grace) {
  if (to_engine_ >= 0) ::close(to_engine_);  // EOF: the engine frees everything and exits.
  to_engine_ = -1;
  int status = -1;
  if (pid_ > 0) {
    const absl::Time deadline = absl::Now() + grace;
    int st = 0;
    pid_t r;
    while ((r = ::waitpid(pid_, &st, WNOHANG)) == 0) {
      if (absl::Now() > deadline) {
        ::kill(pid_, SIGKILL);
        r = ::waitpid(pid_, &st, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    status = r == pid_ ? st : -1;
    pid_ = -1;
  }
  if (from_engine_ >= 0) ::close(from_engine_);
  from_engine_ = -1;
  return status;
}

}  // namespace kvcellar::gpu::testing
