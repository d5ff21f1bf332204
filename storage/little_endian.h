// Explicit little-endian stores and loads of unsigned integers, for the on-disk and on-wire
// formats of L3 objects (object_format.h) and the Redis index (redis_index.h): the same bytes on
// every host, whatever its byte order, and no alignment needed.
#ifndef KVCELLAR_STORAGE_LITTLE_ENDIAN_H_
#define KVCELLAR_STORAGE_LITTLE_ENDIAN_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvcellar::storage {

template <typename T>
void StoreLe(uint8_t* p, T v) {
  static_assert(std::is_unsigned_v<T>);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

template <typename T>
T LoadLe(const uint8_t* p) {
  static_assert(std::is_unsigned_v<T>);
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(p[i]) << (8 * i);
  return v;
}

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_LITTLE_ENDIAN_H_
