// kvcellarctl's cache commands: engines, namespaces, stats, evict, clear. Each calls one
// AdminService RPC; the output is an aligned table, or the reply as JSON with --json.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/tools/ctl_common.h"

namespace kvcellar::ctl {
namespace {

std::string RoleName(v1::SessionRole role) {
  return role == v1::SESSION_ROLE_SCHEDULER ? "scheduler" : "worker";
}

std::string Percent(double rate) { return absl::StrFormat("%.1f%%", 100.0 * rate); }

void FillScope(const Options& options, v1::Scope* scope) {
  scope->set_ns_digest(options.ns_digest);
  scope->set_subtree_root_key(options.subtree_key);
  if (options.tenant.has_value()) scope->mutable_tenant()->set_tenant(*options.tenant);
}

void PrintUsage(const char* what, const google::protobuf::RepeatedPtrField<v1::TierUsage>& usage) {
  Table table({"TIER", "BACKEND", "PAGES", "OBJECTS", "BYTES", what});
  for (const v1::TierUsage& u : usage) {
    table.Add({TierName(u.tier()), u.l3_backend().empty() ? "-" : u.l3_backend(),
               absl::StrCat(u.pages()), absl::StrCat(u.objects()), absl::StrCat(u.bytes()),
               HumanBytes(u.bytes())});
  }
  table.Print();
}

}  // namespace

int Engines(const Options& options, v1::AdminService::Stub& stub) {
  v1::ListEnginesRequest request;
  request.set_instance_id(options.instance);
  request.set_ns_digest(options.ns_digest);
  if (options.tenant.has_value()) request.mutable_tenant()->set_tenant(*options.tenant);
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::ListEnginesResponse reply;
  grpc::Status status = stub.ListEngines(&context, request, &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  Table table({"INSTANCE", "ROLE", "RANK", "SESSION", "TENANT", "MODEL", "SHARD", "OPS", "PINS",
               "PINNED", "PID", "ENGINE"});
  for (const v1::EngineSession& s : reply.sessions()) {
    table.Add({s.instance_id(), RoleName(s.role()), absl::StrCat(s.rank()),
               absl::StrCat(s.session_id()), s.namespace_spec().tenant(),
               s.namespace_spec().model_id(), absl::StrCat(s.shard_index()),
               absl::StrCat(s.ops_in_flight()), absl::StrCat(s.pins()),
               absl::StrCat(s.pinned_pages()), absl::StrCat(s.pid()), s.engine_name()});
  }
  table.Print();
  return 0;
}

int Namespaces(const Options& options, v1::AdminService::Stub& stub) {
  v1::ListNamespacesRequest request;
  if (options.tenant.has_value()) request.mutable_tenant()->set_tenant(*options.tenant);
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::ListNamespacesResponse reply;
  grpc::Status status = stub.ListNamespaces(&context, request, &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  Table table({"TENANT", "MODEL", "SESSIONS", "L2_PAGES", "L2_BYTES", "L3_PAGES", "LOOKUPS",
               "HITS", "HIT_RATE", "DIGEST"});
  for (const v1::NamespaceInfo& ns : reply.namespaces()) {
    uint64_t l2_pages = 0, l2_bytes = 0, l3_pages = 0;
    for (const v1::TierUsage& u : ns.tiers()) {
      if (u.tier() == v1::TIER_L2) {
        l2_pages += u.pages();
        l2_bytes += u.bytes();
      } else if (u.tier() == v1::TIER_L3) {
        l3_pages += u.pages();
      }
    }
    table.Add({ns.spec().tenant().empty() ? "\"\"" : ns.spec().tenant(), ns.spec().model_id(),
               absl::StrCat(ns.sessions()), absl::StrCat(l2_pages), HumanBytes(l2_bytes),
               absl::StrCat(l3_pages), absl::StrCat(ns.lookup_pages()),
               absl::StrCat(ns.l2_hit_pages() + ns.l3_hit_pages()), Percent(ns.hit_rate()),
               Hex(ns.ns_digest())});
  }
  table.Print();
  return 0;
}

int Stats(const Options& options, v1::AdminService::Stub& stub) {
  v1::GetStatsRequest request;
  request.set_ns_digest(options.ns_digest);
  request.set_per_namespace(options.per_namespace || !options.ns_digest.empty());
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::GetStatsResponse reply;
  grpc::Status status = stub.GetStats(&context, request, &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  std::printf("uptime %s\n\n", HumanDuration(reply.uptime_ms()).c_str());
  auto print = [](const std::string& name, const v1::StatsCounters& c) {
    const v1::MatchCounters& m = c.match();
    uint64_t evicted = 0, cleared = 0;
    for (const v1::TierCounters& t : c.tiers()) {
      evicted += t.evicted_objects();
      cleared += t.cleared_objects();
    }
    return std::vector<std::string>{
        name,
        absl::StrCat(m.calls()),
        absl::StrCat(m.lookup_pages()),
        absl::StrCat(m.l2_hit_pages()),
        absl::StrCat(m.l3_hit_pages()),
        absl::StrCat(m.miss_pages()),
        Percent(m.lookup_pages() == 0 ? 0.0
                                      : static_cast<double>(m.l2_hit_pages() + m.l3_hit_pages()) /
                                            static_cast<double>(m.lookup_pages())),
        absl::StrCat(evicted),
        absl::StrCat(cleared)};
  };
  Table table({"SCOPE", "MATCHES", "LOOKUPS", "L2_HITS", "L3_HITS", "MISSES", "HIT_RATE",
               "EVICTED_OBJ", "CLEARED_OBJ"});
  table.Add(print("total", reply.totals()));
  for (const v1::NamespaceStats& ns : reply.namespaces()) {
    table.Add(print(absl::StrCat(ns.tenant(), "/", ns.model_id()), ns.counters()));
  }
  table.Print();
  const v1::StatsCounters& t = reply.totals();
  if (t.ops_size() > 0 || t.transfers_size() > 0) {
    std::printf("\n");
    Table ops({"OPS", "DONE", "FAILED", "CANCELLED"});
    for (const v1::OpCounters& o : t.ops()) {
      ops.Add({o.kind() == v1::OP_KIND_LOAD ? "load" : o.kind() == v1::OP_KIND_BACKUP ? "backup"
                                                                                      : "prefetch",
               absl::StrCat(o.done()), absl::StrCat(o.failed()), absl::StrCat(o.cancelled())});
    }
    ops.Print();
    std::printf("\n");
    Table moved({"TRANSFER", "OBJECTS", "BYTES"});
    for (const v1::TransferCounters& x : t.transfers()) {
      const char* name = x.direction() == v1::TRANSFER_DIRECTION_L2_TO_L1   ? "l2->l1 (load)"
                         : x.direction() == v1::TRANSFER_DIRECTION_L1_TO_L2 ? "l1->l2 (backup)"
                         : x.direction() == v1::TRANSFER_DIRECTION_L3_TO_L2 ? "l3->l2"
                                                                             : "l2->l3";
      moved.Add({name, absl::StrCat(x.objects()), HumanBytes(x.bytes())});
    }
    moved.Print();
  }
  return 0;
}

int Evict(const Options& options, v1::AdminService::Stub& stub) {
  v1::EvictRequest request;
  FillScope(options, request.mutable_scope());
  for (v1::Tier t : options.tiers) request.add_tiers(t);
  if (options.tiers.empty()) request.add_tiers(v1::TIER_L2);
  for (const std::string& b : options.l3_backends) request.add_l3_backends(b);
  request.set_target_bytes(options.target_bytes);
  request.set_dry_run(options.dry_run);
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::EvictResponse reply;
  grpc::Status status = stub.Evict(&context, request, &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  std::printf("%s\n", reply.dry_run() ? "dry run: nothing was evicted" : "evicted:");
  PrintUsage(reply.dry_run() ? "WOULD_FREE" : "FREED", reply.evicted());
  std::printf("skipped: %llu pinned pages, %llu pages with a copy in flight\n",
              static_cast<unsigned long long>(reply.skipped_pinned_pages()),
              static_cast<unsigned long long>(reply.skipped_in_flight_pages()));
  return 0;
}

int Clear(const Options& options, v1::AdminService::Stub& stub) {
  v1::ClearRequest request;
  FillScope(options, request.mutable_scope());
  for (v1::Tier t : options.tiers) request.add_tiers(t);
  if (options.tiers.empty()) request.add_tiers(v1::TIER_L2);
  for (const std::string& b : options.l3_backends) request.add_l3_backends(b);
  request.set_confirm(options.yes);
  request.set_dry_run(options.dry_run);
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::ClearResponse reply;
  grpc::Status status = stub.Clear(&context, request, &reply);
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION && !options.yes) {
      std::fprintf(stderr, "kvcellarctl: clear removes cache state: pass --yes to confirm, or "
                           "--dry-run to see what would go\n");
    }
    return RpcFailed(options, context, status);
  }
  if (options.json) return PrintJson(reply);
  std::printf("%s\n", reply.dry_run() ? "dry run: nothing was removed" : "removed:");
  PrintUsage(reply.dry_run() ? "WOULD_FREE" : "FREED", reply.removed());
  std::printf("pins revoked: %llu; pages freed when their copy ends: %llu\n",
              static_cast<unsigned long long>(reply.pins_revoked()),
              static_cast<unsigned long long>(reply.deferred_pages()));
  return 0;
}

}  // namespace kvcellar::ctl
