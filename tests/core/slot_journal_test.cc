// Tests for core/slot_journal.h: format and attach across "processes" (a second journal object
// over the same bytes), geometry changes refused with the difference named, the record
// lifecycle, torn records, and the namespace log (ids, specs, run-length coded geometry, a full
// log, a damaged entry).
#include "core/slot_journal.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcellar::core {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kRegion = 1 << 20;

SlotJournalGeometry Geometry() {
  SlotJournalGeometry g;
  g.region_bytes = kRegion;
  g.region_count = 4;
  g.capacity_bytes = 4 * kRegion;
  g.slot_sizes = {64 << 10, 256 << 10};
  return g;
}

// 64-byte aligned memory for a journal, zeroed like a fresh shm object.
struct Memory {
  explicit Memory(uint64_t n) : bytes(n), p(static_cast<uint8_t*>(std::aligned_alloc(64, n))) {
    std::memset(p, 0, n);
  }
  ~Memory() { std::free(p); }
  std::span<uint8_t> span() const { return {p, bytes}; }
  uint64_t bytes;
  uint8_t* p;
};

PageKey Key(uint8_t b) {
  PageKey k;
  k.bytes.fill(b);
  return k;
}

NamespaceSpec Spec(const std::string& model) {
  NamespaceSpec s;
  s.tenant = "team-a";
  s.model_id = model;
  s.model_revision = "rev1";
  s.kv_dtype = "bf16";
  s.page_size = 16;
  s.layout = LayoutKind::kMha;
  s.tp_size = 2;
  return s;
}

TEST(SlotJournalTest, SizeIsHeaderLogAndOneRecordPerSmallestSlot) {
  absl::StatusOr<uint64_t> n = SlotJournal::Bytes(Geometry());
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, SlotJournal::kHeaderBytes + SlotJournal::kNamespaceLogBytes +
                    4 * (kRegion / (64 << 10)) * SlotJournal::kRecordBytes);
  SlotJournalGeometry empty;
  EXPECT_EQ(SlotJournal::Bytes(empty).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SlotJournalTest, RecordsSurviveIntoTheNextAttach) {
  Memory m(*SlotJournal::Bytes(Geometry()));
  {
    auto j = SlotJournal::Format(Geometry(), m.span());
    ASSERT_TRUE(j.ok()) << j.status();
    (*j)->MarkWriting({0, 1, 3}, 2, 5, 1, Key(7), Key(6));
    (*j)->MarkCommitted({0, 1, 3}, 40000, 0xdeadbeef);
    (*j)->MarkWriting({1, 2, 0}, 1, 1, 0, Key(9), std::nullopt);  // Never committed.
    (*j)->MarkWriting({0, 3, 5}, 1, 1, 0, Key(8), std::nullopt);
    (*j)->MarkCommitted({0, 3, 5}, 100, 1);
    (*j)->Clear({0, 3, 5});  // Freed.
  }
  auto j = SlotJournal::Attach(Geometry(), m.span());
  ASSERT_TRUE(j.ok()) << j.status();
  const SlotRecord committed = (*j)->Read(1, 3);
  EXPECT_EQ(committed.state, SlotRecordState::kCommitted);
  EXPECT_EQ(committed.ns, 2u);
  EXPECT_EQ(committed.shard, 1u);
  EXPECT_EQ(committed.size_class, 0u);
  EXPECT_EQ(committed.geometry_epoch, 5u);
  EXPECT_EQ(committed.length, 40000u);
  EXPECT_EQ(committed.payload_crc, 0xdeadbeefu);
  EXPECT_EQ(committed.key, Key(7));
  ASSERT_TRUE(committed.parent.has_value());
  EXPECT_EQ(*committed.parent, Key(6));
  const SlotRecord writing = (*j)->Read(2, 0);
  EXPECT_EQ(writing.state, SlotRecordState::kWriting);
  EXPECT_EQ(writing.size_class, 1u);
  EXPECT_FALSE(writing.parent.has_value());
  EXPECT_EQ((*j)->Read(3, 5).state, SlotRecordState::kEmpty);
  EXPECT_EQ((*j)->Read(0, 0).state, SlotRecordState::kEmpty);
}

// A crash between a record's field stores and its checksum leaves a record that fails it.
TEST(SlotJournalTest, ARecordChangedAfterItsChecksumIsTorn) {
  Memory m(*SlotJournal::Bytes(Geometry()));
  auto j = SlotJournal::Format(Geometry(), m.span());
  ASSERT_TRUE(j.ok());
  (*j)->MarkWriting({0, 0, 1}, 1, 1, 0, Key(1), std::nullopt);
  (*j)->MarkCommitted({0, 0, 1}, 64, 5);
  const uint64_t at = SlotJournal::kHeaderBytes + SlotJournal::kNamespaceLogBytes +
                      1 * SlotJournal::kRecordBytes;
  m.p[at + 40] ^= 1;  // A key byte.
  EXPECT_EQ((*j)->Read(0, 1).state, SlotRecordState::kTorn);
  (*j)->ClearAt(0, 1);
  EXPECT_EQ((*j)->Read(0, 1).state, SlotRecordState::kEmpty);
}

TEST(SlotJournalTest, AnotherGeometryOrVersionIsRefusedNamingWhatChanged) {
  Memory m(*SlotJournal::Bytes(Geometry()) * 2);
  ASSERT_TRUE(SlotJournal::Format(Geometry(), m.span()).ok());

  SlotJournalGeometry g = Geometry();
  g.capacity_bytes += kRegion;
  g.region_count += 1;
  auto bigger = SlotJournal::Attach(g, m.span());
  ASSERT_FALSE(bigger.ok());
  EXPECT_EQ(bigger.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(bigger.status().message(), HasSubstr("pool.capacity"));

  g = Geometry();
  g.slot_sizes = {64 << 10, 128 << 10};
  auto classes = SlotJournal::Attach(g, m.span());
  ASSERT_FALSE(classes.ok());
  EXPECT_THAT(classes.status().message(), HasSubstr("pool.slot_sizes"));

  m.p[8] = 99;  // Format version.
  auto version = SlotJournal::Attach(Geometry(), m.span());
  ASSERT_FALSE(version.ok());
  EXPECT_THAT(version.status().message(), HasSubstr("format version 99"));

  std::memset(m.p, 0, 64);
  auto blank = SlotJournal::Attach(Geometry(), m.span());
  ASSERT_FALSE(blank.ok());
  EXPECT_THAT(blank.status().message(), HasSubstr("never formatted"));
}

TEST(SlotJournalTest, NamespaceLogKeepsSpecsAndTheLastGeometryById) {
  Memory m(*SlotJournal::Bytes(Geometry()));
  {
    auto j = SlotJournal::Format(Geometry(), m.span());
    ASSERT_TRUE(j.ok());
    ASSERT_TRUE((*j)->AppendNamespace(1, Spec("model-a")).ok());
    NamespaceSpec mla = Spec("model-b");
    mla.layout = LayoutKind::kMla;
    mla.opaque_keys = true;
    mla.tenant = "";
    ASSERT_TRUE((*j)->AppendNamespace(2, mla).ok());
    NamespaceSpec hybrid = Spec("model-c");
    hybrid.groups = {{GroupKind::kFull, 0}, {GroupKind::kWindow, 128}, {GroupKind::kState, 0}};
    ASSERT_TRUE((*j)->AppendNamespace(3, hybrid).ok());
    std::vector<std::pair<uint64_t, uint64_t>> first(80, {32768, 32768});
    ASSERT_TRUE((*j)->AppendGeometry(1, 1, first).ok());
    std::vector<std::pair<uint64_t, uint64_t>> refixed = {{1, 2}, {1, 2}, {3, 0}, {1, 2}};
    ASSERT_TRUE((*j)->AppendGeometry(1, 2, refixed).ok());
  }
  auto j = SlotJournal::Attach(Geometry(), m.span());
  ASSERT_TRUE(j.ok());
  const std::vector<JournalNamespace> ns = (*j)->Namespaces();
  ASSERT_EQ(ns.size(), 3u);
  EXPECT_EQ(ns[0].id, 1u);
  EXPECT_EQ(ns[0].spec.model_id, "model-a");
  EXPECT_EQ(ns[0].spec.tp_size, 2u);
  EXPECT_EQ(ns[0].spec.Digest(), Spec("model-a").Digest());
  ASSERT_TRUE(ns[0].buffers.has_value());
  EXPECT_EQ(*ns[0].buffers,
            (std::vector<std::pair<uint64_t, uint64_t>>{{1, 2}, {1, 2}, {3, 0}, {1, 2}}));
  EXPECT_EQ(ns[0].geometry_epoch, 2u);
  EXPECT_EQ(ns[1].id, 2u);
  EXPECT_EQ(ns[1].spec.layout, LayoutKind::kMla);
  EXPECT_TRUE(ns[1].spec.opaque_keys);
  EXPECT_EQ(ns[1].spec.tenant, "");
  EXPECT_FALSE(ns[1].buffers.has_value());
  // A hybrid's groups come back, so the restarted daemon recreates the same namespace.
  EXPECT_EQ(ns[2].spec.groups.size(), 3u);
  EXPECT_EQ(ns[2].spec.groups[1].window_tokens, 128u);
  EXPECT_TRUE(ns[2].spec.Hybrid());
  NamespaceSpec hybrid = Spec("model-c");
  hybrid.groups = {{GroupKind::kFull, 0}, {GroupKind::kWindow, 128}, {GroupKind::kState, 0}};
  EXPECT_EQ(ns[2].spec.Digest(), hybrid.Digest());
}

TEST(SlotJournalTest, ADamagedEntryIsSkippedAndAFullLogRefusesAppends) {
  Memory m(*SlotJournal::Bytes(Geometry()));
  auto j = SlotJournal::Format(Geometry(), m.span());
  ASSERT_TRUE(j.ok());
  ASSERT_TRUE((*j)->AppendNamespace(1, Spec("model-a")).ok());
  ASSERT_TRUE((*j)->AppendNamespace(2, Spec("model-b")).ok());
  // A byte of the first entry's payload (its tenant string).
  m.p[SlotJournal::kHeaderBytes + 16 + 4] ^= 0xff;
  std::vector<JournalNamespace> ns = (*j)->Namespaces();
  ASSERT_EQ(ns.size(), 2u);
  EXPECT_EQ(ns[0].id, 0u);  // Lost: a gap, which recovery stops at.
  EXPECT_EQ(ns[1].spec.model_id, "model-b");

  NamespaceSpec big = Spec(std::string(1000, 'm'));
  big.tenant = std::string(1000, 't');
  big.model_revision = std::string(1000, 'r');
  absl::Status s;
  uint32_t id = 3;
  while ((s = (*j)->AppendNamespace(id, big)).ok()) ++id;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("will not survive a restart"));
  EXPECT_GT(id, 300u);
  EXPECT_EQ((*j)->Namespaces().size(), id - 1);
}

// Deferred sealing: LANDED until the checksum is stored; a slot freed (and reused) since it
// landed is not sealed; Clear of a slot being sealed waits for EndSeal.
TEST(SlotJournalTest, LandedRecordsAreSealedOnlyIfStillTheirs) {
  Memory m(*SlotJournal::Bytes(Geometry()));
  auto j = SlotJournal::Format(Geometry(), m.span());
  ASSERT_TRUE(j.ok());
  SlotJournal& journal = **j;
  const SlotRef slot{0, 2, 7};
  journal.MarkWriting(slot, 1, 1, 0, Key(3), Key(2));
  EXPECT_EQ(journal.MarkLanded(slot, 4096), Key(3));
  SlotRecord r = journal.Read(2, 7);
  EXPECT_EQ(r.state, SlotRecordState::kLanded);
  EXPECT_EQ(r.length, 4096u);
  EXPECT_FALSE(journal.BeginSeal(slot, Key(4)));  // Another page's key: reused meanwhile.
  ASSERT_TRUE(journal.BeginSeal(slot, Key(3)));
  journal.EndSeal(slot, 0xabcd);
  r = journal.Read(2, 7);
  EXPECT_EQ(r.state, SlotRecordState::kCommitted);
  EXPECT_EQ(r.payload_crc, 0xabcdu);
  EXPECT_EQ(*r.parent, Key(2));
  EXPECT_FALSE(journal.BeginSeal(slot, Key(3)));  // Committed already.

  // Clear waits while the slot is being sealed.
  const SlotRef other{0, 1, 1};
  journal.MarkWriting(other, 1, 1, 0, Key(5), std::nullopt);
  journal.MarkLanded(other, 64);
  ASSERT_TRUE(journal.BeginSeal(other, Key(5)));
  std::atomic<bool> cleared{false};
  std::thread freer([&] {
    journal.Clear(other);
    cleared = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(cleared.load());
  journal.EndSeal(other, 1);
  freer.join();
  EXPECT_TRUE(cleared.load());
  EXPECT_EQ(journal.Read(1, 1).state, SlotRecordState::kEmpty);
}

}  // namespace
}  // namespace kvcellar::core
