// kvcellar_bench_eviction: each traffic shape (core/eviction_shapes.h) replayed through the radix
// index with each of its policies (LRU, S3-FIFO, adaptive), beside Belady's bound and the best case
// (an unbounded cache) of the same trace (core/eviction_sim.h). Prints a Markdown table; exits 1 if
// a policy beats the bound or the bound beats the best case (the simulator would be wrong).
//
// Run: kvcellar_bench_eviction [--smoke] [--seed N]
//   --smoke  every shape at a tenth of its clients and requests (what ctest runs).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/eviction_shapes.h"
#include "core/eviction_sim.h"
#include "tests/bench/markdown_table.h"

namespace {

using kvcellar::core::EvictionPolicyKind;
using kvcellar::core::SimResult;

constexpr double kHighWatermark = 0.95;
constexpr double kLowWatermark = 0.90;

std::string Rate(double r) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.3f", r);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  double scale = 1.0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      scale = 0.1;
    } else if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--seed N]\n", argv[0]);
      return 2;
    }
  }
  std::vector<std::string> rows;
  bool consistent = true;
  for (const kvcellar::core::EvictionShape& shape : kvcellar::core::EvictionShapes(scale, seed)) {
    const SimResult best = kvcellar::core::SimulateUnbounded(shape.trace);
    const SimResult bound = kvcellar::core::SimulateBelady(shape.trace, shape.capacity_pages);
    double rate[3] = {0, 0, 0};
    const EvictionPolicyKind kinds[3] = {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                         EvictionPolicyKind::kAdaptive};
    for (int k = 0; k < 3; ++k) {
      // The daemon's default watermarks (config/kvcellard.yaml: pool.high_watermark 0.95,
      // pool.low_watermark 0.90).
      absl::StatusOr<SimResult> r = kvcellar::core::SimulateIndex(
          shape.trace, kinds[k], {shape.capacity_pages, kHighWatermark, kLowWatermark});
      if (!r.ok()) {
        std::fprintf(stderr, "%s: %s\n", shape.name.c_str(), r.status().ToString().c_str());
        return 1;
      }
      rate[k] = r->HitRate();
      consistent = consistent && r->hit_tokens <= bound.hit_tokens;
    }
    consistent = consistent && bound.hit_tokens <= best.hit_tokens;
    char row[512];
    std::snprintf(row, sizeof(row), "| %s | %llu | %llu (%s) | %s | %s | %s | %s | %s | %s | %s |",
                  shape.name.c_str(), static_cast<unsigned long long>(shape.trace.requests.size()),
                  static_cast<unsigned long long>(shape.capacity_pages), shape.l2.c_str(),
                  Rate(best.HitRate()).c_str(), Rate(rate[0]).c_str(), Rate(rate[1]).c_str(),
                  Rate(rate[2]).c_str(), Rate(bound.HitRate()).c_str(),
                  Rate(bound.HitRate() > 0 ? rate[1] / bound.HitRate() : 1.0).c_str(),
                  Rate(bound.HitRate() > 0 ? rate[2] / bound.HitRate() : 1.0).c_str());
    rows.push_back(row);
  }
  kvcellar::bench::PrintMarkdownTable(
      stdout, "Hit rate (prompt tokens) per shape: the index's policies and Belady's bound",
      "| shape | requests | L2 pages | best case | LRU | S3-FIFO | adaptive | Belady bound | "
      "S3-FIFO / bound | adaptive / bound |",
      "|---|---|---|---|---|---|---|---|---|---|", rows);
  if (!consistent) {
    std::fprintf(stderr, "a policy beat the bound, or the bound the best case\n");
    return 1;
  }
  return 0;
}
