#include "core/slot_journal.h"

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/kv_layout.h"

namespace kvcellar::core {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'C', 'J', 'R', 'N', 'L', '1'};

// Header layout. The fields up to kOffHeaderCrc are written once, at Format; the log's fill
// level after them changes with every namespace append.
constexpr size_t kOffVersion = 8;            // u32
constexpr size_t kOffRecordBytes = 12;       // u32
constexpr size_t kOffCapacity = 16;          // u64
constexpr size_t kOffRegionBytes = 24;       // u64
constexpr size_t kOffRegionCount = 32;       // u32
constexpr size_t kOffSlotClasses = 36;       // u32
constexpr size_t kOffSlotSizesCrc = 40;      // u32: CRC-32C of the slot sizes (u64 each)
constexpr size_t kOffMaxSlots = 44;          // u32
constexpr size_t kOffLogBytes = 48;          // u64
constexpr size_t kOffHeaderCrc = 56;         // u32 over [0, 56)
constexpr size_t kOffLogUsed = 64;           // u64, atomic: bytes of the log in use

// A log entry: u32 payload bytes, u32 CRC-32C of (id, kind, payload), u32 id, u8 kind, 3 pad,
// then the payload, padded to 8 bytes.
constexpr size_t kEntryHeaderBytes = 16;
constexpr uint8_t kEntrySpec = 1;
constexpr uint8_t kEntryGeometry = 2;

// Record layout (kRecordBytes = 96).
constexpr size_t kRecCrc = 0;          // u32 over [4, 96)
constexpr size_t kRecState = 4;        // u8
constexpr size_t kRecHasParent = 5;    // u8
constexpr size_t kRecShard = 6;        // u16
constexpr size_t kRecNs = 8;           // u32
constexpr size_t kRecSizeClass = 12;   // u16
constexpr size_t kRecEpoch = 14;       // u16: the namespace's geometry epoch
constexpr size_t kRecLength = 16;      // u64
constexpr size_t kRecPayloadCrc = 24;  // u32
constexpr size_t kRecKey = 32;         // 32 bytes
constexpr size_t kRecParent = 64;      // 32 bytes

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

uint32_t SlotSizesCrc(const std::vector<uint64_t>& sizes) {
  return Crc32c(sizes.data(), sizes.size() * sizeof(uint64_t));
}

uint32_t RecordCrc(const uint8_t* rec) {
  return Crc32c(rec + kRecState, SlotJournal::kRecordBytes - kRecState);
}

// The record checksum is stored last, after a release fence: a crash before it leaves a record
// whose checksum fails (torn), never one that verifies with half its fields.
void SealRecord(uint8_t* rec) {
  const uint32_t crc = RecordCrc(rec);
  std::atomic_thread_fence(std::memory_order_release);
  Put<uint32_t>(rec + kRecCrc, crc);
}

// COMMITTED with the payload's checksum (MarkCommitted, EndSeal).
void StoreCommitted(uint8_t* rec, uint32_t payload_crc) {
  Put<uint32_t>(rec + kRecPayloadCrc, payload_crc);
  Put<uint8_t>(rec + kRecState, static_cast<uint8_t>(SlotRecordState::kCommitted));
  SealRecord(rec);
}

std::atomic_ref<uint64_t> LogUsed(uint8_t* base) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + kOffLogUsed));
}

void PutString(std::string& out, const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  out.append(s);
}
void PutU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }

// Reads a payload written by the Put* functions above; any overrun fails the whole entry.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool String(std::string* s) {
    uint32_t n;
    if (!U32(&n) || static_cast<size_t>(end_ - p_) < n) return false;
    s->assign(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }
  bool done() const { return p_ == end_; }

 private:
  bool Raw(void* v, size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    std::memcpy(v, p_, n);
    p_ += n;
    return true;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

bool DecodeSpec(const uint8_t* p, size_t n, NamespaceSpec* spec) {
  Reader r(p, n);
  uint32_t page_size, layout, tp_size, opaque;
  if (!r.String(&spec->tenant) || !r.String(&spec->model_id) || !r.String(&spec->model_revision) ||
      !r.String(&spec->kv_dtype) || !r.U32(&page_size) || !r.U32(&layout) || !r.U32(&tp_size) ||
      !r.U32(&opaque) || layout > static_cast<uint32_t>(LayoutKind::kMla)) {
    return false;
  }
  if (!r.done()) {
    uint32_t groups;
    if (!r.U32(&groups) || groups > kMaxKvGroups) return false;
    for (uint32_t g = 0; g < groups; ++g) {
      uint32_t kind, window;
      if (!r.U32(&kind) || !r.U32(&window) || kind > static_cast<uint32_t>(GroupKind::kState)) {
        return false;
      }
      spec->groups.push_back({static_cast<GroupKind>(kind), window});
    }
    if (!r.done()) return false;
  }
  spec->page_size = page_size;
  spec->layout = static_cast<LayoutKind>(layout);
  spec->tp_size = tp_size;
  spec->opaque_keys = opaque != 0;
  return spec->Validate().ok();
}

bool DecodeGeometry(const uint8_t* p, size_t n, uint32_t* epoch,
                    std::vector<std::pair<uint64_t, uint64_t>>* out) {
  Reader r(p, n);
  uint32_t runs;
  if (!r.U32(epoch) || !r.U32(&runs)) return false;
  for (uint32_t i = 0; i < runs; ++i) {
    uint32_t count;
    uint64_t k, v;
    if (!r.U32(&count) || !r.U64(&k) || !r.U64(&v)) return false;
    if (out->size() + count > kMaxLayers) return false;
    out->insert(out->end(), count, {k, v});
  }
  return r.done() && !out->empty();
}

}  // namespace

absl::StatusOr<uint64_t> SlotJournal::Bytes(const SlotJournalGeometry& g) {
  if (g.region_count == 0 || g.region_bytes == 0 || g.slot_sizes.empty() ||
      g.slot_sizes[0] == 0 || g.slot_sizes[0] > g.region_bytes) {
    return absl::InvalidArgumentError("slot journal: empty or inconsistent pool geometry");
  }
  const uint64_t max_slots = g.region_bytes / g.slot_sizes[0];
  return kHeaderBytes + kNamespaceLogBytes + uint64_t{g.region_count} * max_slots * kRecordBytes;
}

SlotJournal::SlotJournal(const SlotJournalGeometry& g, std::span<uint8_t> memory)
    : base_(memory.data()),
      region_count_(g.region_count),
      max_slots_per_region_(static_cast<uint32_t>(g.region_bytes / g.slot_sizes[0])),
      log_(memory.data() + kHeaderBytes),
      records_(memory.data() + kHeaderBytes + kNamespaceLogBytes) {}

absl::StatusOr<std::unique_ptr<SlotJournal>> SlotJournal::Format(const SlotJournalGeometry& g,
                                                                 std::span<uint8_t> memory) {
  absl::StatusOr<uint64_t> need = Bytes(g);
  if (!need.ok()) return need.status();
  if (memory.size() < *need || reinterpret_cast<uintptr_t>(memory.data()) % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("slot journal memory of ", memory.size(),
                                                   " bytes must hold ", *need,
                                                   " and start on a 64-byte boundary"));
  }
  std::memset(memory.data(), 0, *need);
  uint8_t* h = memory.data();
  std::memcpy(h, kMagic, sizeof(kMagic));
  Put<uint32_t>(h + kOffVersion, kFormatVersion);
  Put<uint32_t>(h + kOffRecordBytes, kRecordBytes);
  Put<uint64_t>(h + kOffCapacity, g.capacity_bytes);
  Put<uint64_t>(h + kOffRegionBytes, g.region_bytes);
  Put<uint32_t>(h + kOffRegionCount, g.region_count);
  Put<uint32_t>(h + kOffSlotClasses, static_cast<uint32_t>(g.slot_sizes.size()));
  Put<uint32_t>(h + kOffSlotSizesCrc, SlotSizesCrc(g.slot_sizes));
  Put<uint32_t>(h + kOffMaxSlots, static_cast<uint32_t>(g.region_bytes / g.slot_sizes[0]));
  Put<uint64_t>(h + kOffLogBytes, kNamespaceLogBytes);
  Put<uint32_t>(h + kOffHeaderCrc, Crc32c(h, kOffHeaderCrc));
  return std::unique_ptr<SlotJournal>(new SlotJournal(g, memory.first(*need)));
}

absl::StatusOr<std::unique_ptr<SlotJournal>> SlotJournal::Attach(const SlotJournalGeometry& g,
                                                                 std::span<uint8_t> memory) {
  absl::StatusOr<uint64_t> need = Bytes(g);
  if (!need.ok()) return need.status();
  if (memory.size() < *need) {
    return absl::FailedPreconditionError(
        absl::StrCat("journal has ", memory.size(), " bytes, the pool's geometry needs ", *need));
  }
  const uint8_t* h = memory.data();
  if (std::memcmp(h, kMagic, sizeof(kMagic)) != 0) {
    return absl::FailedPreconditionError("journal has no header (never formatted)");
  }
  if (Get<uint32_t>(h + kOffVersion) != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat("journal format version ",
                                                      Get<uint32_t>(h + kOffVersion),
                                                      " != ", kFormatVersion));
  }
  if (Get<uint32_t>(h + kOffHeaderCrc) != Crc32c(h, kOffHeaderCrc)) {
    return absl::FailedPreconditionError("journal header checksum mismatch");
  }
  auto differs = [](absl::string_view field, uint64_t was, uint64_t now) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool geometry changed: ", field, " was ", was, ", now ", now));
  };
  if (Get<uint32_t>(h + kOffRecordBytes) != kRecordBytes) {
    return differs("record_bytes", Get<uint32_t>(h + kOffRecordBytes), kRecordBytes);
  }
  if (Get<uint64_t>(h + kOffCapacity) != g.capacity_bytes) {
    return differs("pool.capacity", Get<uint64_t>(h + kOffCapacity), g.capacity_bytes);
  }
  if (Get<uint64_t>(h + kOffRegionBytes) != g.region_bytes) {
    return differs("pool.region_size", Get<uint64_t>(h + kOffRegionBytes), g.region_bytes);
  }
  if (Get<uint32_t>(h + kOffRegionCount) != g.region_count) {
    return differs("regions", Get<uint32_t>(h + kOffRegionCount), g.region_count);
  }
  if (Get<uint32_t>(h + kOffSlotClasses) != g.slot_sizes.size() ||
      Get<uint32_t>(h + kOffSlotSizesCrc) != SlotSizesCrc(g.slot_sizes)) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool geometry changed: the slot sizes (pool.slot_sizes) differ; ",
                     Get<uint32_t>(h + kOffSlotClasses), " classes were, ", g.slot_sizes.size(),
                     " are"));
  }
  if (Get<uint64_t>(h + kOffLogBytes) != kNamespaceLogBytes) {
    return differs("namespace log bytes", Get<uint64_t>(h + kOffLogBytes), kNamespaceLogBytes);
  }
  return std::unique_ptr<SlotJournal>(new SlotJournal(g, memory.first(*need)));
}

absl::Status SlotJournal::Append(uint32_t id, uint8_t kind, const std::string& payload) {
  absl::MutexLock lock(&mu_);
  std::atomic_ref<uint64_t> used = LogUsed(base_);
  const uint64_t at = used.load(std::memory_order_acquire);
  const uint64_t size = kEntryHeaderBytes + (payload.size() + 7) / 8 * 8;
  if (at > kNamespaceLogBytes || kNamespaceLogBytes - at < size) {
    return absl::ResourceExhaustedError(
        absl::StrCat("slot journal: the namespace log (", kNamespaceLogBytes,
                     " bytes) is full; namespace ", id, " and its pages will not survive a restart"));
  }
  uint8_t* e = log_ + at;
  Put<uint32_t>(e, static_cast<uint32_t>(payload.size()));
  Put<uint32_t>(e + 8, id);
  e[12] = kind;
  std::memcpy(e + kEntryHeaderBytes, payload.data(), payload.size());
  uint32_t crc = Crc32c(e + 8, 8);
  crc = Crc32c(payload.data(), payload.size(), crc);
  Put<uint32_t>(e + 4, crc);
  // The entry exists once the fill level covers it: a crash before leaves it unwritten.
  used.store(at + size, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status SlotJournal::AppendNamespace(uint32_t id, const NamespaceSpec& spec) {
  std::string p;
  PutString(p, spec.tenant);
  PutString(p, spec.model_id);
  PutString(p, spec.model_revision);
  PutString(p, spec.kv_dtype);
  PutU32(p, spec.page_size);
  PutU32(p, static_cast<uint32_t>(spec.layout));
  PutU32(p, spec.tp_size);
  PutU32(p, spec.opaque_keys ? 1 : 0);
  // A hybrid's KV groups follow (a journal written before groups ends here: no groups).
  if (spec.Hybrid()) {
    PutU32(p, static_cast<uint32_t>(spec.groups.size()));
    for (const KvGroup& g : spec.groups) {
      PutU32(p, static_cast<uint32_t>(g.kind));
      PutU32(p, g.window_tokens);
    }
  }
  return Append(id, kEntrySpec, p);
}

absl::Status SlotJournal::AppendGeometry(uint32_t id, uint16_t geometry_epoch,
                                         std::span<const std::pair<uint64_t, uint64_t>> buffers) {
  // Run-length coded: models repeat one layer shape (a few interleave two).
  std::string runs;
  uint32_t count = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    size_t j = i;
    while (j + 1 < buffers.size() && buffers[j + 1] == buffers[i]) ++j;
    PutU32(runs, static_cast<uint32_t>(j - i + 1));
    PutU64(runs, buffers[i].first);
    PutU64(runs, buffers[i].second);
    ++count;
    i = j;
  }
  std::string p;
  PutU32(p, geometry_epoch);
  PutU32(p, count);
  p += runs;
  return Append(id, kEntryGeometry, p);
}

std::vector<JournalNamespace> SlotJournal::Namespaces() const {
  absl::MutexLock lock(&mu_);
  const uint64_t used =
      std::min<uint64_t>(LogUsed(base_).load(std::memory_order_acquire), kNamespaceLogBytes);
  std::vector<JournalNamespace> out;
  for (uint64_t at = 0; at + kEntryHeaderBytes <= used;) {
    const uint8_t* e = log_ + at;
    const uint32_t n = Get<uint32_t>(e);
    const uint64_t size = kEntryHeaderBytes + (uint64_t{n} + 7) / 8 * 8;
    if (size > used - at) break;
    at += size;
    uint32_t crc = Crc32c(e + 8, 8);
    crc = Crc32c(e + kEntryHeaderBytes, n, crc);
    if (crc != Get<uint32_t>(e + 4)) continue;
    const uint32_t id = Get<uint32_t>(e + 8);
    const uint8_t kind = e[12];
    if (id == 0) continue;
    if (kind == kEntrySpec) {
      JournalNamespace ns;
      ns.id = id;
      if (!DecodeSpec(e + kEntryHeaderBytes, n, &ns.spec)) continue;
      if (out.size() < id) out.resize(id);
      out[id - 1] = std::move(ns);
    } else if (kind == kEntryGeometry && id <= out.size() && out[id - 1].id == id) {
      std::vector<std::pair<uint64_t, uint64_t>> buffers;
      uint32_t epoch = 0;
      if (DecodeGeometry(e + kEntryHeaderBytes, n, &epoch, &buffers)) {
        out[id - 1].buffers = std::move(buffers);
        out[id - 1].geometry_epoch = static_cast<uint16_t>(epoch);
      }
    }
  }
  return out;
}

void SlotJournal::MarkWriting(SlotRef slot, uint32_t ns, uint16_t geometry_epoch, uint16_t shard,
                              const PageKey& key, const std::optional<PageKey>& parent) {
  uint8_t* rec = RecordAt(slot.region, slot.index);
  Put<uint8_t>(rec + kRecState, static_cast<uint8_t>(SlotRecordState::kWriting));
  Put<uint8_t>(rec + kRecHasParent, parent.has_value() ? 1 : 0);
  Put<uint16_t>(rec + kRecShard, shard);
  Put<uint32_t>(rec + kRecNs, ns);
  Put<uint16_t>(rec + kRecSizeClass, slot.size_class);
  Put<uint16_t>(rec + kRecEpoch, geometry_epoch);
  Put<uint64_t>(rec + kRecLength, 0);
  Put<uint64_t>(rec + kRecPayloadCrc, 0);
  std::memcpy(rec + kRecKey, key.bytes.data(), kPageKeyBytes);
  if (parent.has_value()) {
    std::memcpy(rec + kRecParent, parent->bytes.data(), kPageKeyBytes);
  } else {
    std::memset(rec + kRecParent, 0, kPageKeyBytes);
  }
  SealRecord(rec);
}

void SlotJournal::MarkCommitted(SlotRef slot, uint64_t length, uint32_t payload_crc) {
  uint8_t* rec = RecordAt(slot.region, slot.index);
  Put<uint64_t>(rec + kRecLength, length);
  StoreCommitted(rec, payload_crc);
}

PageKey SlotJournal::MarkLanded(SlotRef slot, uint64_t length) {
  uint8_t* rec = RecordAt(slot.region, slot.index);
  Put<uint64_t>(rec + kRecLength, length);
  Put<uint32_t>(rec + kRecPayloadCrc, 0);
  Put<uint8_t>(rec + kRecState, static_cast<uint8_t>(SlotRecordState::kLanded));
  SealRecord(rec);
  PageKey key;
  std::memcpy(key.bytes.data(), rec + kRecKey, kPageKeyBytes);
  return key;
}

bool SlotJournal::BeginSeal(SlotRef slot, const PageKey& key) {
  std::lock_guard<std::mutex> lock(seal_mu_);
  const uint8_t* rec = RecordAt(slot.region, slot.index);
  if (rec[kRecState] != static_cast<uint8_t>(SlotRecordState::kLanded) ||
      std::memcmp(rec + kRecKey, key.bytes.data(), kPageKeyBytes) != 0 ||
      Get<uint16_t>(rec + kRecSizeClass) != slot.size_class) {
    return false;  // Freed (and maybe reused) since it landed: nothing to seal.
  }
  sealing_ = slot.Packed();
  return true;
}

void SlotJournal::EndSeal(SlotRef slot, uint32_t payload_crc) {
  {
    std::lock_guard<std::mutex> lock(seal_mu_);
    StoreCommitted(RecordAt(slot.region, slot.index), payload_crc);
    sealing_ = kNotSealing;
  }
  seal_cv_.notify_all();
}

void SlotJournal::Clear(SlotRef slot) {
  std::unique_lock<std::mutex> lock(seal_mu_);
  seal_cv_.wait(lock, [&] { return sealing_ != slot.Packed(); });
  ClearAt(slot.region, slot.index);
}

void SlotJournal::ClearAt(uint32_t region, uint32_t index) {
  uint8_t* rec = RecordAt(region, index);
  // One byte: whatever else the record still says, EMPTY is read first and ends it.
  std::atomic_ref<uint8_t>(rec[kRecState]).store(static_cast<uint8_t>(SlotRecordState::kEmpty),
                                                 std::memory_order_release);
}

SlotRecord SlotJournal::Read(uint32_t region, uint32_t index) const {
  const uint8_t* rec = RecordAt(region, index);
  SlotRecord r;
  const uint8_t state = rec[kRecState];
  if (state == static_cast<uint8_t>(SlotRecordState::kEmpty)) return r;
  if (Get<uint32_t>(rec + kRecCrc) != RecordCrc(rec) ||
      state == static_cast<uint8_t>(SlotRecordState::kTorn) ||
      state > static_cast<uint8_t>(SlotRecordState::kLanded)) {
    r.state = SlotRecordState::kTorn;
    return r;
  }
  r.state = static_cast<SlotRecordState>(state);
  r.ns = Get<uint32_t>(rec + kRecNs);
  r.shard = Get<uint16_t>(rec + kRecShard);
  r.size_class = Get<uint16_t>(rec + kRecSizeClass);
  r.geometry_epoch = Get<uint16_t>(rec + kRecEpoch);
  r.length = Get<uint64_t>(rec + kRecLength);
  r.payload_crc = Get<uint32_t>(rec + kRecPayloadCrc);
  std::memcpy(r.key.bytes.data(), rec + kRecKey, kPageKeyBytes);
  if (rec[kRecHasParent] != 0) {
    PageKey parent;
    std::memcpy(parent.bytes.data(), rec + kRecParent, kPageKeyBytes);
    r.parent = parent;
  }
  return r;
}

}  // namespace kvcellar::core
