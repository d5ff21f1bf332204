#include "server/session/namespace_registry.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/slot_journal.h"
#include "platform/log.h"
#include "server/errors/cache_error.h"

namespace kvcellar::server {
namespace {

absl::Status GroupMismatch(absl::string_view field, absl::string_view message) {
  return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_GROUP_MISMATCH, field,
                    message);
}

}  // namespace

Namespace::Namespace(core::NamespaceSpec spec, core::HostPool* pool,
                     core::EvictionPolicyKind policy, int l3_tiers, uint32_t id,
                     core::SlotJournal* journal, core::IndexEventSink* events,
                     TenantAccount* tenant)
    : spec_(std::move(spec)),
      digest_(spec_.Digest()),
      shards_(static_cast<int>(spec_.ObjectsPerPage())),
      pool_(pool),
      policy_(policy),
      l3_tiers_(l3_tiers),
      id_(id),
      journal_(journal),
      events_(events),
      tenant_account_(tenant),
      group_object_bytes_(spec_.NumGroups()) {}

Namespace::~Namespace() = default;

core::PageKey Namespace::IndexKey(const char* raw) const {
  core::PageKey key;
  std::memcpy(key.bytes.data(), raw, core::kPageKeyBytes);
  return spec_.opaque_keys ? core::ScopeOpaqueKey(digest_, key) : key;
}

void Namespace::AppendIndexKeys(absl::string_view blob, std::vector<core::PageKey>* out) const {
  const size_t n = blob.size() / core::kPageKeyBytes;
  if (n == 0) return;  // (memcpy must not see the null data() of an empty vector.)
  const size_t first = out->size();
  out->resize(first + n);
  absl::Span<core::PageKey> added = absl::MakeSpan(*out).subspan(first);
  std::memcpy(added.data(), blob.data(), n * core::kPageKeyBytes);
  // Opaque keys are scoped in place, several at a time (core::ScopeOpaqueKeys).
  if (spec_.opaque_keys) core::ScopeOpaqueKeys(digest_, added, added);
}

constexpr char kHeldBy[] =
    " (fixed by the engines registered in it, and held while they or its pages remain)";

absl::Status Namespace::CheckGeometry(const core::KvLayout& layout) const {
  if (layout.layers.size() != geometry_.layers) {
    return GroupMismatch("layout.layers", absl::StrCat("layout.layers: ", layout.layers.size(),
                                                       " layers, but this namespace's pages have ",
                                                       geometry_.layers, kHeldBy));
  }
  for (size_t i = 0; i < layout.layers.size(); ++i) {
    const auto& [k, v] = geometry_.buffer_bytes[i];
    const core::LayerLayout& l = layout.layers[i];
    if (l.k.bytes_per_block != k) {
      std::string field = absl::StrCat("layout.layers[", i, "].k.bytes_per_block");
      return GroupMismatch(field, absl::StrCat(field, " (", l.k.bytes_per_block,
                                               ") differs from this namespace's ", k, kHeldBy));
    }
    const uint64_t vb = l.v.has_value() ? l.v->bytes_per_block : 0;
    if (vb != v) {
      std::string field = absl::StrCat("layout.layers[", i, "].v.bytes_per_block");
      return GroupMismatch(
          field, absl::StrCat(field, " (", vb, ") differs from this namespace's ", v, kHeldBy));
    }
    if (l.group != geometry_.layer_group[i]) {
      std::string field = absl::StrCat("layout.layers[", i, "].group");
      return GroupMismatch(field,
                           absl::StrCat(field, " (", l.group, ") differs from this namespace's ",
                                        geometry_.layer_group[i], kHeldBy));
    }
  }
  return absl::OkStatus();
}

absl::Status Namespace::AdoptLayout(const core::KvLayout& layout) {
  absl::MutexLock lock(&mu_);
  absl::Status mismatch;
  if (has_geometry_) {
    mismatch = CheckGeometry(layout);
    if (mismatch.ok()) {
      ++holders_;
      return mismatch;
    }
    // Another geometry: refused while a session or a page holds the current one.
    if (holders_ > 0 || !index_.load(std::memory_order_acquire)->Empty()) return mismatch;
  }
  Geometry g;
  g.layers = static_cast<uint32_t>(layout.layers.size());
  for (const core::LayerLayout& l : layout.layers) {
    g.buffer_bytes.emplace_back(l.k.bytes_per_block, l.v.has_value() ? l.v->bytes_per_block : 0);
    g.layer_group.push_back(l.group);
  }
  if (absl::Status s = FixGeometryLocked(std::move(g)); !s.ok()) {
    // An index that gained a page since Empty() (e.g. an L3 prefetch of a scheduler's Match)
    // keeps the geometry it has: the caller gets the mismatch.
    return s.code() == absl::StatusCode::kAborted ? mismatch : s;
  }
  ++holders_;
  if (journal_ != nullptr) {
    if (absl::Status s = journal_->AppendGeometry(id_, geometry_epoch(), JournalBuffers(geometry_));
        !s.ok()) {
      KVLOG(Warn, "namespace geometry not journaled", {{"error", s.ToString()}});
    }
  }
  return absl::OkStatus();
}

absl::Status Namespace::RestoreGeometry(
    const std::vector<std::pair<uint64_t, uint64_t>>& buffer_bytes, uint16_t geometry_epoch) {
  absl::MutexLock lock(&mu_);
  if (has_geometry_) return absl::FailedPreconditionError("namespace geometry already fixed");
  absl::Status s = FixGeometryLocked(FromJournal(buffer_bytes));
  if (s.ok()) geometry_epoch_.store(geometry_epoch, std::memory_order_release);
  return s;
}

constexpr int kJournalGroupShift = 48;

std::vector<std::pair<uint64_t, uint64_t>> Namespace::JournalBuffers(const Geometry& g) {
  std::vector<std::pair<uint64_t, uint64_t>> out = g.buffer_bytes;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].second |= uint64_t{g.layer_group[i]} << kJournalGroupShift;
  }
  return out;
}

Namespace::Geometry Namespace::FromJournal(
    const std::vector<std::pair<uint64_t, uint64_t>>& buffer_bytes) {
  Geometry g;
  g.layers = static_cast<uint32_t>(buffer_bytes.size());
  for (const auto& [k, v] : buffer_bytes) {
    g.buffer_bytes.emplace_back(k, v & ((uint64_t{1} << kJournalGroupShift) - 1));
    g.layer_group.push_back(static_cast<uint32_t>(v >> kJournalGroupShift));
  }
  return g;
}

absl::Status Namespace::FixGeometryLocked(Geometry g) {
  core::RadixIndex* const index = index_.load(std::memory_order_acquire);
  // The largest group's object: every object of the namespace takes a slot of its size.
  const uint32_t groups = spec_.NumGroups();
  std::vector<uint64_t> group_bytes(groups, 0);
  for (size_t i = 0; i < g.buffer_bytes.size(); ++i) {
    if (g.layer_group[i] >= groups) {
      // Only from a damaged or foreign journal: a registration's groups were checked.
      return InvalidField("layout", absl::StrCat("layout: layer ", i, " is in group ",
                                                 g.layer_group[i], " of a namespace of ", groups));
    }
    group_bytes[g.layer_group[i]] += g.buffer_bytes[i].first + g.buffer_bytes[i].second;
  }
  const uint64_t object_bytes = *std::max_element(group_bytes.begin(), group_bytes.end());
  absl::StatusOr<uint16_t> size_class = pool_->ClassFor(object_bytes);
  if (!size_class.ok()) {
    return InvalidField(
        "layout", absl::StrCat("layout: a page object of ", object_bytes,
                               " bytes does not fit an L2 slot: ", size_class.status().message()));
  }
  const uint64_t slot_bytes = pool_->slot_sizes()[*size_class];
  if (index != nullptr) {
    // Accounting in slot bytes, as at creation. Fails (and the geometry stays) if a page
    // arrived since Empty().
    if (!index->ResetObjectBytes(slot_bytes).ok()) {
      return absl::AbortedError("a page arrived before the geometry could be fixed anew");
    }
  } else {
    core::RadixIndexOptions options;
    options.shards_per_page = shards_;
    if (spec_.Hybrid()) {
      for (const core::KvGroup& group : spec_.groups) {
        options.groups.push_back({group.kind, group.WindowPages(spec_.page_size)});
      }
    }
    options.l3_tiers = l3_tiers_;
    // Accounting in slot bytes: what the pool actually spends per object.
    options.object_bytes = slot_bytes;
    options.capacity_bytes = 0;  // The pool-wide watermarks are enforced by L2Space.
    options.policy = policy_;
    absl::StatusOr<std::unique_ptr<core::RadixIndex>> created = core::RadixIndex::Create(options);
    if (!created.ok()) return created.status();
    owned_index_ = *std::move(created);
    if (events_ != nullptr) owned_index_->SetEventSink(events_);
  }

  const bool refixed = has_geometry_;
  geometry_ = std::move(g);
  has_geometry_ = true;
  object_bytes_.store(object_bytes, std::memory_order_release);
  for (uint32_t k = 0; k < groups; ++k) {
    group_object_bytes_[k].store(group_bytes[k], std::memory_order_release);
  }
  slot_bytes_.store(slot_bytes, std::memory_order_release);
  geometry_epoch_.store(static_cast<uint16_t>(geometry_epoch_.load(std::memory_order_relaxed) + 1),
                        std::memory_order_release);
  index_.store(owned_index_.get(), std::memory_order_release);
  KVLOG(Info, refixed ? "namespace geometry fixed anew" : "namespace geometry fixed",
        {{"ns_digest", digest_.Hex().substr(0, 16)},
         {"model_id", spec_.model_id},
         {"layers", geometry_.layers},
         {"shards", shards_},
         {"object_bytes", object_bytes},
         {"slot_bytes", slot_bytes}});
  return absl::OkStatus();
}

void Namespace::ReleaseLayout() {
  absl::MutexLock lock(&mu_);
  if (holders_ > 0) --holders_;
}

NamespaceRegistry::NamespaceRegistry(core::HostPool* pool, core::EvictionPolicyKind policy,
                                     int l3_tiers, EventSinkFactory event_sinks,
                                     TenantLedger* tenants)
    : pool_(pool),
      policy_(policy),
      l3_tiers_(l3_tiers),
      event_sinks_(std::move(event_sinks)),
      tenants_(tenants) {}

std::shared_ptr<Namespace> NamespaceRegistry::GetOrCreate(const core::NamespaceSpec& spec) {
  return Create(spec, /*journal=*/true);
}

std::shared_ptr<Namespace> NamespaceRegistry::Recreate(const core::NamespaceSpec& spec) {
  return Create(spec, /*journal=*/false);
}

std::shared_ptr<Namespace> NamespaceRegistry::Create(const core::NamespaceSpec& spec,
                                                     bool journal_it) {
  const core::PageKey digest = spec.Digest();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = by_digest_.try_emplace(digest);
  if (inserted) {
    const uint32_t id = static_cast<uint32_t>(by_id_.size() + 1);
    core::SlotJournal* journal = pool_->journal();
    core::IndexEventSink* events = event_sinks_ ? event_sinks_(id, spec) : nullptr;
    TenantAccount* account = tenants_ != nullptr ? tenants_->ForTenant(spec.tenant) : nullptr;
    it->second =
        std::make_shared<Namespace>(spec, pool_, policy_, l3_tiers_, id, journal, events, account);
    by_id_.push_back(it->second);
    // Logged before any page of it can be: a restarted daemon recreates it under the same id.
    if (journal != nullptr && journal_it) {
      if (absl::Status s = journal->AppendNamespace(id, spec); !s.ok()) {
        KVLOG(Warn, "namespace not journaled", {{"error", s.ToString()}});
      }
    }
    KVLOG(Info, "namespace created",
          {{"ns_digest", digest.Hex().substr(0, 16)},
           {"tenant", spec.tenant},
           {"model_id", spec.model_id},
           {"layout", core::LayoutKindName(spec.layout)},
           {"shards", spec.ShardsPerPage()},
           {"groups", spec.NumGroups()}});
  }
  return it->second;
}

std::vector<std::shared_ptr<Namespace>> NamespaceRegistry::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return by_id_;
}

std::shared_ptr<Namespace> NamespaceRegistry::ById(uint32_t id) const {
  absl::MutexLock lock(&mu_);
  return id >= 1 && id <= by_id_.size() ? by_id_[id - 1] : nullptr;
}

size_t NamespaceRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return by_digest_.size();
}

}  // namespace kvcellar::server
