// Page-key hashing throughput, in bytes of token ids hashed per second.
//
// BM_ComputePageKeys is the production path (core/page_key.cc): on CPUs with the SHA extensions,
// core/sha256_lanes.h, which compresses the token blocks of four pages (or, at 16 tokens a page,
// of the next page beside the current page's parent block) at once. Beside it: SHA-256 of one
// contiguous buffer of the same token bytes (BM_Sha256Contiguous, the Match baseline's hashing),
// and of as many bytes as the chain's messages (tokens + parent key per page:
// BM_Sha256ChainBytesContiguous, compared through the chain's `message_bytes/s` counter); and the
// chain one page at a time through the three OpenSSL interfaces, the path of CPUs without the
// SHA extensions (page_key.cc uses the low-level one), so that both choices can be re-measured on
// new hardware.
//
// Every chained page hashes 4P + 32 bytes plus SHA-256 padding, in whole 64-byte blocks: at
// P = 16, 128 bytes compressed per 64 token bytes. One page at a time, every block waits for the
// one before, so the chain cannot beat half the contiguous rate of its tokens there; with the
// token blocks of several pages in lockstep only the parent block is serial.
//
// This file holds the BENCHMARK_MAIN of kvcellar_bench_core; other files in this folder must not.
#include <openssl/evp.h>
#include <openssl/sha.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/namespace_spec.h"
#include "core/page_key.h"

namespace kvcellar::core {
namespace {

constexpr size_t kPages = 2048;

std::vector<uint32_t> Tokens(size_t n) {
  std::vector<uint32_t> t(n);
  uint32_t x = 12345;
  for (auto& v : t) {
    x = x * 1664525u + 1013904223u;
    v = x % 128256;  // A Llama-3 sized vocabulary.
  }
  return t;
}

PageKey Root() {
  NamespaceSpec ns{.tenant = "bench",
                   .model_id = "meta-llama/Llama-3.1-8B-Instruct",
                   .model_revision = "0e9e39f249a16976918f6564b8830bc894c89659",
                   .kv_dtype = "bf16",
                   .page_size = 16,
                   .layout = LayoutKind::kMha,
                   .tp_size = 1,
                   .opaque_keys = false,
                   .groups = {}};
  return ns.Digest();
}

void BM_ComputePageKeys(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> tokens = Tokens(kPages * page_size);
  std::vector<PageKey> out(kPages);
  const PageKey root = Root();
  for (auto _ : state) {
    benchmark::DoNotOptimize(ComputePageKeys(root, tokens, page_size, absl::MakeSpan(out)));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * tokens.size() * sizeof(uint32_t));
  state.counters["pages/s"] =
      benchmark::Counter(double(state.iterations()) * kPages, benchmark::Counter::kIsRate);
  state.counters["message_bytes/s"] =
      benchmark::Counter(double(state.iterations()) * kPages * (kPageKeyBytes + 4.0 * page_size),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ComputePageKeys)->Arg(16)->Arg(64)->Arg(256);

// The baseline of the chain's goal: one SHA-256 over as many bytes as the chain's messages
// (kPages x (32 + 4P)), no chaining, no per-page padding.
void BM_Sha256ChainBytesContiguous(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint8_t> bytes(kPages * (kPageKeyBytes + 4 * page_size), 0x5a);
  uint8_t digest[SHA256_DIGEST_LENGTH];
  for (auto _ : state) {
    SHA256(bytes.data(), bytes.size(), digest);
    benchmark::DoNotOptimize(digest);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes.size());
}
BENCHMARK(BM_Sha256ChainBytesContiguous)->Arg(16)->Arg(64)->Arg(256);

// Ceiling: one SHA-256 over all the token bytes, no chaining, no per-page padding.
void BM_Sha256Contiguous(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> tokens = Tokens(kPages * page_size);
  uint8_t digest[SHA256_DIGEST_LENGTH];
  for (auto _ : state) {
    SHA256(reinterpret_cast<const unsigned char*>(tokens.data()), tokens.size() * sizeof(uint32_t),
           digest);
    benchmark::DoNotOptimize(digest);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * tokens.size() * sizeof(uint32_t));
}
BENCHMARK(BM_Sha256Contiguous)->Arg(16)->Arg(64)->Arg(256);

// The chain through EVP with one context reused for every page.
void BM_ChainEvpReusedContext(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> tokens = Tokens(kPages * page_size);
  std::vector<PageKey> out(kPages);
  const PageKey root = Root();
  EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  for (auto _ : state) {
    const PageKey* prev = &root;
    for (size_t i = 0; i < kPages; ++i) {
      unsigned int len = 0;
      EVP_DigestInit_ex(ctx, md, nullptr);
      EVP_DigestUpdate(ctx, &tokens[i * page_size], page_size * sizeof(uint32_t));
      EVP_DigestUpdate(ctx, prev->bytes.data(), kPageKeyBytes);
      EVP_DigestFinal_ex(ctx, out[i].bytes.data(), &len);
      prev = &out[i];
    }
    benchmark::ClobberMemory();
  }
  EVP_MD_CTX_free(ctx);
  EVP_MD_free(md);
  state.SetBytesProcessed(int64_t(state.iterations()) * tokens.size() * sizeof(uint32_t));
}
BENCHMARK(BM_ChainEvpReusedContext)->Arg(16)->Arg(64)->Arg(256);

// The chain through the one-shot SHA256(), which needs the parent copied behind the page.
void BM_ChainOneShot(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> tokens = Tokens(kPages * page_size);
  std::vector<PageKey> out(kPages);
  std::vector<uint8_t> buf(kPageKeyBytes + page_size * sizeof(uint32_t));
  const PageKey root = Root();
  for (auto _ : state) {
    const PageKey* prev = &root;
    for (size_t i = 0; i < kPages; ++i) {
      std::memcpy(buf.data(), &tokens[i * page_size], page_size * sizeof(uint32_t));
      std::memcpy(buf.data() + page_size * sizeof(uint32_t), prev->bytes.data(), kPageKeyBytes);
      SHA256(buf.data(), buf.size(), out[i].bytes.data());
      prev = &out[i];
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * tokens.size() * sizeof(uint32_t));
}
BENCHMARK(BM_ChainOneShot)->Arg(16)->Arg(64)->Arg(256);

// The chain one page at a time through OpenSSL's low-level interface (ChainPageKey): what
// ComputePageKeys does on CPUs without the SHA extensions.
void BM_ChainOpenSslLowLevel(benchmark::State& state) {
  const uint32_t page_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> tokens = Tokens(kPages * page_size);
  std::vector<PageKey> out(kPages);
  const PageKey root = Root();
  for (auto _ : state) {
    const PageKey* prev = &root;
    for (size_t i = 0; i < kPages; ++i) {
      out[i] = ChainPageKey(*prev, absl::MakeConstSpan(tokens).subspan(i * page_size, page_size));
      prev = &out[i];
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * tokens.size() * sizeof(uint32_t));
}
BENCHMARK(BM_ChainOpenSslLowLevel)->Arg(16)->Arg(64)->Arg(256);

// Opaque keys scoped by their namespace (the daemon, for every opaque Match/Backup/Load key):
// ScopeOpaqueKeys (four at a time on the SHA extensions) against one ScopeOpaqueKey per key
// (OpenSSL), in keys per second.
std::vector<PageKey> EngineKeys() {
  std::vector<PageKey> keys(kPages);
  const std::vector<uint32_t> words = Tokens(kPages * 8);
  std::memcpy(static_cast<void*>(keys.data()), words.data(), kPages * sizeof(PageKey));
  return keys;
}

void BM_ScopeOpaqueKeysBatch(benchmark::State& state) {
  const std::vector<PageKey> keys = EngineKeys();
  std::vector<PageKey> out(kPages);
  const PageKey root = Root();
  for (auto _ : state) {
    ScopeOpaqueKeys(root, keys, absl::MakeSpan(out));
    benchmark::ClobberMemory();
  }
  state.counters["keys/s"] =
      benchmark::Counter(double(state.iterations()) * kPages, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ScopeOpaqueKeysBatch);

void BM_ScopeOpaqueKeyEach(benchmark::State& state) {
  const std::vector<PageKey> keys = EngineKeys();
  std::vector<PageKey> out(kPages);
  const PageKey root = Root();
  for (auto _ : state) {
    for (size_t i = 0; i < kPages; ++i) out[i] = ScopeOpaqueKey(root, keys[i]);
    benchmark::ClobberMemory();
  }
  state.counters["keys/s"] =
      benchmark::Counter(double(state.iterations()) * kPages, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ScopeOpaqueKeyEach);

void BM_NamespaceDigest(benchmark::State& state) {
  NamespaceSpec ns{.tenant = "bench",
                   .model_id = "meta-llama/Llama-3.1-8B-Instruct",
                   .model_revision = "0e9e39f249a16976918f6564b8830bc894c89659",
                   .kv_dtype = "bf16",
                   .page_size = 16,
                   .layout = LayoutKind::kMha,
                   .tp_size = 1,
                   .opaque_keys = false,
                   .groups = {}};
  for (auto _ : state) benchmark::DoNotOptimize(ns.Digest());
}
BENCHMARK(BM_NamespaceDigest);

}  // namespace
}  // namespace kvcellar::core

BENCHMARK_MAIN();
