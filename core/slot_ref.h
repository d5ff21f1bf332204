// SlotRef: a reference to one fixed-size slot of the L2 host pool.
//
// The index stores a SlotRef per (page, shard) resident in L2; the host pool turns it into an
// address. It is a value type of 8 bytes so that index nodes stay small.
#ifndef KVCELLAR_CORE_SLOT_REF_H_
#define KVCELLAR_CORE_SLOT_REF_H_

#include <cstdint>

namespace kvcellar::core {

struct SlotRef {
  static constexpr uint32_t kInvalidIndex = 0xffffffffu;

  uint16_t size_class = 0;             // Index into the pool's size classes.
  uint16_t region = 0;                 // Region of that class the slot lives in.
  uint32_t index = kInvalidIndex;      // Slot number inside the region.

  bool valid() const { return index != kInvalidIndex; }
  uint64_t Packed() const {
    return (uint64_t{size_class} << 48) | (uint64_t{region} << 32) | index;
  }
  static SlotRef FromPacked(uint64_t v) {
    return SlotRef{static_cast<uint16_t>(v >> 48), static_cast<uint16_t>(v >> 32),
                   static_cast<uint32_t>(v)};
  }
  friend bool operator==(const SlotRef& a, const SlotRef& b) { return a.Packed() == b.Packed(); }
  template <typename H>
  friend H AbslHashValue(H h, const SlotRef& s) {
    return H::combine(std::move(h), s.Packed());
  }
};
static_assert(sizeof(SlotRef) == 8);

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_SLOT_REF_H_
