#include "client/tools/bench/engine_group.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcellar::bench {
namespace {

namespace kc = ::kvcellar::client;

// Blocks about to be loaded are set to this first, so a page the daemon claims to have loaded
// but did not write shows up as mismatched bytes.
constexpr uint8_t kStaleByte = 0xEE;

// Times one call into the stats.
class Timer {
 public:
  Timer(Stats* stats, Timed what) : stats_(stats), what_(what), start_(absl::Now()) {}
  ~Timer() { stats_->Record(what_, absl::Now() - start_); }

 private:
  Stats* stats_;
  Timed what_;
  absl::Time start_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineGroup>> EngineGroup::Create(EngineGroupOptions options,
                                                                 Stats* stats) {
  std::unique_ptr<EngineGroup> g(new EngineGroup(std::move(options), stats));
  const EngineGroupOptions& o = g->options_;
  const ModelShape& shape = o.shape;
  g->ns_.tenant = o.tenant;
  g->ns_.model_id = o.model_id;
  g->ns_.model_revision = o.revision;
  g->ns_.kv_dtype = shape.dtype;
  g->ns_.page_size = shape.page_size;
  g->ns_.layout = shape.mla() ? core::LayoutKind::kMla : core::LayoutKind::kMha;
  g->ns_.tp_size = shape.tp;
  if (absl::Status s = g->ns_.Validate(); !s.ok()) return s;

  kc::ClientOptions co;
  co.addr = o.addr;
  co.rpc_timeout = o.rpc_timeout;
  co.register_timeout = std::max(o.rpc_timeout, absl::Seconds(2));
  absl::StatusOr<std::unique_ptr<kc::Client>> client = kc::Client::Connect(co);
  if (!client.ok()) return client.status();
  g->client_ = *std::move(client);

  for (uint32_t r = 0; r < shape.tp; ++r) {
    Rank rank;
    kc::SimEngineOptions so;
    so.num_layers = shape.layers;
    so.mla = shape.mla();
    so.bytes_per_block = shape.BlockBytes();
    so.num_blocks = o.num_blocks;
    // Loads complete through WaitOps and Backups are submitted after the blocks are written, so
    // no completion channel is needed.
    so.load_slots = so.ready_slots = 0;
    absl::StatusOr<std::unique_ptr<kc::SimEngine>> sim = kc::SimEngine::Create(so);
    if (!sim.ok()) {
      return absl::Status(sim.status().code(),
                          absl::StrCat("rank ", r, " sim memory: ", sim.status().message()));
    }
    rank.sim = *std::move(sim);
    kc::EngineRegistration reg;
    reg.instance_id = o.instance_id;
    reg.rank = r;
    reg.ns = g->ns_;
    reg.engine_name = "kvcellar-bench";
    // One simulated device per rank: pid and rank make the 16-byte UUID.
    reg.device_uuid = std::string(16, '\0');
    const uint64_t pid = static_cast<uint64_t>(getpid());
    for (int i = 0; i < 8; ++i) reg.device_uuid[i] = static_cast<char>(pid >> (8 * i));
    reg.device_uuid[8] = static_cast<char>(r);
    rank.sim->Describe(&reg);
    absl::StatusOr<std::unique_ptr<kc::Session>> session = g->client_->Register(reg);
    if (!session.ok()) {
      return absl::Status(session.status().code(),
                          absl::StrCat("rank ", r, " registration: ", session.status().message()));
    }
    rank.session = *std::move(session);
    if (!rank.session->WaitUntilActive(o.register_wait)) {
      return absl::UnavailableError(
          absl::StrCat("cannot reach kvcellard at ", o.addr, ": rank ", r, " not registered after ",
                       absl::FormatDuration(o.register_wait), " (session ",
                       kc::SessionStateName(rank.session->state()), ")"));
    }
    const kc::SessionInfo info = rank.session->info();
    if (info.page_object_bytes != shape.ObjectBytes()) {
      return absl::InternalError(absl::StrCat("the daemon sizes page objects at ",
                                              info.page_object_bytes, " bytes, the bench at ",
                                              shape.ObjectBytes()));
    }
    rank.shard = info.shard_index;
    rank.writer = !shape.mla() || info.is_shard_writer;
    g->ranks_.push_back(std::move(rank));
  }
  return g;
}

EngineGroup::~EngineGroup() { Close(); }

void EngineGroup::Close() {
  for (Rank& r : ranks_) {
    if (r.session) r.session->Close(absl::Seconds(2));
  }
}

std::vector<std::string> EngineGroup::l3_tier_names() const {
  return ranks_.empty() ? std::vector<std::string>{} : ranks_[0].session->info().l3_tier_names;
}

kc::OpResult EngineGroup::Wait(kc::Session& session, kc::OpResult op) {
  const absl::Time deadline = absl::Now() + options_.op_timeout;
  while (!op.terminal() && absl::Now() < deadline) {
    kc::WaitOptions w;
    w.timeout = std::min(absl::Seconds(1), deadline - absl::Now());
    w.omit_page_status = op.kind == kc::OpKind::kLoad;  // Loads need leading_ok_pages only.
    {
      Timer t(stats_, Timed::kWaitOps);
      op = session.WaitOps({op.ref}, w)[0];
    }
    if (!op.terminal() && !op.status.ok()) absl::SleepFor(absl::Milliseconds(20));
  }
  return op;
}

// One request's pages on their way through Run's phases.
struct EngineGroup::Request {
  std::vector<core::PageKey> keys;
  std::vector<uint32_t> blocks;  // The device block of each page.
  uint32_t pages = 0;
  RequestResult out;
  bool quarantine = false;  // An op did not end in time: its blocks are not reused.
};

absl::StatusOr<RequestResult> EngineGroup::Run(uint64_t step_id, absl::Span<const uint32_t> tokens,
                                               uint64_t prompt_tokens) {
  Request req;
  req.out.prompt_tokens = prompt_tokens;
  req.keys = kc::ComputePageKeys(ns_, tokens);
  req.pages = static_cast<uint32_t>(req.keys.size());
  absl::StatusOr<std::vector<uint32_t>> acquired = blocks_.Acquire(req.pages);
  if (!acquired.ok()) return acquired.status();
  req.blocks = *std::move(acquired);
  const Timer request_timer(stats_, Timed::kRequest);

  const uint32_t prompt_pages = static_cast<uint32_t>(prompt_tokens / options_.shape.page_size);
  uint64_t pin_id = 0;
  const uint32_t hit = MatchGroup(step_id, prompt_pages, req, &pin_id);
  const uint32_t usable = LoadAndVerify(hit, pin_id, req);
  req.out.loaded_tokens = uint64_t{usable} * options_.shape.page_size;
  if (usable < req.pages) PrefillAndBackup(usable, req);

  // The pin is no longer needed once every rank loaded and the new pages hang below the hit.
  if (pin_id != 0) {
    Timer t(stats_, Timed::kRelease);
    ranks_[0].session->Release({pin_id});
  }
  if (req.quarantine) {
    blocks_.Quarantine(req.blocks);
  } else {
    blocks_.Release(req.blocks);
  }
  return std::move(req.out);
}

uint32_t EngineGroup::MatchGroup(uint64_t step_id, uint32_t prompt_pages, Request& req,
                                 uint64_t* pin_id) {
  const uint32_t p = options_.shape.page_size;
  RequestResult& out = req.out;
  // Match on every rank with one step id: the daemon answers the group once (the rest memoized).
  kc::MatchSequence ms;
  ms.keys = absl::MakeConstSpan(req.keys).subspan(0, prompt_pages);
  kc::MatchOptions mo;
  mo.pin = true;
  mo.step_id = step_id;
  mo.prefetch_policy =
      l3_tier_names().empty() ? kc::PrefetchPolicy::kNone : kc::PrefetchPolicy::kWaitComplete;
  std::vector<kc::MatchReply> replies;
  replies.reserve(ranks_.size());
  for (Rank& r : ranks_) {
    Timer t(stats_, Timed::kMatch);
    replies.push_back(r.session->Match({ms}, mo));
  }
  uint32_t l2 = prompt_pages;
  uint32_t l3 = prompt_pages;
  for (const kc::MatchReply& m : replies) {
    if (!m.status.ok()) ++out.degraded_calls;
    l2 = std::min(l2, m.results[0].l2_hit_pages);
    l3 = std::min(l3, m.results[0].l3_hit_pages);
  }
  const kc::MatchResult& first = replies[0].results[0];
  *pin_id = first.pin_id;
  out.l2_hit_tokens = uint64_t{l2} * p;
  out.l3_hit_tokens_by_tier.assign(l3_tier_names().size(), 0);
  for (size_t i = 0; i < first.l3_hit_pages_by_tier.size() && i < out.l3_hit_tokens_by_tier.size();
       ++i) {
    out.l3_hit_tokens_by_tier[i] = uint64_t{first.l3_hit_pages_by_tier[i]} * p;
  }

  // An L3 hit: the daemon prefetches it into L2 under rank 0's Match; the pin grows over the
  // pages as they land, and the engine loads the prefix that did.
  uint32_t hit = l2;
  if (l3 > 0 && replies[0].prefetch_op.op_id != 0) {
    kc::OpResult pf;
    pf.ref = replies[0].prefetch_op;
    pf.kind = kc::OpKind::kPrefetch;
    pf.state = kc::OpState::kPending;
    pf = Wait(*ranks_[0].session, pf);
    hit += std::min(l3, pf.usable_pages(0));
  }
  return hit;
}

uint32_t EngineGroup::LoadAndVerify(uint32_t hit, uint64_t pin_id, Request& req) {
  if (hit == 0) return 0;
  RequestResult& out = req.out;
  const uint64_t object_bytes = options_.shape.ObjectBytes();
  // Load the hit on every rank (the copies of all ranks overlap), then wait and verify.
  uint32_t usable = hit;
  std::vector<kc::OpResult> loads;
  for (Rank& r : ranks_) {
    for (uint32_t i = 0; i < hit; ++i) r.sim->ClearBlock(req.blocks[i], kStaleByte);
    kc::LoadSequence ls;
    ls.keys = absl::MakeConstSpan(req.keys).subspan(0, hit);
    ls.blocks = absl::MakeConstSpan(req.blocks).subspan(0, hit);
    ls.pin_id = pin_id;
    Timer t(stats_, Timed::kLoad);
    loads.push_back(r.session->Load({ls}));
    if (!loads.back().status.ok()) ++out.degraded_calls;
  }
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    const absl::Time start = absl::Now();
    const kc::OpResult done = Wait(*r.session, loads[i]);
    stats_->Record(Timed::kLoadOp, absl::Now() - start);
    if (!done.terminal()) req.quarantine = true;
    if (!done.done()) ++out.loads_not_done;
    const uint32_t ok = std::min(hit, done.usable_pages(0));
    usable = std::min(usable, ok);
    // Every page the daemon says it loaded is checked, byte for byte.
    for (uint32_t k = 0; k < ok; ++k) {
      std::string why;
      const uint64_t bad =
          r.sim->CountMismatches(req.blocks[k], options_.kv_seed, req.keys[k], r.shard, &why);
      if (bad > 0 && out.first_mismatch.empty()) {
        out.first_mismatch =
            absl::StrCat("rank ", i, " page ", k, " key ", req.keys[k].Hex(), ": ", why);
      }
      out.mismatched_bytes += bad;
    }
    out.verified_bytes += uint64_t{ok} * object_bytes;
    out.load_bytes += uint64_t{ok} * object_bytes;
  }
  return usable;
}

void EngineGroup::PrefillAndBackup(uint32_t usable, Request& req) {
  // "Prefill" what was not loaded and back up every new full page.
  RequestResult& out = req.out;
  const uint32_t pages = req.pages;
  const uint64_t object_bytes = options_.shape.ObjectBytes();
  std::vector<std::pair<Rank*, kc::OpResult>> backups;
  kc::BackupSequence bs;
  bs.has_parent = usable > 0;
  if (bs.has_parent) bs.parent = req.keys[usable - 1];
  bs.keys = absl::MakeConstSpan(req.keys).subspan(usable);
  bs.blocks = absl::MakeConstSpan(req.blocks).subspan(usable);
  for (Rank& r : ranks_) {
    if (!r.writer) continue;  // MLA: other ranks hold the same latent; one copy is stored.
    for (uint32_t k = usable; k < pages; ++k) {
      r.sim->FillBlock(req.blocks[k], options_.kv_seed, req.keys[k], r.shard);
    }
    Timer t(stats_, Timed::kBackup);
    backups.emplace_back(&r, r.session->Backup({bs}));
    if (!backups.back().second.status.ok()) ++out.degraded_calls;
    out.backup_pages += pages - usable;
  }
  for (auto& [rank, op] : backups) {
    const absl::Time start = absl::Now();
    const kc::OpResult done = Wait(*rank->session, op);
    stats_->Record(Timed::kBackupOp, absl::Now() - start);
    if (!done.terminal()) req.quarantine = true;
    if (!done.done()) ++out.backups_not_done;
    uint64_t stored = 0;
    if (!done.sequences.empty() && !done.sequences[0].page_status.empty()) {
      for (kc::PageStatus s : done.sequences[0].page_status) {
        ++out.backup_status[kc::PageStatusName(s)];
        if (s == kc::PageStatus::kOk) ++stored;
      }
    } else {
      out.backup_status[done.terminal() ? kc::OpStateName(done.state) : "UNKNOWN"] +=
          pages - usable;
    }
    out.backup_bytes += stored * object_bytes;
  }
}

}  // namespace kvcellar::bench
