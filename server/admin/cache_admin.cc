#include "server/admin/cache_admin.h"

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/admin/admin_scope.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

using NamespaceList = std::vector<std::shared_ptr<Namespace>>;

v1::NamespaceSpec ToProto(const core::NamespaceSpec& s) {
  v1::NamespaceSpec out;
  out.set_tenant(s.tenant);
  out.set_model_id(s.model_id);
  out.set_model_revision(s.model_revision);
  out.set_kv_dtype(s.kv_dtype);
  out.set_page_size_tokens(s.page_size);
  out.set_layout_kind(s.layout == core::LayoutKind::kMla ? v1::LAYOUT_KIND_MLA
                                                         : v1::LAYOUT_KIND_MHA_GQA);
  out.set_tp_size(s.tp_size);
  out.set_opaque_keys(s.opaque_keys);
  if (s.Hybrid()) {
    for (const core::KvGroup& g : s.groups) {
      v1::KvGroup* pg = out.add_groups();
      // KvGroupKind numbers are the canonical encoding's plus one (common.proto).
      pg->set_kind(static_cast<v1::KvGroupKind>(static_cast<int>(g.kind) + 1));
      pg->set_sliding_window_tokens(g.window_tokens);
    }
  }
  return out;
}

std::string DigestBytes(const Namespace& ns) { return std::string(ns.digest().AsBytes()); }

// The namespaces `scope` selects, ordered by tenant, then model id (then digest, for a total
// order).
NamespaceList Select(const NamespaceRegistry& registry, const AdminScope& scope) {
  NamespaceList out;
  for (std::shared_ptr<Namespace>& ns : registry.Snapshot()) {
    if (scope.Selects(*ns)) out.push_back(std::move(ns));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return std::tie(a->spec().tenant, a->spec().model_id, a->digest()) <
           std::tie(b->spec().tenant, b->spec().model_id, b->digest());
  });
  return out;
}

v1::TierUsage* AddUsage(google::protobuf::RepeatedPtrField<v1::TierUsage>* out, v1::Tier tier,
                        const std::string& backend = "") {
  v1::TierUsage* u = out->Add();
  u->set_tier(tier);
  u->set_l3_backend(backend);
  return u;
}

// Adds per-backend L3 usage into `out`, one entry per backend (merged across namespaces).
void MergeL3(const std::vector<L3BackendUsage>& usage,
             google::protobuf::RepeatedPtrField<v1::TierUsage>* out) {
  for (const L3BackendUsage& b : usage) {
    v1::TierUsage* entry = nullptr;
    for (v1::TierUsage& u : *out) {
      if (u.tier() == v1::TIER_L3 && u.l3_backend() == b.backend) entry = &u;
    }
    if (entry == nullptr) entry = AddUsage(out, v1::TIER_L3, b.backend);
    entry->set_objects(entry->objects() + b.objects);
    entry->set_pages(entry->pages() + b.pages);
    entry->set_bytes(entry->bytes() + b.bytes);
  }
}

L3Scope ToL3Scope(const Namespace& ns, const AdminScope& scope, const AdminTiers& tiers) {
  return L3Scope{ns.digest(), scope.subtree_root, tiers.l3_backends};
}

std::vector<std::string> KnownBackends(const L3Admin* l3) {
  return l3 != nullptr ? l3->Backends() : std::vector<std::string>();
}

// The scope and tiers of an Evict or Clear, validated (errors name the field).
struct ScopedRequest {
  AdminScope scope;
  AdminTiers tiers;
};
template <typename Request>
absl::StatusOr<ScopedRequest> ParseScoped(const Request& request, const L3Admin* l3) {
  absl::StatusOr<AdminScope> scope = ParseScope(request.scope(), "scope");
  if (!scope.ok()) return scope.status();
  absl::StatusOr<AdminTiers> tiers =
      ParseTiers(request.tiers(), request.l3_backends(), KnownBackends(l3));
  if (!tiers.ok()) return tiers.status();
  return ScopedRequest{*std::move(scope), *std::move(tiers)};
}

void FillOps(v1::OpKind kind, const std::array<uint64_t, 3>& outcomes,
             const std::array<uint64_t, v1::PageStatus_ARRAYSIZE>& pages, v1::OpCounters* out) {
  out->set_kind(kind);
  // Ops are counted when they end, so "submitted" is the ops that ended (in-flight ones are not
  // in any counter yet).
  out->set_submitted(outcomes[0] + outcomes[1] + outcomes[2]);
  out->set_done(outcomes[0]);
  out->set_failed(outcomes[1]);
  out->set_cancelled(outcomes[2]);
  for (uint64_t p : pages) out->add_pages_by_status(p);
}

}  // namespace

CacheAdmin::CacheAdmin(NamespaceRegistry* namespaces, SessionRegistry* sessions, PinTable* pins,
                       L2Space* l2, CacheMetrics* metrics, absl::Time start_time)
    : namespaces_(namespaces),
      sessions_(sessions),
      pins_(pins),
      l2_(l2),
      metrics_(metrics),
      start_time_(start_time) {}

absl::Status CacheAdmin::ListEngines(const v1::ListEnginesRequest& request,
                                     v1::ListEnginesResponse* response) const {
  absl::StatusOr<std::optional<core::PageKey>> ns =
      ParseOptionalKey(request.ns_digest(), "ns_digest");
  if (!ns.ok()) return ns.status();
  std::vector<std::shared_ptr<Session>> sessions = sessions_->Snapshot();
  std::sort(sessions.begin(), sessions.end(), [](const auto& a, const auto& b) {
    const SessionInfo& x = a->info();
    const SessionInfo& y = b->info();
    return std::tie(x.instance_id, x.role, x.rank, x.id) <
           std::tie(y.instance_id, y.role, y.rank, y.id);
  });
  const absl::flat_hash_map<uint64_t, PinTable::Usage> pins = pins_->UsageBySession();
  for (const std::shared_ptr<Session>& session : sessions) {
    const SessionInfo& info = session->info();
    if (!request.instance_id().empty() && info.instance_id != request.instance_id()) continue;
    if (ns->has_value() && info.ns->digest() != **ns) continue;
    if (request.has_tenant() && info.ns->spec().tenant != request.tenant().tenant()) continue;
    v1::EngineSession* out = response->add_sessions();
    out->set_session_id(info.id);
    out->set_instance_id(info.instance_id);
    out->set_rank(info.rank);
    out->set_role(info.role);
    *out->mutable_namespace_spec() = ToProto(info.ns->spec());
    out->set_ns_digest(DigestBytes(*info.ns));
    out->set_shard_index(info.shard);
    if (info.is_worker()) out->mutable_device()->set_kind(info.device_kind);
    out->set_pid(info.pid);
    out->set_engine_name(info.engine_name);
    out->set_client_version(info.client_version);
    // Who registered it, as the transport proved it (in-process test sessions have no peer).
    if (info.owner.kind != PeerIdentity::Kind::kInProcess) out->set_peer(info.owner.Describe());
    out->set_connected_since_unix_ms(absl::ToUnixMillis(info.registered));
    out->set_lease_deadline_unix_ms(absl::ToUnixMillis(session->lease_deadline()));
    out->set_ops_in_flight(session->inflight_ops());
    if (auto it = pins.find(info.id); it != pins.end()) {
      out->set_pins(it->second.pins);
      out->set_pinned_pages(it->second.pages);
    }
    if (info.is_worker()) {
      out->set_num_blocks(info.num_blocks);
      out->set_num_layers(info.num_layers);
    }
  }
  return absl::OkStatus();
}

absl::Status CacheAdmin::ListNamespaces(const v1::ListNamespacesRequest& request, L3Admin* l3,
                                        v1::ListNamespacesResponse* response) const {
  AdminScope scope;
  if (request.has_tenant()) scope.tenant = request.tenant().tenant();
  absl::flat_hash_map<const Namespace*, uint32_t> sessions;
  for (const std::shared_ptr<Session>& s : sessions_->Snapshot()) ++sessions[s->info().ns.get()];
  for (const std::shared_ptr<Namespace>& ns : Select(*namespaces_, scope)) {
    v1::NamespaceInfo* out = response->add_namespaces();
    out->set_ns_digest(DigestBytes(*ns));
    *out->mutable_spec() = ToProto(ns->spec());
    out->set_num_shards(ns->spec().ShardsPerPage());
    out->set_page_object_bytes(ns->object_bytes());
    if (auto it = sessions.find(ns.get()); it != sessions.end()) out->set_sessions(it->second);
    v1::TierUsage* l2 = AddUsage(out->mutable_tiers(), v1::TIER_L2);
    if (core::RadixIndex* index = ns->index(); index != nullptr) {
      const core::RadixIndexStats stats = index->Stats();
      l2->set_objects(stats.l2_objects);
      l2->set_pages(stats.l2_pages);
      l2->set_bytes(stats.l2_objects * ns->object_bytes());
    }
    if (l3 != nullptr) {
      absl::StatusOr<std::vector<L3BackendUsage>> usage =
          l3->Usage(L3Scope{ns->digest(), std::nullopt, {}});
      if (!usage.ok()) return usage.status();
      MergeL3(*usage, out->mutable_tiers());
    }
    const NamespaceCounters& c = ns->counters();
    const uint64_t lookups = NamespaceCounters::Get(c.lookup_pages);
    const uint64_t l2_hits = NamespaceCounters::Get(c.l2_hit_pages);
    const uint64_t l3_hits = NamespaceCounters::Get(c.l3_hit_pages);
    out->set_lookup_pages(lookups);
    out->set_l2_hit_pages(l2_hits);
    out->set_l3_hit_pages(l3_hits);
    out->set_hit_rate(lookups == 0 ? 0.0
                                   : static_cast<double>(l2_hits + l3_hits) /
                                         static_cast<double>(lookups));
    out->set_last_access_unix_ms(c.last_access_unix_ms.load(std::memory_order_relaxed));
  }
  return absl::OkStatus();
}

absl::Status CacheAdmin::GetStats(const v1::GetStatsRequest& request,
                                  v1::GetStatsResponse* response) const {
  absl::StatusOr<std::optional<core::PageKey>> only =
      ParseOptionalKey(request.ns_digest(), "ns_digest");
  if (!only.ok()) return only.status();
  const absl::Time now = absl::Now();
  response->set_captured_unix_ms(absl::ToUnixMillis(now));
  response->set_uptime_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(now - start_time_)));

  const CacheCountersSnapshot m = metrics_->Snapshot();
  v1::StatsCounters* totals = response->mutable_totals();
  v1::MatchCounters* match = totals->mutable_match();
  match->set_calls(m.match_requests);
  match->set_lookup_pages(m.l2_hit_pages + m.l2_miss_pages);
  match->set_lookup_tokens(m.l2_hit_tokens + m.l2_miss_tokens);
  match->set_l2_hit_pages(m.l2_hit_pages);
  match->set_l2_hit_tokens(m.l2_hit_tokens);
  match->set_l3_hit_pages(m.l3_hit_pages);
  match->set_l3_hit_tokens(m.l3_hit_tokens);
  // Without L3 tiers every L2 miss is a miss; with them, what no L3 tier held either.
  const bool has_l3 = m.l3_hit_pages + m.l3_miss_pages > 0;
  match->set_miss_pages(has_l3 ? m.l3_miss_pages : m.l2_miss_pages);
  match->set_miss_tokens(has_l3 ? m.l3_miss_tokens : m.l2_miss_tokens);
  FillOps(v1::OP_KIND_LOAD, m.ops[0], m.pages[0], totals->add_ops());
  FillOps(v1::OP_KIND_BACKUP, m.ops[1], m.pages[1], totals->add_ops());
  FillOps(v1::OP_KIND_PREFETCH, m.ops[2], m.pages[2], totals->add_ops());
  auto transfer = [&](v1::TransferDirection direction, uint64_t objects, uint64_t bytes) {
    v1::TransferCounters* t = totals->add_transfers();
    t->set_direction(direction);
    t->set_objects(objects);
    t->set_bytes(bytes);
  };
  // L2 -> L3 writes are counted in bytes; their objects are in kvcellar_l3_writes_total.
  transfer(v1::TRANSFER_DIRECTION_L3_TO_L2, m.pages[2][v1::PAGE_STATUS_OK], m.l3_to_l2_bytes);
  transfer(v1::TRANSFER_DIRECTION_L2_TO_L3, 0, m.l2_to_l3_bytes);
  transfer(v1::TRANSFER_DIRECTION_L2_TO_L1, m.pages[0][v1::PAGE_STATUS_OK], m.h2d_bytes);
  transfer(v1::TRANSFER_DIRECTION_L1_TO_L2, m.pages[1][v1::PAGE_STATUS_OK], m.d2h_bytes);
  totals->set_backup_dedup_pages(m.pages[1][v1::PAGE_STATUS_ALREADY_PRESENT] +
                                 m.pages[1][v1::PAGE_STATUS_IN_FLIGHT]);
  v1::SessionCounters* sessions = totals->mutable_sessions();
  sessions->set_expired(m.session_lease_expiries);
  sessions->set_pins_expired(m.pin_lease_expiries);
  sessions->set_pins_revoked(m.pins_revoked);

  // Namespaces live as long as the daemon, so the sum of theirs is the daemon-wide count.
  v1::TierCounters* l2_total = totals->add_tiers();
  l2_total->set_tier(v1::TIER_L2);
  l2_total->set_cleared_objects(m.cleared_objects);
  for (const std::shared_ptr<Namespace>& ns : Select(*namespaces_, AdminScope{})) {
    const NamespaceCounters& c = ns->counters();
    l2_total->set_evicted_objects(l2_total->evicted_objects() +
                                  NamespaceCounters::Get(c.evicted_objects));
    l2_total->set_evicted_bytes(l2_total->evicted_bytes() +
                                NamespaceCounters::Get(c.evicted_bytes));
    if (!request.per_namespace()) continue;
    if (only->has_value() && ns->digest() != **only) continue;
    v1::NamespaceStats* out = response->add_namespaces();
    out->set_ns_digest(DigestBytes(*ns));
    out->set_tenant(ns->spec().tenant);
    out->set_model_id(ns->spec().model_id);
    v1::StatsCounters* counters = out->mutable_counters();
    const uint64_t page = ns->spec().page_size;
    const uint64_t lookups = NamespaceCounters::Get(c.lookup_pages);
    const uint64_t hits = NamespaceCounters::Get(c.l2_hit_pages);
    const uint64_t l3_hits = NamespaceCounters::Get(c.l3_hit_pages);
    v1::MatchCounters* nm = counters->mutable_match();
    nm->set_calls(NamespaceCounters::Get(c.match_calls));
    nm->set_sequences(NamespaceCounters::Get(c.match_sequences));
    nm->set_lookup_pages(lookups);
    nm->set_lookup_tokens(lookups * page);
    nm->set_l2_hit_pages(hits);
    nm->set_l2_hit_tokens(hits * page);
    nm->set_l3_hit_pages(l3_hits);
    nm->set_l3_hit_tokens(l3_hits * page);
    nm->set_miss_pages(lookups - hits - l3_hits);
    nm->set_miss_tokens((lookups - hits - l3_hits) * page);
    v1::TierCounters* tier = counters->add_tiers();
    tier->set_tier(v1::TIER_L2);
    tier->set_evicted_objects(NamespaceCounters::Get(c.evicted_objects));
    tier->set_evicted_bytes(NamespaceCounters::Get(c.evicted_bytes));
    tier->set_cleared_objects(NamespaceCounters::Get(c.cleared_objects));
  }
  return absl::OkStatus();
}

absl::Status CacheAdmin::Evict(const v1::EvictRequest& request, L3Admin* l3,
                               v1::EvictResponse* response) {
  absl::StatusOr<ScopedRequest> parsed = ParseScoped(request, l3);
  if (!parsed.ok()) return parsed.status();
  const AdminScope* scope = &parsed->scope;
  const AdminTiers* tiers = &parsed->tiers;
  response->set_dry_run(request.dry_run());
  const uint64_t target = request.target_bytes();
  uint64_t freed = 0;
  const auto reached = [&] { return target != 0 && freed >= target; };
  const NamespaceList selected = Select(*namespaces_, *scope);

  if (tiers->l2) {
    v1::TierUsage* usage = AddUsage(response->mutable_evicted(), v1::TIER_L2);
    for (const std::shared_ptr<Namespace>& ns : selected) {
      const uint64_t object_bytes = ns->object_bytes();
      if (object_bytes == 0) continue;  // No geometry yet: nothing in L2.
      // Whole objects: the last one may overshoot the target (pages leave whole).
      const uint64_t max_objects =
          target == 0 ? 0 : (target - std::min(target, freed) + object_bytes - 1) / object_bytes;
      core::AdminEvictResult r;
      if (!reached()) {
        uint64_t written_back = 0;
        r = l2_->EvictScope(*ns, scope->subtree_root, max_objects, request.dry_run(),
                            &written_back);
        response->set_written_back_pages(response->written_back_pages() + written_back);
      } else {
        r = l2_->EvictScope(*ns, scope->subtree_root, /*max_objects=*/1, /*dry_run=*/true);
        r.pages = r.objects = 0;  // Only the skipped counts: the target is met.
      }
      usage->set_objects(usage->objects() + r.objects);
      usage->set_pages(usage->pages() + r.pages);
      usage->set_bytes(usage->bytes() + r.objects * object_bytes);
      freed += r.objects * object_bytes;
      response->set_skipped_pinned_pages(response->skipped_pinned_pages() +
                                         r.skipped_pinned_pages);
      response->set_skipped_in_flight_pages(response->skipped_in_flight_pages() +
                                            r.skipped_in_flight_pages);
    }
  }
  if (tiers->l3 && l3 != nullptr) {
    for (const std::shared_ptr<Namespace>& ns : selected) {
      if (reached()) break;
      absl::StatusOr<std::vector<L3BackendUsage>> r =
          l3->Evict(ToL3Scope(*ns, *scope, *tiers), target == 0 ? 0 : target - freed,
                    request.dry_run());
      if (!r.ok()) return r.status();
      for (const L3BackendUsage& b : *r) freed += b.bytes;
      MergeL3(*r, response->mutable_evicted());
    }
  }
  return absl::OkStatus();
}

absl::Status CacheAdmin::Clear(const v1::ClearRequest& request, L3Admin* l3,
                               v1::ClearResponse* response) {
  if (!request.confirm() && !request.dry_run()) {
    return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_CONFIRM_REQUIRED,
                      "confirm",
                      "Clear drops cache state engines are about to use: set confirm (or dry_run "
                      "to see what would go)");
  }
  absl::StatusOr<ScopedRequest> parsed = ParseScoped(request, l3);
  if (!parsed.ok()) return parsed.status();
  const AdminScope* scope = &parsed->scope;
  const AdminTiers* tiers = &parsed->tiers;
  response->set_dry_run(request.dry_run());
  const NamespaceList selected = Select(*namespaces_, *scope);

  // L3 first: its objects are found through the index's marks, which removing the pages from L2
  // takes with them.
  if (tiers->l3 && l3 != nullptr) {
    for (const std::shared_ptr<Namespace>& ns : selected) {
      absl::StatusOr<std::vector<L3BackendUsage>> r =
          l3->Clear(ToL3Scope(*ns, *scope, *tiers), request.dry_run());
      if (!r.ok()) return r.status();
      MergeL3(*r, response->mutable_removed());
    }
  }
  if (tiers->l2) {
    // Pins first: a pinned page cannot be removed, and the engine holding the pin must learn it
    // is gone (its Load misses, Heartbeat reports the pin unknown). A pin belongs to the scope
    // when a page of it does.
    absl::flat_hash_map<const Namespace*, absl::flat_hash_set<core::PageKey>> subtree_keys;
    if (scope->subtree_root.has_value()) {
      for (const std::shared_ptr<Namespace>& ns : selected) {
        if (ns->index() == nullptr) continue;
        std::vector<core::PageKey> keys = ns->index()->ScopeKeys(scope->subtree_root);
        subtree_keys[ns.get()].insert(keys.begin(), keys.end());
      }
    }
    absl::flat_hash_set<const Namespace*> in_scope;
    for (const std::shared_ptr<Namespace>& ns : selected) in_scope.insert(ns.get());
    uint64_t matched = 0;
    const size_t revoked =
        pins_->Revoke([&](const Namespace& ns, absl::Span<const core::PageKey> keys) {
          if (!in_scope.contains(&ns)) return false;
          bool hit = !scope->subtree_root.has_value();
          if (!hit) {
            auto it = subtree_keys.find(&ns);
            hit = it != subtree_keys.end() &&
                  std::any_of(keys.begin(), keys.end(),
                              [&](const core::PageKey& k) { return it->second.contains(k); });
          }
          matched += hit;
          return hit && !request.dry_run();
        });
    if (!request.dry_run()) metrics_->CountPinsRevoked(revoked);
    response->set_pins_revoked(matched);

    v1::TierUsage* usage = AddUsage(response->mutable_removed(), v1::TIER_L2);
    for (const std::shared_ptr<Namespace>& ns : selected) {
      std::vector<core::ReleasedObject> removed;
      const core::RemoveCounts counts =
          l2_->ClearScope(*ns, scope->subtree_root, request.dry_run(), &removed);
      uint64_t objects = 0;
      uint64_t pages = 0;
      for (size_t i = 0; i < removed.size(); ++i) {
        if (!removed[i].slot.valid()) continue;  // An L3-only copy.
        ++objects;
        // A page's objects are consecutive.
        if (i == 0 || removed[i].key != removed[i - 1].key || !removed[i - 1].slot.valid()) {
          ++pages;
        }
      }
      usage->set_objects(usage->objects() + objects);
      usage->set_pages(usage->pages() + pages);
      usage->set_bytes(usage->bytes() + objects * ns->object_bytes());
      response->set_deferred_pages(response->deferred_pages() + counts.busy_pages);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcellar::server
