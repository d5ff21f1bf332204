// TextExposition: prometheus-cpp's collected families (prometheus::MetricFamily) written in the
// Prometheus text format 0.0.4, byte for byte as kvcellard has always served them
// (docs/metrics.md) and as the Go client writes them.
//
// Written by hand because prometheus-cpp's own prometheus::TextSerializer (1.0.1, the version
// Debian 12's prometheus-cpp-dev ships; 1.3 still writes the same) differs from that text:
// - numbers go through `ostream << double` at 16 significant digits, which does not round-trip
//   (0.30000000000000004 is written 0.3, so a histogram's _sum loses its last digits), writes
//   non-integers of 10^6 and more in fixed notation (process_start_time_seconds), and NaN as "Nan";
// - a histogram series is written _count, _sum, then its buckets; here, as in the Go client and
//   OpenMetrics, buckets, _sum, _count;
// - HELP text is not escaped, so a help text with a newline or a backslash breaks the format.
// Making TextSerializer's output identical would mean re-parsing it to rewrite every number and
// reorder histogram lines, which is longer than writing the lines. TextExposition implements the
// same prometheus::Serializer interface over the same data, so the two stay interchangeable.
//
// Threading: stateless; Serialize may run on any thread.
#ifndef KVCELLAR_SERVER_METRICS_TEXT_EXPOSITION_H_
#define KVCELLAR_SERVER_METRICS_TEXT_EXPOSITION_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"
#include "prometheus/serializer.h"

namespace kvcellar::server {

// The Content-Type of the text TextExposition writes.
inline constexpr char kPrometheusTextContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Writes each family with # HELP and # TYPE, then its series in the order given; a series' labels
// in the order of ClientMetric::label. Families without series are skipped, as the Go client
// does. Histogram buckets are written as given: they end with the +Inf bucket, as both
// prometheus::Histogram::Collect and ours make them. Counter, gauge and histogram families are
// what kvcellard makes; a summary or untyped family gets its # HELP and # TYPE lines only.
class TextExposition final : public prometheus::Serializer {
 public:
  std::string Serialize(const std::vector<prometheus::MetricFamily>& families) const override;
  void Serialize(std::ostream& out,
                 const std::vector<prometheus::MetricFamily>& families) const override;
};

namespace metrics_internal {

// Formats a sample value: NaN, +Inf, -Inf; integers up to 2^53 without exponent; other values in
// the shortest form that round-trips, fixed or exponent notation as Go's strconv 'g' -1 chooses
// (so `le` values read like the ones Go clients emit: 2.5e-05, 0.0001, 0.25).
std::string FormatValue(double v);
// Escapes a label value (\\, \", \n) and a HELP text (\\, \n).
std::string EscapeLabelValue(absl::string_view v);
std::string EscapeHelp(absl::string_view help);
// "counter", "gauge", "histogram", "summary", "untyped".
absl::string_view TypeName(prometheus::MetricType type);

}  // namespace metrics_internal
}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_METRICS_TEXT_EXPOSITION_H_
