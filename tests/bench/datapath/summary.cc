#include "tests/bench/datapath/summary.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"
#include "tests/bench/markdown_table.h"

namespace kvcellar::bench {

double Quantile(std::vector<double>* samples, double q) {
  if (samples->empty()) return 0;
  std::sort(samples->begin(), samples->end());
  const size_t rank = static_cast<size_t>(std::ceil(q * samples->size()));
  return (*samples)[std::min(samples->size() - 1, rank == 0 ? 0 : rank - 1)];
}

void Summary::AddCopy(std::string name, double kvcellar_gbps, double memcpy_gbps) {
  absl::MutexLock lock(&mu_);
  copy_.push_back(absl::StrFormat("| %s | %.2f | %.2f | %.2fx |", name, kvcellar_gbps, memcpy_gbps,
                                  kvcellar_gbps / memcpy_gbps));
}

void Summary::AddJournal(std::string name, double journal_gbps, double plain_gbps) {
  absl::MutexLock lock(&mu_);
  journal_.push_back(absl::StrFormat("| %s | %.2f | %.2f | %.3fx |", name, journal_gbps,
                                     plain_gbps, journal_gbps / plain_gbps));
}

void Summary::AddEvents(std::string name, double events_gbps, double plain_gbps) {
  absl::MutexLock lock(&mu_);
  events_.push_back(absl::StrFormat("| %s | %.2f | %.2f | %.3fx |", name, events_gbps, plain_gbps,
                                    events_gbps / plain_gbps));
}

void Summary::AddTokens(std::string name, double tokens_gbps, double plain_gbps) {
  absl::MutexLock lock(&mu_);
  tokens_.push_back(absl::StrFormat("| %s | %.2f | %.2f | %.3fx |", name, tokens_gbps, plain_gbps,
                                    tokens_gbps / plain_gbps));
}

void Summary::AddLatency(std::string name, std::string baseline, double p50_us, double p99_us,
                         double base_p50_us, double base_p99_us) {
  absl::MutexLock lock(&mu_);
  latency_.push_back(absl::StrFormat("| %s | %.0f / %.0f | %s | %.0f / %.0f | %.2fx | %.2fx |",
                                     name, p50_us, p99_us, baseline, base_p50_us, base_p99_us,
                                     p50_us / base_p50_us, p99_us / base_p99_us));
}

void Summary::AddBreakdown(std::string name, std::string part, double p50_us, double p99_us) {
  absl::MutexLock lock(&mu_);
  breakdown_.push_back(absl::StrFormat("| %s | %s | %.0f | %.0f |", name, part, p50_us, p99_us));
}

void Summary::AddThroughput(std::string name, std::string unit, int clients, double one,
                            double many, double many_p50_us, double many_p99_us) {
  absl::MutexLock lock(&mu_);
  throughput_.push_back(absl::StrFormat("| %s | %.0f %s | %.0f %s | %.2fx | %.0f / %.0f |", name,
                                        one, unit, many, unit, many / one, many_p50_us,
                                        many_p99_us));
  (void)clients;
}

void Summary::Print(std::FILE* out) const {
  absl::MutexLock lock(&mu_);
  PrintMarkdownTable(
      out,
      "Load/Backup end to end (RPC + copy + WaitOps) vs memcpy of the same bytes, same "
      "per-layer chunks (goal >= 0.8x)",
      "| case | kvcellar GB/s | memcpy GB/s | ratio |", "|---|---|---|---|", copy_);
  PrintMarkdownTable(out,
                     "Backup with the warm-restart journal (pool.shm_name) vs without, same run, "
                     "alternating (goal: no measurable difference)",
                     "| case | journal GB/s | no journal GB/s | ratio |", "|---|---|---|---|",
                     journal_);
  PrintMarkdownTable(out,
                     "Backup with KV events published to a live ZMQ subscriber vs no events, "
                     "same run, alternating (goal >= 0.95x)",
                     "| case | events GB/s | no events GB/s | ratio |", "|---|---|---|---|",
                     events_);
  PrintMarkdownTable(out,
                     "Backup with each page's tokens sent and kept for the events vs without, "
                     "both publishing, same run, alternating (goal >= 0.95x)",
                     "| case | tokens GB/s | no tokens GB/s | ratio |", "|---|---|---|---|",
                     tokens_);
  PrintMarkdownTable(
      out,
      "Match latency vs no-op gRPC call with the same request bytes + SHA-256 of the same "
      "tokens (goal p50 <= 1.25x)",
      "| case | kvcellar p50 / p99 us | baseline | baseline p50 / p99 us | p50 ratio | p99 "
      "ratio |",
      "|---|---|---|---|---|---|", latency_);
  PrintMarkdownTable(out,
                     "Where Match time goes (each part timed alone, interleaved with the above)",
                     "| case | part | p50 us | p99 us |", "|---|---|---|---|", breakdown_);
  PrintMarkdownTable(
      out, "Throughput, 1 client vs N concurrent clients (each its own Client, channel, session)",
      "| case | 1 client | N clients | N / 1 | N-client latency p50 / p99 us |",
      "|---|---|---|---|---|", throughput_);
  std::fflush(out);
}

}  // namespace kvcellar::bench
