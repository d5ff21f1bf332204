// Helpers shared by the storage tests: temp directories, 4 KiB-aligned buffers (what host pool
// slots look like), deterministic keys and payloads, and blocking wrappers over the async API.
#ifndef KVCELLAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
#define KVCELLAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_

#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/page_key.h"
#include "gtest/gtest.h"
#include "storage/backend.h"

namespace kvcellar::storage::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& base = "") {
    std::string root = base;
    if (root.empty()) {
      const char* t = std::getenv("TMPDIR");
      root = (t != nullptr && *t != '\0') ? t : "/tmp";
    }
    std::string tmpl = root + "/kvcellar-storage-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = ::mkdtemp(buf.data()) != nullptr ? buf.data() : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Sets the process umask for a scope (each test runs in a process of its own under ctest).
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(old_); }

 private:
  mode_t old_;
};

// 4 KiB-aligned, like a host pool slot.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n) {
    const size_t rounded = (n + 4095) / 4096 * 4096;
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded)));
    std::memset(data.get(), 0, rounded == 0 ? 4096 : rounded);
  }
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data;
  size_t size;
  uint8_t* get() const { return data.get(); }
};

inline uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline core::PageKey TestKey(uint64_t i, uint64_t salt = 0) {
  core::PageKey k;
  uint64_t s = i * 1000003 + salt * 7919 + 1;
  for (size_t j = 0; j < k.bytes.size(); j += 8) {
    uint64_t v = SplitMix(&s);
    std::memcpy(k.bytes.data() + j, &v, 8);
  }
  return k;
}

inline core::PageKey TestNamespace(uint64_t i = 0) { return TestKey(i, 0xA11CE); }

// Deterministic bytes for (key, shard): what a correct read must return.
inline void FillPayload(const core::PageKey& key, uint32_t shard, uint8_t* out, size_t n) {
  uint64_t s;
  std::memcpy(&s, key.bytes.data(), 8);
  s ^= uint64_t{shard} * 0x51ED27;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = SplitMix(&s);
    std::memcpy(out + i, &v, 8);
  }
  if (i < n) {
    uint64_t v = SplitMix(&s);
    std::memcpy(out + i, &v, n - i);
  }
}

inline bool PayloadMatches(const core::PageKey& key, uint32_t shard, const uint8_t* got,
                           size_t n) {
  std::vector<uint8_t> want(n);
  FillPayload(key, shard, want.data(), n);
  return std::memcmp(want.data(), got, n) == 0;
}

// Blocking forms; fail the test on a submission error.
inline BatchResult PutSync(Backend& b, const PutRequest& r) {
  absl::StatusOr<BatchFuture> f = b.PutAsync(r);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  return f->Wait();
}
inline BatchResult GetSync(Backend& b, const GetRequest& r) {
  absl::StatusOr<BatchFuture> f = b.GetAsync(r);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  return f->Wait();
}
inline BatchResult DeleteSync(Backend& b, const DeleteRequest& r) {
  absl::StatusOr<BatchFuture> f = b.DeleteAsync(r);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  return f->Wait();
}
inline ExistsResult ExistsSync(Backend& b, const ExistsRequest& r) {
  absl::StatusOr<ExistsFuture> f = b.ExistsAsync(r);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  return f->Wait();
}

// Puts one object of `size` bytes with the deterministic payload; returns its status.
inline ObjectStatus PutOne(Backend& b, const core::PageKey& ns, const core::PageKey& key,
                           uint32_t shard, size_t size) {
  AlignedBuffer buf(size);
  FillPayload(key, shard, buf.get(), size);
  PutItem item{key, shard, buf.get(), size, {}};
  PutRequest r{ns, absl::MakeConstSpan(&item, 1)};
  BatchResult res = PutSync(b, r);
  return res.items.empty() ? ObjectStatus::kRetry : res.items[0].status;
}

// Gets one object into a buffer of `capacity`; checks the payload when kOk.
inline ObjectStatus GetOne(Backend& b, const core::PageKey& ns, const core::PageKey& key,
                           uint32_t shard, size_t capacity, size_t want_size = 0) {
  AlignedBuffer buf(capacity);
  GetItem item{key, shard, buf.get(), capacity};
  GetRequest r{ns, absl::MakeConstSpan(&item, 1)};
  BatchResult res = GetSync(b, r);
  if (res.items.empty()) return ObjectStatus::kRetry;
  if (res.items[0].status == ObjectStatus::kOk) {
    if (want_size != 0) {
      EXPECT_EQ(res.items[0].bytes, want_size);
    }
    EXPECT_TRUE(PayloadMatches(key, shard, buf.get(), res.items[0].bytes))
        << "payload differs for shard " << shard;
  }
  return res.items[0].status;
}

inline std::string StatusNames(const BatchResult& r) {
  std::string s;
  for (const ItemResult& i : r.items) absl::StrAppend(&s, ObjectStatusName(i.status), " ");
  return s;
}

}  // namespace kvcellar::storage::testing

#endif  // KVCELLAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
