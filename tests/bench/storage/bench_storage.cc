// L3 backend throughput, each figure beside a baseline measured in the same run on the same
// machine and directory:
//
//   BM_FileWrite/<object bytes>/<direct>  FileBackend Put at queue depth 16 (16 objects always in
//       flight, one object per batch) vs fio (io_uring, O_DIRECT, bs = object size, iodepth 16) in
//       the same directory, twice: one sequential file (fio_*: the device's ceiling) and one file
//       per object, 16 open at a time, created on open (fio_files_*: the same per-object file
//       system work, minus our rename and header). Also the page cache growth while writing:
//       /proc/meminfo "Cached:" delta / bytes written (O_DIRECT should leave it near 0; direct=0
//       is the buffered contrast).
//   BM_FileRead/<object bytes>            FileBackend Get at queue depth 16, cold cache, random
//       order vs fio randread (same engine, size and depth; one file, and one file per object)
//       and vs a one-file-per-page buffered loop (open, read, close, one thread: what a naive
//       per-page file cache does).
//   BM_FileScan/<objects>                 the file tier's startup scan (FileBackend::Open until
//       its scan result arrives: list every directory, read and check every object's header, hand
//       the parent links over), in objects per second, vs two plain walks of the same tree in the
//       same run: opendir/readdir/fstatat of every entry (walk_Mobj_s: what a names-only scan
//       costs) and opendir/readdir/open/pread 160 bytes/close (headers_Mobj_s: reading each
//       header with nothing else). Objects are sparse files (64 KiB payload, a 4 KiB header block
//       on disk) in the tier's layout, caches dropped before each pass.
//   BM_Crc32c/<bytes>/<hardware>          the checksum every read and write pays (SSE4.2 three-way vs
//       the slicing-by-8 table).
//   BM_RedisSet/<bytes>, BM_RedisGet/<bytes>  RedisBackend, batches of 16 objects, two in flight,
//       over 4 pipelined connections (32 objects in flight) vs `redis-benchmark -c 32 -P 1
//       -d <bytes> -r <n/4>` (32 in flight, random keys) against the same server (unix socket).
//       The backend keeps its index (storage/redis_index.h), as the daemon does by default.
//   BM_RedisSetIndexCost/<bytes>  what the index costs per write: the same SET passes as
//       BM_RedisSet through two backends on the same server, one with the index (SET + HSET per
//       object) and one without (SET only), three rounds each, alternating which goes first;
//       ops_per_s_index, ops_per_s_plain (best pass of each) and index_ratio = index / plain.
//
// Caches are dropped (echo 3 > /proc/sys/vm/drop_caches, needs root) before each read phase; the
// counter `caches_dropped` says whether that worked. fio and redis-benchmark rows are skipped
// (counter 0) where the tool is missing.
//
// Environment: KVCELLAR_BENCH_DIR (default /var/tmp/kvcellar-bench; use the device under test),
// KVCELLAR_BENCH_MIB (data per file benchmark, default 1024), KVCELLAR_BENCH_REDIS_MIB (default
// 512), KVCELLAR_BENCH_ENGINE=pool (file backend on the thread-pool engine instead of io_uring),
// KVCELLAR_BENCH_DROP (what to write to drop_caches, default 3; 1 keeps dentries and inodes).
//
// Each benchmark is one long iteration with manual timing; run with --benchmark_repetitions=N to
// see the spread (shared VMs vary by 2x from run to run).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "platform/log.h"
#include "core/crc32c.h"
#include "storage/file_backend.h"
#include "storage/redis_backend.h"

namespace kvcellar::storage {

using core::Crc32c;
using core::Crc32cHardwareAvailable;
using core::Crc32cSoftware;
namespace {

namespace fs = std::filesystem;

constexpr int kQueueDepth = 16;

std::string BenchDir() {
  const char* d = std::getenv("KVCELLAR_BENCH_DIR");
  return d != nullptr && *d != '\0' ? d : "/var/tmp/kvcellar-bench";
}
uint64_t EnvMiB(const char* name, uint64_t def) {
  const char* v = std::getenv(name);
  uint64_t n;
  return v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 ? n : def;
}

uint64_t CachedBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "Cached:") return kb * 1024;
  }
  return 0;
}

bool DropCaches() {
  ::sync();
  std::ofstream out("/proc/sys/vm/drop_caches");
  const char* mode = std::getenv("KVCELLAR_BENCH_DROP");
  out << (mode != nullptr ? mode : "3") << "\n";
  out.flush();
  return out.good();
}

bool HaveTool(const char* path) { return ::access(path, X_OK) == 0; }

std::string RunCapture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

// fio's bytes/s for the "read" or "write" section of its JSON output; 0 if not found.
double FioBandwidth(const std::string& json, const std::string& section) {
  size_t pos = json.find("\"" + section + "\" : {");
  if (pos == std::string::npos) return 0;
  pos = json.find("\"bw_bytes\" : ", pos);
  if (pos == std::string::npos) return 0;
  return std::strtod(json.c_str() + pos + 13, nullptr);
}

// fio with the same engine, direct I/O, block size and depth. per_object_files: one file per
// object, at most 16 open at once (fio opens and closes them as it goes; writes create them on
// open, no preallocation) - the same file-system work per object as the backend minus the rename
// and the header. Otherwise one file: the device's ceiling.
double Fio(const std::string& dir, const std::string& rw, uint64_t bs, uint64_t total,
           bool per_object_files) {
  if (!HaveTool("/usr/bin/fio")) return 0;
  std::string cmd = absl::StrCat(
      "/usr/bin/fio --name=kvcellar --directory=", dir, " --ioengine=io_uring --direct=1 --rw=", rw,
      " --bs=", bs, " --iodepth=", kQueueDepth, " --size=", total, " --numjobs=1");
  if (per_object_files) {
    absl::StrAppend(&cmd, " --nrfiles=", total / bs, " --filesize=", bs, " --openfiles=",
                    kQueueDepth, " --file_service_type=", rw == "write" ? "sequential" : "random",
                    rw == "write" ? " --create_on_open=1 --fallocate=none" : "");
  }
  absl::StrAppend(&cmd, " --output-format=json 2>/dev/null");
  const std::string json = RunCapture(cmd);
  return FioBandwidth(json, rw == "write" ? "write" : "read");
}

core::PageKey Key(uint64_t i) {
  core::PageKey k;
  uint64_t s = i * 0x9E3779B97F4A7C15ull + 12345;
  for (size_t j = 0; j < k.bytes.size(); j += 8) {
    s ^= s >> 31;
    s *= 0xBF58476D1CE4E5B9ull;
    std::memcpy(k.bytes.data() + j, &s, 8);
  }
  return k;
}

struct Aligned {
  explicit Aligned(size_t n) : p(static_cast<uint8_t*>(std::aligned_alloc(4096, n))) {
    std::memset(p, 0x5a, n);
  }
  ~Aligned() { std::free(p); }
  Aligned(Aligned&& o) noexcept : p(o.p) { o.p = nullptr; }
  uint8_t* p;
};

// Keeps `depth` single-object batches in flight: chain c does objects c, c+depth, ... with its
// own buffer, each completion submitting the chain's next object.
class Window {
 public:
  Window(Backend* b, bool put, const core::PageKey& ns, std::vector<uint64_t> order, size_t size,
         int depth)
      : b_(b), put_(put), ns_(ns), order_(std::move(order)), size_(size), depth_(depth) {
    for (int i = 0; i < depth; ++i) bufs_.emplace_back(size);
  }
  // Returns seconds; failures counted.
  double Run() {
    const absl::Time start = absl::Now();
    for (int c = 0; c < depth_ && static_cast<size_t>(c) < order_.size(); ++c) Submit(c, c);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Window::AllDone));
    return absl::ToDoubleSeconds(absl::Now() - start);
  }
  uint64_t failures() const { return failures_.load(); }

 private:
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ == order_.size(); }

  void Submit(int chain, size_t i) {
    auto next = [this, chain, i](BatchResult r) {
      if (r.items.empty() || r.items[0].status != ObjectStatus::kOk) ++failures_;
      const size_t j = i + static_cast<size_t>(depth_);
      if (j < order_.size()) Submit(chain, j);
      absl::MutexLock lock(&mu_);
      ++done_;
    };
    absl::Status s;
    if (put_) {
      PutItem item{Key(order_[i]), 0, bufs_[chain].p, size_, {}};
      s = b_->Put({ns_, absl::MakeConstSpan(&item, 1)}, std::move(next));
    } else {
      GetItem item{Key(order_[i]), 0, bufs_[chain].p, size_};
      s = b_->Get({ns_, absl::MakeConstSpan(&item, 1), absl::Seconds(60)}, std::move(next));
    }
    if (!s.ok()) std::abort();
  }

  Backend* b_;
  bool put_;
  core::PageKey ns_;
  std::vector<uint64_t> order_;
  size_t size_;
  int depth_;
  std::vector<Aligned> bufs_;
  std::atomic<uint64_t> failures_{0};
  absl::Mutex mu_;
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;
};

std::unique_ptr<FileBackend> OpenFile(const std::string& root, bool direct) {
  platform::SetLogLevel(platform::LogLevel::kWarn);  // No per-open info lines between the results.
  FileBackendOptions o;
  o.root = root;
  o.direct_io = direct;
  o.max_inflight_objects = 64;
  if (const char* e = std::getenv("KVCELLAR_BENCH_ENGINE"); e != nullptr && std::string(e) == "pool") {
    o.io.kind = IoEngineKind::kThreadPool;
  }
  absl::StatusOr<std::unique_ptr<FileBackend>> b = FileBackend::Open(o);
  if (!b.ok()) std::abort();
  return *std::move(b);
}

std::vector<uint64_t> Sequence(size_t n, bool shuffle) {
  std::vector<uint64_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  if (shuffle) std::shuffle(v.begin(), v.end(), std::mt19937_64(7));
  return v;
}

const core::PageKey kNs = Key(999999);


// ---- Startup scan -------------------------------------------------------------------------------

// Creates `n` objects under root in the file tier's layout: chains of 32 pages with their parent
// links, sparse payloads. Returns false on an I/O error.
bool MakeScanTree(const std::string& root, size_t n) {
  constexpr uint64_t kPayload = 64 << 10;
  constexpr size_t kChain = 32;
  uint8_t block[kFileHeaderBlockBytes] = {};
  for (size_t i = 0; i < n; ++i) {
    const core::PageKey key = Key(i);
    const ParentLink parent = i % kChain == 0 ? ParentLink::First() : ParentLink::Of(Key(i - 1));
    ObjectHeader h = MakeObjectHeader(kNs, key, 0, nullptr, 0, 1, parent);
    h.payload_bytes = kPayload;  // Sparse zeros: the scan never reads them.
    h.payload_crc = 0;
    EncodeObjectHeader(h, block);
    const std::string path = root + "/" + FileBackend::ObjectPath(kNs, key, 0);
    fs::create_directories(fs::path(path).parent_path());
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    const bool ok = ::pwrite(fd, block, sizeof(block), 0) == static_cast<ssize_t>(sizeof(block)) &&
                    ::ftruncate(fd, kFileHeaderBlockBytes + kPayload) == 0;
    ::close(fd);
    if (!ok) return false;
  }
  return true;
}

// A plain walk of the tier's three levels; `visit` runs for each leaf entry (at dfd). Returns the
// entries visited.
template <typename Visit>
size_t WalkTree(const std::string& root, Visit visit) {
  size_t n = 0;
  for (const auto& ns : fs::directory_iterator(root)) {
    for (const auto& leaf : fs::directory_iterator(ns.path())) {
      DIR* d = ::opendir(leaf.path().c_str());
      if (d == nullptr) continue;
      while (dirent* de = ::readdir(d)) {
        if (de->d_name[0] == '.') continue;
        visit(::dirfd(d), de->d_name);
        ++n;
      }
      ::closedir(d);
    }
  }
  return n;
}

void BM_FileScan(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::string root = BenchDir() + "/scan";
  fs::remove_all(root);
  if (!MakeScanTree(root, n)) {
    state.SkipWithError("cannot create the tree");
    return;
  }
  bool dropped = true;
  const auto timed = [&](auto body) {
    dropped = DropCaches() && dropped;
    const absl::Time start = absl::Now();
    body();
    return absl::ToDoubleSeconds(absl::Now() - start);
  };
  size_t walked = 0;
  const double walk_s = timed([&] {
    walked = WalkTree(root, [](int dfd, const char* name) {
      struct stat st;
      benchmark::DoNotOptimize(::fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW));
    });
  });
  const double headers_s = timed([&] {
    WalkTree(root, [](int dfd, const char* name) {
      uint8_t buf[kObjectHeaderBytes];
      const int fd = ::openat(dfd, name, O_RDONLY | O_CLOEXEC);
      if (fd < 0) return;
      benchmark::DoNotOptimize(::pread(fd, buf, sizeof(buf), 0));
      ::close(fd);
    });
  });
  uint64_t found = 0;
  double scan_s = 0;
  for (auto _ : state) {
    scan_s = timed([&] {
      platform::SetLogLevel(platform::LogLevel::kWarn);
      FileBackendOptions o;
      o.root = root;
      absl::StatusOr<std::unique_ptr<FileBackend>> b = FileBackend::Open(o);
      if (!b.ok()) std::abort();
      absl::Notification done;
      (*b)->SetScanSink([&](FileScanResult r) {
        found = r.objects.size();
        done.Notify();
      });
      done.WaitForNotification();
    });
    state.SetIterationTime(scan_s);
  }
  if (found != n || walked != n) state.SkipWithError("the scan or the walk missed objects");
  state.counters["scan_Mobj_s"] = n / scan_s / 1e6;
  state.counters["walk_Mobj_s"] = n / walk_s / 1e6;
  state.counters["headers_Mobj_s"] = n / headers_s / 1e6;
  state.counters["vs_walk"] = walk_s / scan_s;
  state.counters["vs_headers"] = headers_s / scan_s;
  state.counters["caches_dropped"] = dropped ? 1 : 0;
  fs::remove_all(root);
}

// Our speed beside fio's in the same run: into one big file (fio_GBps, vs_fio) and into one file
// per object (fio_files_GBps, vs_fio_files). Bytes per second.
void SetFioCounters(benchmark::State& state, double ours, double fio, double fio_files) {
  state.counters["fio_GBps"] = fio / 1e9;
  state.counters["vs_fio"] = fio > 0 ? ours / fio : 0;
  state.counters["fio_files_GBps"] = fio_files / 1e9;
  state.counters["vs_fio_files"] = fio_files > 0 ? ours / fio_files : 0;
}

void BM_FileWrite(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  const bool direct = state.range(1) != 0;
  const uint64_t total = EnvMiB("KVCELLAR_BENCH_MIB", 1024) << 20;
  const size_t n = total / size;
  const std::string dir = BenchDir() + "/write";
  for (auto _ : state) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    auto b = OpenFile(dir + "/l3", direct);
    DropCaches();
    const uint64_t cached0 = CachedBytes();
    Window w(b.get(), /*put=*/true, kNs, Sequence(n, false), size, kQueueDepth);
    const double secs = w.Run();
    const uint64_t cached1 = CachedBytes();
    state.SetIterationTime(secs);
    b.reset();
    const double ours = static_cast<double>(n * size) / secs;
    state.counters["GBps"] = ours / 1e9;
    state.counters["failures"] = static_cast<double>(w.failures());
    state.counters["cache_growth_per_byte"] =
        (static_cast<double>(cached1) - static_cast<double>(cached0)) / static_cast<double>(n * size);
    if (direct) {
      fs::remove_all(dir + "/l3");
      DropCaches();
      const double fio = Fio(dir, "write", size, total, false);
      fs::remove_all(dir + "/fio");
      fs::create_directories(dir + "/fio");
      DropCaches();
      const double fio_files = Fio(dir + "/fio", "write", size, total, true);
      SetFioCounters(state, ours, fio, fio_files);
    }
  }
  fs::remove_all(dir);
  state.SetBytesProcessed(static_cast<int64_t>(n * size));
}

// One-file-per-page buffered baseline: open, read the whole file, close; one thread.
double BufferedLoop(const std::string& root, const std::vector<uint64_t>& order, size_t size) {
  std::vector<char> buf(size + 4096);
  const absl::Time start = absl::Now();
  for (uint64_t i : order) {
    const std::string p = root + "/" + FileBackend::ObjectPath(kNs, Key(i), 0);
    int fd = ::open(p.c_str(), O_RDONLY);
    if (fd < 0) std::abort();
    size_t got = 0;
    ssize_t r;
    while ((r = ::read(fd, buf.data() + got, buf.size() - got)) > 0) got += static_cast<size_t>(r);
    ::close(fd);
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

void BM_FileRead(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  const uint64_t total = EnvMiB("KVCELLAR_BENCH_MIB", 1024) << 20;
  const size_t n = total / size;
  const std::string dir = BenchDir() + "/read";
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    auto b = OpenFile(dir + "/l3", true);
    Window w(b.get(), true, kNs, Sequence(n, false), size, kQueueDepth);
    w.Run();
  }
  const std::vector<uint64_t> order = Sequence(n, true);
  for (auto _ : state) {
    auto b = OpenFile(dir + "/l3", true);
    const bool dropped = DropCaches();
    Window w(b.get(), /*put=*/false, kNs, order, size, kQueueDepth);
    const double secs = w.Run();
    state.SetIterationTime(secs);
    b.reset();
    const double ours = static_cast<double>(n * size) / secs;
    state.counters["GBps"] = ours / 1e9;
    state.counters["failures"] = static_cast<double>(w.failures());
    state.counters["caches_dropped"] = dropped ? 1 : 0;
    DropCaches();
    const double loop = static_cast<double>(n * size) / BufferedLoop(dir + "/l3", order, size);
    state.counters["buffered_loop_GBps"] = loop / 1e9;
    state.counters["vs_buffered_loop"] = ours / loop;
    // fio's files: laid out by a write pass first, so that its read pass is timed alone and cold.
    fs::create_directories(dir + "/fio");
    Fio(dir, "write", size, total, false);
    Fio(dir + "/fio", "write", size, total, true);
    DropCaches();
    const double fio = Fio(dir, "randread", size, total, false);
    DropCaches();
    const double fio_files = Fio(dir + "/fio", "randread", size, total, true);
    SetFioCounters(state, ours, fio, fio_files);
  }
  fs::remove_all(dir);
  state.SetBytesProcessed(static_cast<int64_t>(n * size));
}

// ---- Redis ------------------------------------------------------------------------------------

class RedisProcess {
 public:
  explicit RedisProcess(const std::string& dir) : dir_(dir), sock_(dir + "/redis.sock") {
    fs::create_directories(dir);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/usr/bin/redis-server", "redis-server", "--port", "0", "--unixsocket",
              sock_.c_str(), "--save", "", "--appendonly", "no", "--dir", dir.c_str(),
              "--loglevel", "warning", "--logfile", (dir + "/redis.log").c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 500 && !fs::exists(sock_); ++i) ::usleep(10000);
    ::usleep(50000);
  }
  ~RedisProcess() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    fs::remove_all(dir_);
  }
  const std::string& socket() const { return sock_; }

 private:
  std::string dir_, sock_;
  pid_t pid_;
};

// requests/s from `redis-benchmark --csv` for one test ("SET" or "GET"). Both run, SET first, so
// that GET reads a value of the given size (alone, it would read a missing key).
double RedisBenchmark(const std::string& sock, const char* test, size_t size, size_t n) {
  if (!HaveTool("/usr/bin/redis-benchmark")) return 0;
  // -r n/4: SETs create distinct keys (as ours do: the server allocates, not overwrites one key)
  // and cover nearly all of the n/4 keys, so the GETs that follow hit.
  const std::string cmd = absl::StrCat(
      "/usr/bin/redis-benchmark -s ", sock, " -t set,get -d ", size, " -n ", n, " -r ",
      std::max<size_t>(1, n / 4), " -c ", 2 * kQueueDepth, " -P 1 --csv 2>/dev/null");
  RunCapture(cmd);  // Warm-up, as for ours.
  const std::string out = RunCapture(cmd);
  const std::string tag = absl::StrCat("\"", test, "\",\"");
  const size_t pos = out.find(tag);
  if (pos == std::string::npos) return 0;
  return std::strtod(out.c_str() + pos + tag.size(), nullptr);
}

void RedisBench(benchmark::State& state, bool put, bool index_cost = false) {
  if (!HaveTool("/usr/bin/redis-server")) {
    state.SkipWithError("redis-server not installed");
    return;
  }
  const size_t size = static_cast<size_t>(state.range(0));
  const uint64_t total = EnvMiB("KVCELLAR_BENCH_REDIS_MIB", 512) << 20;
  const size_t n = std::max<size_t>(64, total / size);
  RedisProcess server(BenchDir() + "/redis");
  RedisBackendOptions o;
  o.addresses = {"unix:" + server.socket()};
  o.connections_per_node = 4;
  o.command_timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<RedisBackend>> b = RedisBackend::Create(o);
  if (!b.ok()) std::abort();
  o.index = false;
  absl::StatusOr<std::unique_ptr<RedisBackend>> plain = RedisBackend::Create(o);
  if (!plain.ok()) std::abort();
  RedisBackend* cur = b->get();
  // Batches of 16 objects (one scheduler step's worth), two in flight (two engine ranks), each
  // with its own buffers.
  constexpr int kInFlight = 2;
  std::vector<Aligned> bufs;
  for (int i = 0; i < kQueueDepth * kInFlight; ++i) bufs.emplace_back(size);
  std::vector<double> batch_ms;
  auto run = [&](bool write) {
    uint64_t failures = 0;
    batch_ms.clear();
    BatchFuture inflight[kInFlight];
    absl::Time started[kInFlight];
    bool busy[kInFlight] = {};
    auto reap = [&](int slot) {
      for (const ItemResult& r : inflight[slot].Wait().items) failures += r.status != ObjectStatus::kOk;
      batch_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - started[slot]));
      busy[slot] = false;
    };
    const absl::Time start = absl::Now();
    int slot = 0;
    for (size_t base = 0; base < n; base += kQueueDepth, slot = (slot + 1) % kInFlight) {
      if (busy[slot]) reap(slot);
      const size_t m = std::min<size_t>(kQueueDepth, n - base);
      started[slot] = absl::Now();
      if (write) {
        std::vector<PutItem> items;
        for (size_t i = 0; i < m; ++i) {
          items.push_back({Key(base + i), 0, bufs[slot * kQueueDepth + i].p, size, {}});
        }
        inflight[slot] = *cur->PutAsync({kNs, items});
      } else {
        std::vector<GetItem> items;
        for (size_t i = 0; i < m; ++i) {
          items.push_back({Key(base + i), 0, bufs[slot * kQueueDepth + i].p, size});
        }
        inflight[slot] = *cur->GetAsync({kNs, items});
      }
      busy[slot] = true;
    }
    for (int i = 0; i < kInFlight; ++i) {
      if (busy[i]) reap(i);
    }
    return std::make_pair(absl::ToDoubleSeconds(absl::Now() - start), failures);
  };
  // A first SET pass, untimed: it creates every key, so the timed passes measure the steady state
  // (values replaced in memory the server already has) rather than the server faulting in fresh
  // pages, which on a VM costs more than the copy. redis-benchmark gets the same warm-up.
  run(true);
  if (index_cost) {
    // Same server, same keys and values: the only difference is the HSET beside each SET.
    double best[2] = {0, 0};  // [plain, index] ops/s.
    uint64_t failures = 0;
    for (auto _ : state) {
      double secs_sum = 0;
      for (int round = 0; round < 3; ++round) {
        // Each round swaps which goes first, so a drift of the machine does not favour one.
        for (int k = 0; k < 2; ++k) {
          const int with_index = (k + round) % 2;
          cur = with_index ? b->get() : plain->get();
          auto [secs, f] = run(true);
          failures += f;
          secs_sum += secs;
          best[with_index] = std::max(best[with_index], static_cast<double>(n) / secs);
        }
      }
      state.SetIterationTime(secs_sum);
    }
    state.counters["ops_per_s_plain"] = best[0];
    state.counters["ops_per_s_index"] = best[1];
    state.counters["index_ratio"] = best[0] > 0 ? best[1] / best[0] : 0;
    state.counters["failures"] = static_cast<double>(failures);
    return;
  }
  for (auto _ : state) {
    auto [secs, failures] = run(put);
    state.SetIterationTime(secs);
    const double ops = static_cast<double>(n) / secs;
    state.counters["ops_per_s"] = ops;
    state.counters["GBps"] = ops * static_cast<double>(size) / 1e9;
    state.counters["failures"] = static_cast<double>(failures);
    std::sort(batch_ms.begin(), batch_ms.end());
    state.counters["batch_p50_ms"] = batch_ms[batch_ms.size() / 2];
    state.counters["batch_p99_ms"] = batch_ms[batch_ms.size() * 99 / 100];
    state.counters["batch_max_ms"] = batch_ms.back();
    const double rb = RedisBenchmark(server.socket(), put ? "SET" : "GET", size, n);
    state.counters["redis_benchmark_ops_per_s"] = rb;
    state.counters["vs_redis_benchmark"] = rb > 0 ? ops / rb : 0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(n * size));
}

void BM_RedisSet(benchmark::State& state) { RedisBench(state, true); }
void BM_RedisGet(benchmark::State& state) { RedisBench(state, false); }
void BM_RedisSetIndexCost(benchmark::State& state) { RedisBench(state, true, true); }

// CRC-32C over one object's payload: what every read and write pays on top of the I/O.
void BM_Crc32c(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  const bool hardware = state.range(1) != 0;
  Aligned buf(size);
  for (auto _ : state) {
    benchmark::DoNotOptimize(hardware ? Crc32c(buf.p, size) : Crc32cSoftware(buf.p, size));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
  state.counters["hardware_path"] = hardware && Crc32cHardwareAvailable() ? 1 : 0;
}

BENCHMARK(BM_Crc32c)->ArgsProduct({{256 << 10, 4 << 20}, {1, 0}});
BENCHMARK(BM_FileScan)
    ->Arg(20000)
    ->Arg(200000)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FileWrite)
    ->ArgsProduct({{256 << 10, 1 << 20, 4 << 20}, {1}})
    ->Args({1 << 20, 0})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FileRead)
    ->Arg(256 << 10)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RedisSet)->Arg(64 << 10)->Arg(256 << 10)->Arg(1 << 20)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RedisSetIndexCost)->Arg(4 << 10)->Arg(64 << 10)->Arg(256 << 10)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RedisGet)->Arg(64 << 10)->Arg(256 << 10)->Arg(1 << 20)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvcellar::storage

BENCHMARK_MAIN();
