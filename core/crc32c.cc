#include "core/crc32c.h"

#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvcellar::core {
namespace {

// The slicing loop reads words as little-endian; kvcellar targets x86-64 and aarch64.
static_assert(std::endian::native == std::endian::little);

constexpr uint32_t kPoly = 0x82F63B78;  // CRC-32C, reflected (RFC 3720, iSCSI).

// Block sizes of the three-way hardware loop. Powers of two; the long blocks amortize the combine
// step, the short ones catch what is left (Adler's values).
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

struct Tables {
  uint32_t slice[8][256];   // Slicing-by-8 tables for the software path.
  uint32_t long_shift[4][256];   // Operator: append kLong zero bytes to a CRC.
  uint32_t short_shift[4][256];  // Operator: append kShort zero bytes to a CRC.
};

uint32_t Gf2MatrixTimes(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec != 0) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void Gf2MatrixSquare(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = Gf2MatrixTimes(mat, mat[n]);
}

// The operator that appends `len` zero bytes (a power of two) to a raw CRC register.
void ZerosOperator(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // One zero bit.
  uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  Gf2MatrixSquare(even, odd);  // Two zero bits.
  Gf2MatrixSquare(odd, even);  // Four zero bits.
  // Each square doubles: the first gives one zero byte, in `even`.
  do {
    Gf2MatrixSquare(even, odd);
    len >>= 1;
    if (len == 0) return;
    Gf2MatrixSquare(odd, even);
    len >>= 1;
  } while (len != 0);
  std::memcpy(even, odd, sizeof(odd));
}

void ShiftTables(uint32_t zeros[4][256], size_t len) {
  uint32_t op[32];
  ZerosOperator(op, len);
  for (uint32_t n = 0; n < 256; ++n) {
    zeros[0][n] = Gf2MatrixTimes(op, n);
    zeros[1][n] = Gf2MatrixTimes(op, n << 8);
    zeros[2][n] = Gf2MatrixTimes(op, n << 16);
    zeros[3][n] = Gf2MatrixTimes(op, n << 24);
  }
}

const Tables& GetTables() {
  static const Tables* tables = [] {
    auto* t = new Tables;
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t crc = n;
      for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ kPoly : crc >> 1;
      t->slice[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t crc = t->slice[0][n];
      for (int k = 1; k < 8; ++k) {
        crc = t->slice[0][crc & 0xff] ^ (crc >> 8);
        t->slice[k][n] = crc;
      }
    }
    ShiftTables(t->long_shift, kLong);
    ShiftTables(t->short_shift, kShort);
    return t;
  }();
  return *tables;
}

inline uint32_t Shift(const uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
         zeros[3][crc >> 24];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* next, size_t len,
                                                          uint32_t crc, const Tables& t) {
  uint64_t crc0 = crc ^ 0xFFFFFFFFu;
  while (len != 0 && (reinterpret_cast<uintptr_t>(next) & 7) != 0) {
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *next++);
    --len;
  }
  auto load = [](const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  // Three streams of kLong bytes each; the instruction has a latency of 3 and a throughput of 1.
  while (len >= kLong * 3) {
    uint64_t crc1 = 0, crc2 = 0;
    const uint8_t* end = next + kLong;
    do {
      crc0 = _mm_crc32_u64(crc0, load(next));
      crc1 = _mm_crc32_u64(crc1, load(next + kLong));
      crc2 = _mm_crc32_u64(crc2, load(next + 2 * kLong));
      next += 8;
    } while (next < end);
    crc0 = Shift(t.long_shift, static_cast<uint32_t>(crc0)) ^ crc1;
    crc0 = Shift(t.long_shift, static_cast<uint32_t>(crc0)) ^ crc2;
    next += 2 * kLong;
    len -= 3 * kLong;
  }
  while (len >= kShort * 3) {
    uint64_t crc1 = 0, crc2 = 0;
    const uint8_t* end = next + kShort;
    do {
      crc0 = _mm_crc32_u64(crc0, load(next));
      crc1 = _mm_crc32_u64(crc1, load(next + kShort));
      crc2 = _mm_crc32_u64(crc2, load(next + 2 * kShort));
      next += 8;
    } while (next < end);
    crc0 = Shift(t.short_shift, static_cast<uint32_t>(crc0)) ^ crc1;
    crc0 = Shift(t.short_shift, static_cast<uint32_t>(crc0)) ^ crc2;
    next += 2 * kShort;
    len -= 3 * kShort;
  }
  const uint8_t* end = next + (len - (len & 7));
  while (next < end) {
    crc0 = _mm_crc32_u64(crc0, load(next));
    next += 8;
  }
  len &= 7;
  while (len != 0) {
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *next++);
    --len;
  }
  return static_cast<uint32_t>(crc0) ^ 0xFFFFFFFFu;
}

bool DetectHardware() { return __builtin_cpu_supports("sse4.2"); }
#else
bool DetectHardware() { return false; }
#endif

}  // namespace

bool Crc32cHardwareAvailable() {
  static const bool available = DetectHardware();
  return available;
}

uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t crc) {
  const Tables& t = GetTables();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = crc ^ 0xFFFFFFFFu;
  while (n != 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = t.slice[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t.slice[7][lo & 0xff] ^ t.slice[6][(lo >> 8) & 0xff] ^ t.slice[5][(lo >> 16) & 0xff] ^
        t.slice[4][lo >> 24] ^ t.slice[3][hi & 0xff] ^ t.slice[2][(hi >> 8) & 0xff] ^
        t.slice[1][(hi >> 16) & 0xff] ^ t.slice[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n != 0) {
    c = t.slice[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    --n;
  }
  return c ^ 0xFFFFFFFFu;
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (Crc32cHardwareAvailable()) {
    return Crc32cHardware(static_cast<const uint8_t*>(data), n, crc, GetTables());
  }
#endif
  return Crc32cSoftware(data, n, crc);
}

}  // namespace kvcellar::core
