#include "server/l2/l2_sealer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "core/crc32c.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// Nice value of the sealer thread: the copies of the data path come first; the sealer takes the
// CPU they leave.
constexpr int kSealerNice = 10;

}  // namespace

L2Sealer::L2Sealer(core::HostPool* pool, core::SlotJournal* journal)
    : pool_(pool), journal_(journal), thread_([this] { Run(); }) {}

L2Sealer::~L2Sealer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  Sweep();
}

void L2Sealer::Enqueue(core::SlotRef slot, const core::PageKey& key, uint64_t length) {
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= kMaxPending) {
    overflowed_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  queue_.push_back({slot, key, length});
}

uint64_t L2Sealer::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool L2Sealer::Seal(const Item& item) {
  if (!journal_->BeginSeal(item.slot, item.key)) return false;
  journal_->EndSeal(item.slot, core::Crc32c(pool_->Address(item.slot), item.length));
  sealed_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void L2Sealer::Run() {
  // Per thread on Linux: PRIO_PROCESS with a thread id sets that thread's nice value.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kSealerNice);
  for (;;) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](L2Sealer* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return s->stopping_ || !s->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // Stopping, and everything queued is sealed.
      item = queue_.front();
      queue_.pop_front();
    }
    Seal(item);
  }
}

void L2Sealer::Sweep() {
  uint64_t swept = 0;
  std::vector<core::OwnedSlot> slots;
  for (const core::RegionInfo& r : pool_->RegionInfos()) {
    slots.clear();
    if (!pool_->RegionSlots(r.region, r.size_class, &slots).ok()) continue;
    for (const core::OwnedSlot& s : slots) {
      const core::SlotRecord rec = journal_->Read(s.slot.region, s.slot.index);
      if (rec.state != core::SlotRecordState::kLanded) continue;
      if (Seal({s.slot, rec.key, rec.length})) ++swept;
    }
  }
  if (swept > 0 || overflowed() > 0) {
    KVLOG(Info, "l2 journal swept at shutdown",
          {{"sealed", swept}, {"overflowed_since_start", overflowed()}});
  }
}

}  // namespace kvcellar::server
