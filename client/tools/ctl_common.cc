#include "client/tools/ctl_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"

namespace kvcellar::ctl {

void SetDeadline(const Options& options, grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(options.timeout_ms));
}

int RpcFailed(const Options& options, const grpc::ClientContext& context,
              const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    std::fprintf(stderr, "kvcellarctl: cannot reach kvcellard at %s: %s\n", options.addr.c_str(),
                 status.error_message().c_str());
    return 1;
  }
  std::string reason;
  for (const auto& [key, value] : context.GetServerTrailingMetadata()) {
    if (key == "kvcellar-error-reason") reason = std::string(value.data(), value.size());
  }
  std::fprintf(stderr, "kvcellarctl: %s: %s%s\n", options.addr.c_str(),
               status.error_message().c_str(),
               reason.empty() ? "" : absl::StrCat(" (", reason, ")").c_str());
  return 1;
}

int PrintJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    std::fprintf(stderr, "kvcellarctl: cannot format JSON: %s\n", status.ToString().c_str());
    return 1;
  }
  std::fputs(out.c_str(), stdout);
  return 0;
}

std::string HumanDuration(uint64_t ms) {
  absl::Duration d = absl::Milliseconds(static_cast<int64_t>(ms));
  int64_t s = absl::ToInt64Seconds(d);
  if (s < 60) return absl::StrFormat("%.1fs", absl::ToDoubleSeconds(d));
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  return absl::StrFormat("%dd%02dh", s / 86400, (s / 3600) % 24);
}

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

std::string Hex(const std::string& raw) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char c : raw) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::optional<std::string> KeyFromHex(const std::string& hex) {
  if (hex.size() != 64) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int v = 0;
    for (size_t j = i; j < i + 2; ++j) {
      const char c = absl::ascii_tolower(hex[j]);
      if (c >= '0' && c <= '9') {
        v = v * 16 + (c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v = v * 16 + (c - 'a' + 10);
      } else {
        return std::nullopt;
      }
    }
    out.push_back(static_cast<char>(v));
  }
  return out;
}

std::string TierName(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_L1: return "l1";
    case v1::TIER_L2: return "l2";
    case v1::TIER_L3: return "l3";
    default: return "?";
  }
}

std::optional<v1::Tier> ParseTier(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "l2") return v1::TIER_L2;
  if (lower == "l3") return v1::TIER_L3;
  return std::nullopt;
}

void Table::Print() const {
  std::vector<size_t> width;
  for (const auto& row : rows_) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto numeric = [](const std::string& s) {
    return !s.empty() && (absl::ascii_isdigit(s[0]) || s[0] == '-') &&
           s.find_first_not_of("0123456789.-% KMGTiB") == std::string::npos;
  };
  for (size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (size_t c = 0; c < rows_[r].size(); ++c) {
      const std::string& cell = rows_[r][c];
      const std::string pad(width[c] - cell.size(), ' ');
      const bool last = c + 1 == rows_[r].size();
      if (r > 0 && numeric(cell)) {
        absl::StrAppend(&line, pad, cell);
      } else {
        absl::StrAppend(&line, cell, last ? "" : pad);
      }
      if (!last) line += "  ";
    }
    std::puts(line.c_str());
  }
}

}  // namespace kvcellar::ctl
