#include "server/datapath/sim_signal_pump.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace kvcellar::server {
namespace {

// The sim device's own fence poller checks every 20 us (gpu/sim_device.h); a layer of a large
// batch copies in tens of microseconds, so polling faster buys nothing.
constexpr absl::Duration kMinPoll = absl::Microseconds(20);
// While nothing moves (a Backup whose engine has not published its ready word yet), back off to
// this, so a stalled engine costs ~1000 wakeups/s rather than 50000.
constexpr absl::Duration kMaxPoll = absl::Milliseconds(1);

}  // namespace

// The DeviceOp a gated Backup holds: finishes when the gather it submits finishes, or at once
// when cancelled before the ready word fired (then the gather is never submitted).
class SimSignalPump::Gated final : public gpu::DeviceOp {
 public:
  Gated(uint32_t num_layers, std::function<absl::StatusOr<gpu::OpHandle>()> submit)
      : DeviceOp(Kind::kGather, num_layers), submit_(std::move(submit)) {}

  // Called by the pump under its mutex. Returns whether anything moved.
  bool Step(const SimCounterChannel& channel, uint32_t slot, uint64_t token, bool* drop) {
    gpu::OpHandle inner;
    {
      absl::MutexLock lock(&mu_);
      if (inner_ == nullptr) {
        if (cancelled_) {
          *drop = true;  // Finished itself in OnCancel.
          return false;
        }
        if (channel.ready_word(slot) < token) return false;
        // The acquire load above orders the engine's writes before the gather's reads.
        absl::StatusOr<gpu::OpHandle> op = submit_();
        submit_ = nullptr;
        if (!op.ok()) {
          *drop = true;
          Finish(op.status());
          return true;
        }
        inner_ = *std::move(op);
      }
      inner = inner_;
    }
    if (!inner->Poll()) return false;
    Finish(inner->status());
    *drop = true;
    return true;
  }

 protected:
  void Probe() override {
    gpu::OpHandle inner;
    {
      absl::MutexLock lock(&mu_);
      inner = inner_;
    }
    if (inner != nullptr && inner->Poll()) Finish(inner->status());
  }
  void OnCancel() override {
    gpu::OpHandle inner;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      inner = inner_;
    }
    if (inner != nullptr) {
      inner->Cancel();  // Finishes (CANCELLED, or OK if it already copied) through Probe/Step.
    } else {
      Finish(absl::CancelledError("cancelled before the ready signal fired"));
    }
  }

 private:
  absl::Mutex mu_;
  std::function<absl::StatusOr<gpu::OpHandle>()> submit_ ABSL_GUARDED_BY(mu_);
  gpu::OpHandle inner_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

SimSignalPump::SimSignalPump() {
  thread_ = std::thread([this] { Run(); });
}

SimSignalPump::~SimSignalPump() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SimSignalPump::WatchLoad(uint64_t op_id, gpu::OpHandle op,
                              std::shared_ptr<SimCounterChannel> channel, uint32_t slot) {
  absl::MutexLock lock(&mu_);
  LoadWatch& w = loads_[op_id];
  w.op = std::move(op);
  w.channel = std::move(channel);
  w.slot = slot;
  woken_ = true;
}

void SimSignalPump::FinishLoad(uint64_t op_id, bool failed) {
  absl::MutexLock lock(&mu_);
  auto it = loads_.find(op_id);
  if (it == loads_.end()) return;
  LoadWatch& w = it->second;
  w.channel->EndOp(w.slot, op_id, failed, w.next_layer);
  loads_.erase(it);
}

gpu::OpHandle SimSignalPump::GatedGather(std::function<absl::StatusOr<gpu::OpHandle>()> submit,
                                         std::shared_ptr<SimCounterChannel> channel, uint32_t slot,
                                         uint64_t token, uint32_t num_layers) {
  auto op = std::make_shared<Gated>(num_layers, std::move(submit));
  absl::MutexLock lock(&mu_);
  gates_.push_back({op, std::move(channel), slot, token});
  woken_ = true;
  return op;
}

bool SimSignalPump::PollLocked() {
  bool moved = false;
  for (auto& [op_id, w] : loads_) {
    if (w.op == nullptr) continue;
    // Layers land in order; the device's release store of the count follows their bytes.
    const uint32_t landed = std::min(w.op->layers_done(), w.channel->num_layers());
    for (; w.next_layer < landed; ++w.next_layer) {
      w.channel->SignalLayer(w.slot, w.next_layer, op_id);
      moved = true;
    }
  }
  auto keep = gates_.begin();
  for (auto it = gates_.begin(); it != gates_.end(); ++it) {
    bool drop = false;
    moved = it->op->Step(*it->channel, it->slot, it->token, &drop) || moved;
    if (!drop) *keep++ = std::move(*it);
  }
  gates_.erase(keep, gates_.end());
  return moved;
}

void SimSignalPump::Run() {
  absl::Duration interval = kMinPoll;
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (stop_) return;
    woken_ = false;
    const bool moved = PollLocked();
    interval = moved ? kMinPoll : std::min(kMaxPoll, interval * 2);
    auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || woken_; };
    if (loads_.empty() && gates_.empty()) {
      mu_.Await(absl::Condition(&wake));
      interval = kMinPoll;
    } else {
      // A new op resets the backoff: its layers start landing right away.
      if (mu_.AwaitWithTimeout(absl::Condition(&wake), interval)) interval = kMinPoll;
    }
  }
}

}  // namespace kvcellar::server
