// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of every L3 object's header
// and payload (storage/object_format.h) and of every L2 page the slot journal records for a warm
// restart (core/slot_journal.h). It lives in core because both tiers use it and it is pure
// computation.
//
// Chosen over CRC-32 (zlib) because x86-64 has an instruction for it (SSE4.2 `crc32`) and ARMv8
// has one too (`crc32c*`), and because iSCSI, ext4, Btrfs and RocksDB use it, so its error
// detection on storage media is well understood. The hardware path runs three independent
// instruction streams and combines them (Mark Adler's method), which hides the instruction's
// 3-cycle latency: about 3x one stream, comfortably faster than the NVMe reads it checks. A
// slicing-by-8 table fallback serves CPUs without SSE4.2 and cross-checks the fast path in tests.
//
// Threads: all functions are pure and may be called from any thread. The lookup tables are built
// once, on first use, and never change.
#ifndef KVCELLAR_CORE_CRC32C_H_
#define KVCELLAR_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvcellar::core {

// CRC-32C of data[0, n), continuing from `crc` (the value returned for the bytes before; 0 to
// start). Crc32c(b, Crc32c(a)) == Crc32c(a || b). Uses the hardware path when the CPU has it.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The table-driven path, whatever the CPU. Same results.
uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t crc = 0);

// True when Crc32c uses the CPU instruction.
bool Crc32cHardwareAvailable();

}  // namespace kvcellar::core

#endif  // KVCELLAR_CORE_CRC32C_H_
