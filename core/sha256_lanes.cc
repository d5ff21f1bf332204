#include "core/sha256_lanes.h"

#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define KVCELLAR_SHA_LANES 1
#endif

namespace kvcellar::core::sha256 {

#ifdef KVCELLAR_SHA_LANES
namespace {

// FIPS 180-4: the round constants K (4.2.2) and the initial hash value H(0) (5.3.3).
alignas(16) constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
alignas(16) constexpr uint32_t kInitial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                              0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
constexpr int kLanes = 4;

constexpr uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// W(t) + K(t) of the padding block of a 64-byte message (0x80, zeros, the length 512 as a
// 64-bit big-endian integer): the same for every message, so computed once.
struct PaddingSchedule {
  alignas(16) uint32_t wk[64];
  PaddingSchedule() {
    uint32_t w[64] = {};
    w[0] = 0x80000000u;
    w[15] = 512;
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = Rotr(w[t - 15], 7) ^ Rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = Rotr(w[t - 2], 17) ^ Rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    for (int t = 0; t < 64; ++t) wk[t] = w[t] + kRound[t];
  }
};

bool DetectShaExtensions() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = (c & bit_SSSE3) != 0, sse41 = (c & bit_SSE4_1) != 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ssse3 && sse41 && (b & (1u << 29)) != 0;  // CPUID.(7,0):EBX.SHA is bit 29.
}

#define KVC_SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

// sha256rnds2 keeps the working variables as ABEF and CDGH (lanes high to low), does two rounds
// with W+K of those rounds in its third operand's low lanes and returns the new ABEF (the old
// ABEF is the new CDGH). The schedule runs four words at a time: sha256msg1 adds sigma0(W(t-15))
// to W(t-16), W(t-7) is added by hand, sha256msg2 adds sigma1(W(t-2)).
KVC_SHA_TARGET inline void FourRounds(__m128i& abef, __m128i& cdgh, __m128i wk) {
  cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
  abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
}

// Compresses kLanes messages of one block each (blocks[l]) and then the shared padding block,
// from H(0); writes each digest's 32 bytes to out[l].
KVC_SHA_TARGET void HashLanes(const uint8_t* const blocks[kLanes], uint8_t* const out[kLanes],
                              const PaddingSchedule& padding) {
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  // H(0) as ABEF / CDGH.
  const __m128i dcba = _mm_load_si128(reinterpret_cast<const __m128i*>(&kInitial[0]));
  const __m128i hgfe = _mm_load_si128(reinterpret_cast<const __m128i*>(&kInitial[4]));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  const __m128i abef0 = _mm_alignr_epi8(cdab, efgh, 8);
  const __m128i cdgh0 = _mm_blend_epi16(efgh, cdab, 0xF0);

  __m128i abef[kLanes], cdgh[kLanes], w[kLanes][4];
  for (int l = 0; l < kLanes; ++l) abef[l] = abef0, cdgh[l] = cdgh0;
  // The message block, the lanes interleaved round group by round group.
  for (int g = 0; g < 16; ++g) {
    const __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(&kRound[4 * g]));
    for (int l = 0; l < kLanes; ++l) {
      __m128i& cur = w[l][g % 4];
      if (g < 4) {
        cur = _mm_shuffle_epi8(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[l] + 16 * g)), byte_swap);
      } else {
        const __m128i prev1 = w[l][(g + 3) % 4], prev2 = w[l][(g + 2) % 4];
        const __m128i next = _mm_add_epi32(_mm_sha256msg1_epu32(cur, w[l][(g + 1) % 4]),
                                           _mm_alignr_epi8(prev1, prev2, 4));
        cur = _mm_sha256msg2_epu32(next, prev1);
      }
      FourRounds(abef[l], cdgh[l], _mm_add_epi32(cur, k));
    }
  }
  __m128i abef1[kLanes], cdgh1[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    abef[l] = abef1[l] = _mm_add_epi32(abef[l], abef0);
    cdgh[l] = cdgh1[l] = _mm_add_epi32(cdgh[l], cdgh0);
  }
  // The padding block: its W+K are constants.
  for (int g = 0; g < 16; ++g) {
    const __m128i wk = _mm_load_si128(reinterpret_cast<const __m128i*>(&padding.wk[4 * g]));
    for (int l = 0; l < kLanes; ++l) FourRounds(abef[l], cdgh[l], wk);
  }
  for (int l = 0; l < kLanes; ++l) {
    const __m128i feba = _mm_shuffle_epi32(_mm_add_epi32(abef[l], abef1[l]), 0x1B);
    const __m128i dchg = _mm_shuffle_epi32(_mm_add_epi32(cdgh[l], cdgh1[l]), 0xB1);
    // Words a..h, each written big-endian: the digest's bytes.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[l]),
                     _mm_shuffle_epi8(_mm_blend_epi16(feba, dchg, 0xF0), byte_swap));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[l] + 16),
                     _mm_shuffle_epi8(_mm_alignr_epi8(dchg, feba, 8), byte_swap));
  }
}

}  // namespace

bool HaveShaExtensions() {
  static const bool have = DetectShaExtensions();
  return have;
}

void HashPrefixedPairs(const uint8_t* prefix, const uint8_t* suffixes, size_t n, uint8_t* out) {
  static const PaddingSchedule padding;
  alignas(16) uint8_t block[kLanes][64];
  alignas(16) uint8_t digest[kLanes][32];
  for (int l = 0; l < kLanes; ++l) std::memcpy(block[l], prefix, 32);
  const uint8_t* blocks[kLanes] = {block[0], block[1], block[2], block[3]};
  uint8_t* digests[kLanes] = {digest[0], digest[1], digest[2], digest[3]};
  for (size_t i = 0; i < n; i += kLanes) {
    const size_t lanes = n - i < kLanes ? n - i : kLanes;
    // A short last group repeats its last message in the idle lanes; their digests are dropped.
    for (size_t l = 0; l < kLanes; ++l) {
      std::memcpy(block[l] + 32, suffixes + 32 * (i + (l < lanes ? l : lanes - 1)), 32);
    }
    HashLanes(blocks, digests, padding);
    for (size_t l = 0; l < lanes; ++l) std::memcpy(out + 32 * (i + l), digest[l], 32);
  }
}

#else  // Not x86-64: no SHA extensions; the callers use OpenSSL.

bool HaveShaExtensions() { return false; }
void HashPrefixedPairs(const uint8_t*, const uint8_t*, size_t, uint8_t*) {}

#endif

}  // namespace kvcellar::core::sha256
