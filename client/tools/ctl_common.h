// What every kvcellarctl command shares: the parsed command line, the RPC plumbing, JSON output,
// human-readable numbers, and aligned tables.
#ifndef KVCELLAR_CLIENT_TOOLS_CTL_COMMON_H_
#define KVCELLAR_CLIENT_TOOLS_CTL_COMMON_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "client/channel.h"
#include "google/protobuf/message.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "kvcellar/v1/admin_service.grpc.pb.h"

namespace kvcellar::ctl {

namespace v1 = ::kvcellar::v1;

struct Options {
  std::string addr;
  int64_t timeout_ms = 3000;
  bool json = false;
  client::ChannelOptions channel;
  std::string command;
  // Filters and scope (engines, namespaces, stats, evict, clear).
  std::string instance;
  std::optional<std::string> tenant;
  std::string ns_digest;    // Raw 32 bytes (from --namespace HEX), or empty.
  std::string subtree_key;  // Raw 32 bytes (from --subtree HEX), or empty.
  std::vector<v1::Tier> tiers;
  std::vector<std::string> l3_backends;
  uint64_t target_bytes = 0;
  bool dry_run = false;
  bool yes = false;  // Clear's confirm.
  bool per_namespace = false;
  // events.
  std::optional<uint64_t> from_seq;
  uint64_t count = 0;  // 0: until interrupted.
  std::string model;
};

// Sets the deadline from --timeout-ms.
void SetDeadline(const Options& options, grpc::ClientContext* context);
// Prints a failed RPC in words an operator can act on (with the kvcellar-error-field trailer when
// the daemon named one). Returns the exit code, 1.
int RpcFailed(const Options& options, const grpc::ClientContext& context,
              const grpc::Status& status);
// Prints `message` as JSON (proto field names). Returns the exit code.
int PrintJson(const google::protobuf::Message& message);

std::string HumanDuration(uint64_t ms);
std::string HumanBytes(uint64_t bytes);
// Lowercase hex of raw bytes, and back (nullopt unless exactly 64 hex digits).
std::string Hex(const std::string& raw);
std::optional<std::string> KeyFromHex(const std::string& hex);
std::string TierName(v1::Tier tier);
// "l2" / "l3" (case-insensitive) to a tier; nullopt otherwise.
std::optional<v1::Tier> ParseTier(const std::string& name);

// Rows of cells printed with each column as wide as its widest cell; numbers right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// The cache commands (ctl_cache_commands.cc).
int Engines(const Options& options, v1::AdminService::Stub& stub);
int Namespaces(const Options& options, v1::AdminService::Stub& stub);
int Stats(const Options& options, v1::AdminService::Stub& stub);
int Evict(const Options& options, v1::AdminService::Stub& stub);
int Clear(const Options& options, v1::AdminService::Stub& stub);
int Events(const Options& options, v1::AdminService::Stub& stub);
// ctl_tenants.cc
int Tenants(const Options& options, v1::AdminService::Stub& stub);

}  // namespace kvcellar::ctl

#endif  // KVCELLAR_CLIENT_TOOLS_CTL_COMMON_H_
