// kvcellarctl: the operator's command line for a running kvcellard.
//
//   kvcellarctl [--addr ADDR] [--timeout-ms N] [--json] [TLS flags] COMMAND
//
// ADDR is a socket path (default: where a daemon on embedded defaults listens) or HOST:PORT.
// Exit codes: 0 success; 1 the daemon answered with an error or could not be reached; 2 usage.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "client/tools/ctl_common.h"
#include "platform/runtime_paths.h"
#include "grpcpp/client_context.h"
#include "kvcellar/v1/admin_service.grpc.pb.h"

namespace {

namespace v1 = ::kvcellar::v1;
namespace ctl = ::kvcellar::ctl;

constexpr char kUsage[] =
    "usage: kvcellarctl [--addr ADDR] [--timeout-ms N] [--json]\n"
    "                   [--ca FILE [--cert FILE --key FILE] [--server-name NAME]] COMMAND\n"
    "\n"
    "commands:\n"
    "  status      version, uptime, listeners, readiness and config digest\n"
    "  config      the effective configuration (YAML, secrets redacted)\n"
    "  engines     registered sessions [--instance ID] [--namespace HEX] [--tenant T]\n"
    "  namespaces  namespaces with usage and hit rates [--tenant T]\n"
    "  tenants     per tenant: L2 quota and use, hit rates, evictions by cause [--tenant T]\n"
    "  stats       counters [--per-namespace] [--namespace HEX]\n"
    "  evict       evict cold pages (admin socket): scope, --tier, --target-bytes N, --dry-run\n"
    "  clear       remove every page in scope (admin socket): scope, --tier, --yes, --dry-run\n"
    "  events      KV events as the daemon publishes them (docs/events.md), until Ctrl-C:\n"
    "              [--from-seq N] replay buffered batches from N first, [--count N] stop after\n"
    "              N batches, [--tenant T] [--model M] only that namespace's\n"
    "\n"
    "scope (evict, clear; all given must match): --namespace HEX (ns_digest), --tenant T\n"
    "  (\"\" is the empty tenant), --subtree HEX (a page key and everything below it)\n"
    "  --tier l2|l3     repeatable (default l2); --l3-backend NAME repeatable\n"
    "\n"
    "  --addr ADDR      socket path or HOST:PORT (default: the daemon's default socket)\n"
    "  --timeout-ms N   give up after N ms (default 3000)\n"
    "  --json           print the reply as JSON\n"
    "  --ca FILE        TLS: trust this CA for a HOST:PORT address\n"
    "  --cert, --key    mutual TLS: client certificate and key\n";

using kvcellar::ctl::Options;

int Usage(const std::string& error) {
  std::fprintf(stderr, "kvcellarctl: %s\n%s", error.c_str(), kUsage);
  return 2;
}

std::string ListenerKindName(v1::ListenerKind kind) {
  switch (kind) {
    case v1::LISTENER_KIND_UNIX: return "engine (unix)";
    case v1::LISTENER_KIND_ADMIN: return "admin (unix)";
    case v1::LISTENER_KIND_TCP: return "engine (tcp)";
    case v1::LISTENER_KIND_HTTP: return "http";
    default: return "unknown";
  }
}

std::string SecurityName(v1::ListenerSecurity security) {
  switch (security) {
    case v1::LISTENER_SECURITY_UNIX_PERMISSIONS: return "file permissions";
    case v1::LISTENER_SECURITY_PLAINTEXT: return "plaintext";
    case v1::LISTENER_SECURITY_TLS: return "tls";
    case v1::LISTENER_SECURITY_MTLS: return "mutual tls";
    default: return "unknown";
  }
}

using kvcellar::ctl::HumanBytes;
using kvcellar::ctl::HumanDuration;
using kvcellar::ctl::PrintJson;
using kvcellar::ctl::RpcFailed;
using kvcellar::ctl::SetDeadline;

int Status(const Options& options, v1::AdminService::Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::GetStatusResponse reply;
  grpc::Status status = stub.GetStatus(&context, v1::GetStatusRequest(), &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  std::printf("kvcellard %s (commit %s, %s, cuda %s) on %s\n", reply.version().c_str(),
              reply.git_commit().c_str(), reply.build_type().c_str(),
              reply.cuda_built() ? "built" : "not built", reply.hostname().c_str());
  std::printf("state:          %s\n",
              reply.ready() ? "ready"
                            : absl::StrCat("not ready (", reply.not_ready_reason(), ")").c_str());
  std::printf("uptime:         %s (started %s)\n", HumanDuration(reply.uptime_ms()).c_str(),
              absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                               absl::FromUnixMillis(reply.start_time_unix_ms()),
                               absl::UTCTimeZone())
                  .c_str());
  std::printf("config digest:  %s\n", reply.config_digest().c_str());
  std::printf("host pool:      %s used of %s\n", HumanBytes(reply.pool().used_bytes()).c_str(),
              HumanBytes(reply.pool().capacity_bytes()).c_str());
  const v1::L2RecoveryStatus& l2 = reply.pool().recovery();
  if (l2.warm()) {
    std::printf(
        "l2 start:       warm: %llu pages (%s) recovered in %.3f s; dropped in_flight=%llu "
        "unsealed=%llu torn=%llu checksum=%llu mismatch=%llu orphan=%llu\n",
        static_cast<unsigned long long>(l2.pages()), HumanBytes(l2.bytes()).c_str(), l2.seconds(),
        static_cast<unsigned long long>(l2.dropped_in_flight()),
        static_cast<unsigned long long>(l2.dropped_unsealed()),
        static_cast<unsigned long long>(l2.dropped_torn()),
        static_cast<unsigned long long>(l2.dropped_checksum()),
        static_cast<unsigned long long>(l2.dropped_mismatch()),
        static_cast<unsigned long long>(l2.dropped_orphan()));
  } else if (l2.enabled()) {
    std::printf("l2 start:       cold (%s)\n", l2.cold_reason().c_str());
  } else {
    std::printf("l2 start:       cold (no pool.shm_name: L2 does not survive a restart)\n");
  }
  std::printf("sessions:       %u\n", reply.sessions());
  if (!reply.l3_tiers().empty()) std::printf("l3 tiers:\n");
  for (const v1::L3TierStatus& t : reply.l3_tiers()) {
    std::printf("  %-14s %-14s %s\n", t.name().c_str(), t.kind().c_str(),
                t.healthy() ? "healthy" : absl::StrCat("failing (", t.last_error(), ")").c_str());
    const v1::L3RecoveryStatus& r = t.recovery();
    if (r.source().empty()) continue;
    // The counts of the 'l3 tier scanned' log line, whether or not it was logged yet.
    std::printf(
        "    recovery=%s %s found=%llu inserted=%llu orphaned=%llu legacy=%llu dropped=%llu "
        "pending=%llu bytes=%s seconds=%.3f\n",
        r.source().c_str(), r.done() ? (r.partial() ? "done(partial)" : "done") : "running",
        static_cast<unsigned long long>(r.objects_found()),
        static_cast<unsigned long long>(r.pages_inserted()),
        static_cast<unsigned long long>(r.pages_orphaned()),
        static_cast<unsigned long long>(r.pages_legacy()),
        static_cast<unsigned long long>(r.objects_dropped()),
        static_cast<unsigned long long>(r.objects_pending()), HumanBytes(r.bytes()).c_str(),
        r.seconds());
  }
  std::printf("listeners:\n");
  for (const v1::Listener& l : reply.listeners()) {
    std::printf("  %-14s %-40s %s\n", ListenerKindName(l.kind()).c_str(), l.address().c_str(),
                SecurityName(l.security()).c_str());
  }
  return 0;
}

int Config(const Options& options, v1::AdminService::Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(options, &context);
  v1::GetConfigResponse reply;
  grpc::Status status = stub.GetConfig(&context, v1::GetConfigRequest(), &reply);
  if (!status.ok()) return RpcFailed(options, context, status);
  if (options.json) return PrintJson(reply);
  std::printf("# digest %s%s\n%s", reply.config_digest().c_str(),
              reply.config_file().empty() ? ""
                                          : absl::StrCat(", file ", reply.config_file()).c_str(),
              reply.yaml().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  options.addr = kvcellar::platform::DefaultSocketPath();
  std::map<std::string, std::string*> string_flags = {
      {"--addr", &options.addr},
      {"--ca", &options.channel.ca_file},
      {"--cert", &options.channel.cert_file},
      {"--key", &options.channel.key_file},
      {"--server-name", &options.channel.server_name_override}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string name = arg.substr(0, arg.find('='));
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--json" || arg == "--dry-run" || arg == "--yes" || arg == "--per-namespace") {
      (arg == "--json"     ? options.json
       : arg == "--dry-run" ? options.dry_run
       : arg == "--yes"     ? options.yes
                            : options.per_namespace) = true;
      continue;
    }
    auto take_value = [&](std::string* out) -> bool {
      if (arg.size() > name.size()) {
        *out = arg.substr(name.size() + 1);
        return true;
      }
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    if (auto it = string_flags.find(name); it != string_flags.end()) {
      if (!take_value(it->second)) return Usage(absl::StrCat(name, " needs a value"));
      continue;
    }
    if (name == "--instance" || name == "--tenant" || name == "--l3-backend" ||
        name == "--model") {
      std::string v;
      if (!take_value(&v)) return Usage(absl::StrCat(name, " needs a value"));
      if (name == "--instance") options.instance = v;
      if (name == "--tenant") options.tenant = v;
      if (name == "--l3-backend") options.l3_backends.push_back(v);
      if (name == "--model") options.model = v;
      continue;
    }
    if (name == "--from-seq" || name == "--count") {
      std::string v;
      if (!take_value(&v)) return Usage(absl::StrCat(name, " needs a value"));
      char* end = nullptr;
      const uint64_t n = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || v[0] == '-') {
        return Usage(absl::StrCat(name, " must be a non-negative integer, got '", v, "'"));
      }
      (name == "--count" ? options.count : options.from_seq.emplace()) = n;
      continue;
    }
    if (name == "--namespace" || name == "--subtree") {
      std::string v;
      if (!take_value(&v)) return Usage(absl::StrCat(name, " needs a value"));
      std::optional<std::string> key = ctl::KeyFromHex(v);
      if (!key.has_value()) {
        return Usage(absl::StrCat(name, " wants 64 hex digits (32 bytes), got '", v, "'"));
      }
      (name == "--namespace" ? options.ns_digest : options.subtree_key) = *key;
      continue;
    }
    if (name == "--tier") {
      std::string v;
      if (!take_value(&v)) return Usage("--tier needs a value");
      std::optional<v1::Tier> tier = ctl::ParseTier(v);
      if (!tier.has_value()) return Usage(absl::StrCat("--tier wants l2 or l3, got '", v, "'"));
      options.tiers.push_back(*tier);
      continue;
    }
    if (name == "--target-bytes") {
      std::string v;
      if (!take_value(&v)) return Usage("--target-bytes needs a value");
      char* end = nullptr;
      options.target_bytes = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || v[0] == '-') {
        return Usage(absl::StrCat("--target-bytes must be a non-negative integer, got '", v, "'"));
      }
      continue;
    }
    if (name == "--timeout-ms") {
      std::string v;
      if (!take_value(&v)) return Usage("--timeout-ms needs a value");
      char* end = nullptr;
      options.timeout_ms = std::strtoll(v.c_str(), &end, 10);
      if (*end != '\0' || options.timeout_ms <= 0) {
        return Usage(absl::StrCat("--timeout-ms must be a positive integer, got '", v, "'"));
      }
      continue;
    }
    if (absl::StartsWith(arg, "-")) return Usage(absl::StrCat("unknown flag '", arg, "'"));
    if (!options.command.empty()) return Usage(absl::StrCat("unexpected argument '", arg, "'"));
    options.command = arg;
  }
  if (options.command.empty()) return Usage("no command given");

  using Command = std::function<int(const Options&, v1::AdminService::Stub&)>;
  const std::map<std::string, Command> commands = {
      {"status", Status},        {"config", Config},
      {"engines", ctl::Engines}, {"namespaces", ctl::Namespaces},
      {"stats", ctl::Stats},     {"evict", ctl::Evict},
      {"clear", ctl::Clear},     {"events", ctl::Events},
      {"tenants", ctl::Tenants}};
  auto command = commands.find(options.command);
  if (command == commands.end()) {
    return Usage(absl::StrCat("unknown command '", options.command, "'"));
  }
  auto channel = kvcellar::client::MakeChannel(options.addr, options.channel);
  if (!channel.ok()) {
    std::fprintf(stderr, "kvcellarctl: %s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  v1::AdminService::Stub stub(*channel);
  return command->second(options, stub);
}
