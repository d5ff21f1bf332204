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

// H(0) as the ABEF / CDGH pair sha256rnds2 works on.
KVC_SHA_TARGET inline void InitialState(__m128i& abef, __m128i& cdgh) {
  const __m128i dcba = _mm_load_si128(reinterpret_cast<const __m128i*>(&kInitial[0]));
  const __m128i hgfe = _mm_load_si128(reinterpret_cast<const __m128i*>(&kInitial[4]));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  abef = _mm_alignr_epi8(cdab, efgh, 8);
  cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

KVC_SHA_TARGET inline __m128i ByteSwapWords() {
  return _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
}

// Words a..h of a final state, each written big-endian: the digest's 32 bytes.
KVC_SHA_TARGET inline void StoreDigest(__m128i abef, __m128i cdgh, uint8_t* out) {
  const __m128i byte_swap = ByteSwapWords();
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_shuffle_epi8(_mm_blend_epi16(feba, dchg, 0xF0), byte_swap));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                   _mm_shuffle_epi8(_mm_alignr_epi8(dchg, feba, 8), byte_swap));
}

// The 16 message words of a 64-byte block, big-endian in memory, as four registers.
KVC_SHA_TARGET inline void LoadBlock(const uint8_t* block, __m128i m[4]) {
  const __m128i byte_swap = ByteSwapWords();
  for (int q = 0; q < 4; ++q) {
    m[q] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * q)),
                            byte_swap);
  }
}

// Words a..d and e..h of a final state: the digest as message words, without a trip through
// memory (StoreDigest writes the same words big-endian).
KVC_SHA_TARGET inline void DigestWords(__m128i abef, __m128i cdgh, __m128i& abcd, __m128i& efgh) {
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  abcd = _mm_blend_epi16(feba, dchg, 0xF0);
  efgh = _mm_alignr_epi8(dchg, feba, 8);
}

// Compresses one block per lane, given as its message words m[l], into every lane's state, the
// lanes interleaved round group by round group so that each hides the others' latency.
template <int Lanes>
KVC_SHA_TARGET inline void CompressWords(__m128i abef[Lanes], __m128i cdgh[Lanes],
                                         __m128i m[Lanes][4]) {
  __m128i abef_in[Lanes], cdgh_in[Lanes];
  for (int l = 0; l < Lanes; ++l) abef_in[l] = abef[l], cdgh_in[l] = cdgh[l];
    // Unrolled, so that the words' ring (index g % 4) lives in registers, not on the stack.
#pragma GCC unroll 16
  for (int g = 0; g < 16; ++g) {
    const __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(&kRound[4 * g]));
    for (int l = 0; l < Lanes; ++l) {
      __m128i* w = m[l];
      __m128i& cur = w[g % 4];
      if (g >= 4) {
        const __m128i prev1 = w[(g + 3) % 4], prev2 = w[(g + 2) % 4];
        const __m128i next = _mm_add_epi32(_mm_sha256msg1_epu32(cur, w[(g + 1) % 4]),
                                           _mm_alignr_epi8(prev1, prev2, 4));
        cur = _mm_sha256msg2_epu32(next, prev1);
      }
      FourRounds(abef[l], cdgh[l], _mm_add_epi32(cur, k));
    }
  }
  for (int l = 0; l < Lanes; ++l) {
    abef[l] = _mm_add_epi32(abef[l], abef_in[l]);
    cdgh[l] = _mm_add_epi32(cdgh[l], cdgh_in[l]);
  }
}

// Compresses the 64-byte block at blocks[l] into every lane's state.
template <int Lanes>
KVC_SHA_TARGET inline void CompressBlock(__m128i abef[Lanes], __m128i cdgh[Lanes],
                                         const uint8_t* const blocks[Lanes]) {
  __m128i m[Lanes][4];
  for (int l = 0; l < Lanes; ++l) LoadBlock(blocks[l], m[l]);
  CompressWords<Lanes>(abef, cdgh, m);
}

// The midstates of the chain's pages: out + 32*i holds the raw ABEF / CDGH registers after the
// `full` whole blocks of page i that precede its parent key, four pages at a time.
KVC_SHA_TARGET void PageMidstates(const uint8_t* pages, size_t page_bytes, size_t full, size_t n,
                                  uint8_t* out) {
  for (size_t i = 0; i < n; i += kLanes) {
    const size_t lanes = n - i < kLanes ? n - i : kLanes;
    // A short last group repeats its last page in the idle lanes; their states are dropped.
    const uint8_t* block[kLanes];
    for (size_t l = 0; l < kLanes; ++l)
      block[l] = pages + page_bytes * (i + (l < lanes ? l : lanes - 1));
    __m128i abef[kLanes], cdgh[kLanes];
    for (int l = 0; l < kLanes; ++l) InitialState(abef[l], cdgh[l]);
    for (size_t b = 0; b < full; ++b) {
      CompressBlock<kLanes>(abef, cdgh, block);
      for (int l = 0; l < kLanes; ++l) block[l] += 64;
    }
    for (size_t l = 0; l < lanes; ++l) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * (i + l)), abef[l]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * (i + l) + 16), cdgh[l]);
    }
  }
}

// Each page's last block or two, in order: its remaining token bytes, the previous key and the
// padding, from the page's midstate (or H(0) when the page has no whole block before its parent).
KVC_SHA_TARGET void ChainTails(const uint8_t* parent, const uint8_t* pages, size_t page_bytes,
                               size_t full, size_t n, uint8_t* out) {
  const size_t rest = page_bytes - 64 * full;  // Token bytes in the tail, 0..63.
  const size_t tail_blocks = rest + 32 + 9 <= 64 ? 1 : 2;
  alignas(16) uint8_t tail[128] = {};
  tail[rest + 32] = 0x80;
  const uint64_t bits = uint64_t{page_bytes + 32} * 8;
  for (int b = 0; b < 8; ++b)
    tail[64 * tail_blocks - 1 - b] = static_cast<uint8_t>(bits >> (8 * b));
  const uint8_t* blocks[1] = {tail};
  const uint8_t* prev = parent;
  for (size_t i = 0; i < n; ++i) {
    uint8_t* key = out + 32 * i;
    __m128i abef[1], cdgh[1];
    if (full == 0) {
      InitialState(abef[0], cdgh[0]);
    } else {
      abef[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key));
      cdgh[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16));
    }
    std::memcpy(tail, pages + page_bytes * i + 64 * full, rest);
    std::memcpy(tail + rest, prev, 32);
    blocks[0] = tail;
    CompressBlock<1>(abef, cdgh, blocks);
    if (tail_blocks == 2) {
      blocks[0] = tail + 64;
      CompressBlock<1>(abef, cdgh, blocks);
    }
    StoreDigest(abef[0], cdgh[0], key);
    prev = key;
  }
}

// SHA-256(first_block || suffixes[i] || tag) for every i: the shared first block is compressed
// once, then each message's one remaining block (its 32 bytes, the tag, the padding), four
// messages in lockstep.
KVC_SHA_TARGET void PrefixedSuffixes(const uint8_t* first_block, const uint8_t* suffixes, size_t n,
                                     uint8_t tag, uint8_t* out) {
  __m128i mid_abef[1], mid_cdgh[1];
  InitialState(mid_abef[0], mid_cdgh[0]);
  const uint8_t* first[1] = {first_block};
  CompressBlock<1>(mid_abef, mid_cdgh, first);
  // The last block: 32 bytes of suffix, the tag, 0x80, zeros, the message length in bits.
  alignas(16) uint8_t block[kLanes][64] = {};
  const uint64_t bits = uint64_t{64 + 32 + 1} * 8;
  for (int l = 0; l < kLanes; ++l) {
    block[l][32] = tag;
    block[l][33] = 0x80;
    for (int b = 0; b < 8; ++b) block[l][63 - b] = static_cast<uint8_t>(bits >> (8 * b));
  }
  const uint8_t* blocks[kLanes] = {block[0], block[1], block[2], block[3]};
  for (size_t i = 0; i < n; i += kLanes) {
    const size_t lanes = n - i < kLanes ? n - i : kLanes;
    // A short last group repeats its last message in the idle lanes; their digests are dropped.
    for (size_t l = 0; l < kLanes; ++l) {
      std::memcpy(block[l], suffixes + 32 * (i + (l < lanes ? l : lanes - 1)), 32);
    }
    __m128i abef[kLanes], cdgh[kLanes];
    for (int l = 0; l < kLanes; ++l) abef[l] = mid_abef[0], cdgh[l] = mid_cdgh[0];
    CompressBlock<kLanes>(abef, cdgh, blocks);
    // Written after the group is read, so that `out` may be `suffixes`.
    for (size_t l = 0; l < lanes; ++l) StoreDigest(abef[l], cdgh[l], out + 32 * (i + l));
  }
}

// The chain for pages of exactly one block (16 tokens): each page's second block is its parent
// key and constant padding, so its message words come straight from the previous digest's
// registers; and it is compressed in lockstep with the next page's token block, which does not
// depend on it. The chain then costs about one block's latency per page.
KVC_SHA_TARGET void ChainBlockPages(const uint8_t* parent, const uint8_t* pages, size_t n,
                                    uint8_t* out) {
  // The second block's words 8..15: 0x80, zeros, the message length (96 bytes) in bits.
  const __m128i pad_lo = _mm_set_epi32(0, 0, 0, static_cast<int>(0x80000000u));
  const __m128i pad_hi = _mm_set_epi32(96 * 8, 0, 0, 0);
  __m128i parent_words[4];
  alignas(16) uint8_t parent_block[64] = {};
  std::memcpy(parent_block, parent, 32);
  LoadBlock(parent_block, parent_words);
  __m128i abcd = parent_words[0], efgh = parent_words[1];

  __m128i abef[2], cdgh[2], m[2][4];
  // Page 0's token block alone; then page i's second block beside page i+1's first.
  InitialState(abef[1], cdgh[1]);
  LoadBlock(pages, m[1]);
  CompressWords<1>(&abef[1], &cdgh[1], &m[1]);
  for (size_t i = 0; i < n; ++i) {
    abef[0] = abef[1], cdgh[0] = cdgh[1];
    m[0][0] = abcd, m[0][1] = efgh, m[0][2] = pad_lo, m[0][3] = pad_hi;
    if (i + 1 < n) {
      InitialState(abef[1], cdgh[1]);
      LoadBlock(pages + 64 * (i + 1), m[1]);
      CompressWords<2>(abef, cdgh, m);
    } else {
      CompressWords<1>(abef, cdgh, m);
    }
    StoreDigest(abef[0], cdgh[0], out + 32 * i);
    DigestWords(abef[0], cdgh[0], abcd, efgh);
  }
}

}  // namespace

bool HaveShaExtensions() {
  static const bool have = DetectShaExtensions();
  return have;
}

void HashAfterBlock(const uint8_t* first_block, const uint8_t* suffixes, size_t n, uint8_t tag,
                    uint8_t* out) {
  PrefixedSuffixes(first_block, suffixes, n, tag, out);
}

void ChainSuffixed(const uint8_t* parent, const uint8_t* pages, size_t page_bytes, size_t n,
                   uint8_t* out) {
  if (page_bytes == 64) {
    ChainBlockPages(parent, pages, n, out);
    return;
  }
  const size_t full = page_bytes / 64;
  if (full > 0) PageMidstates(pages, page_bytes, full, n, out);
  ChainTails(parent, pages, page_bytes, full, n, out);
}

#else  // Not x86-64: no SHA extensions; the callers use OpenSSL.

bool HaveShaExtensions() { return false; }
void HashAfterBlock(const uint8_t*, const uint8_t*, size_t, uint8_t, uint8_t*) {}
void ChainSuffixed(const uint8_t*, const uint8_t*, size_t, size_t, uint8_t*) {}

#endif

}  // namespace kvcellar::core::sha256
