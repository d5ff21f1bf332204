// Tests server/metrics/text_exposition.h: prometheus-cpp's data model written as text, and the
// differences from prometheus-cpp's own TextSerializer that are the reason it is written by hand.
#include "server/metrics/text_exposition.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;

prometheus::ClientMetric Sample(std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  return m;
}

prometheus::MetricFamily Counter(std::string name, std::string help, double value,
                                 std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m = Sample(std::move(labels));
  m.counter.value = value;
  return {std::move(name), std::move(help), prometheus::MetricType::Counter, {std::move(m)}};
}

// A histogram series with bounds {0.25, 1}: observations 0.1 + 0.2 and 3.
prometheus::MetricFamily Latency() {
  prometheus::ClientMetric m = Sample({{"method", "Match"}});
  m.histogram.bucket = {{2, 0.25}, {2, 1}, {3, std::numeric_limits<double>::infinity()}};
  m.histogram.sample_count = 3;
  m.histogram.sample_sum = 0.1 + 0.2 + 3;
  return {"kvcellar_test_latency_seconds", "Latency.", prometheus::MetricType::Histogram, {m}};
}

TEST(TextExpositionTest, WritesFamiliesInTheOrderGiven) {
  prometheus::ClientMetric gauge = Sample({{"tier", "l2"}, {"state", "a\\b\"c\nd"}});
  gauge.gauge.value = 1234567.5;
  const std::vector<prometheus::MetricFamily> families = {
      Counter("kvcellar_test_b_total", "Help with \\ and\nnewline.", 7,
              {{"service", "s"}, {"method", "m"}, {"code", "OK"}}),
      {"kvcellar_test_empty", "Never used.", prometheus::MetricType::Gauge, {}},
      {"kvcellar_test_a_bytes", "Bytes.", prometheus::MetricType::Gauge, {gauge}},
      Latency(),
  };
  const std::string expected =
      "# HELP kvcellar_test_b_total Help with \\\\ and\\nnewline.\n"
      "# TYPE kvcellar_test_b_total counter\n"
      // Labels as given (registration order), not sorted by name.
      "kvcellar_test_b_total{service=\"s\",method=\"m\",code=\"OK\"} 7\n"
      // A family without series is not written.
      "# HELP kvcellar_test_a_bytes Bytes.\n"
      "# TYPE kvcellar_test_a_bytes gauge\n"
      "kvcellar_test_a_bytes{tier=\"l2\",state=\"a\\\\b\\\"c\\nd\"} 1.2345675e+06\n"
      "# HELP kvcellar_test_latency_seconds Latency.\n"
      "# TYPE kvcellar_test_latency_seconds histogram\n"
      "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"0.25\"} 2\n"
      "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"1\"} 2\n"
      "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"+Inf\"} 3\n"
      "kvcellar_test_latency_seconds_sum{method=\"Match\"} 3.3\n"
      "kvcellar_test_latency_seconds_count{method=\"Match\"} 3\n";
  EXPECT_EQ(TextExposition().Serialize(families), expected);
  std::ostringstream out;
  TextExposition().Serialize(out, families);
  EXPECT_EQ(out.str(), expected);
}

TEST(TextExpositionTest, UnlabeledHistogramBucketsCarryOnlyLe) {
  prometheus::MetricFamily h = Latency();
  h.metric[0].label.clear();
  h.metric[0].histogram.sample_sum = 0.1 + 0.2;
  EXPECT_THAT(TextExposition().Serialize({h}),
              HasSubstr("kvcellar_test_latency_seconds_bucket{le=\"0.25\"} 2\n"
                        "kvcellar_test_latency_seconds_bucket{le=\"1\"} 2\n"
                        "kvcellar_test_latency_seconds_bucket{le=\"+Inf\"} 3\n"
                        "kvcellar_test_latency_seconds_sum 0.30000000000000004\n"
                        "kvcellar_test_latency_seconds_count 3\n"));
}

// Why TextExposition exists: prometheus-cpp's TextSerializer (the installed version) writes the
// same data otherwise. If this test fails after a prometheus-cpp upgrade, read its assertions
// against text_exposition.h: the serializer may now be usable as it is.
TEST(TextExpositionTest, PrometheusCppTextSerializerWritesOtherText) {
  prometheus::MetricFamily h = Latency();
  h.metric[0].histogram.sample_sum = 0.1 + 0.2;
  prometheus::ClientMetric nan = Sample({});
  nan.gauge.value = std::nan("");
  prometheus::ClientMetric start = Sample({});
  start.gauge.value = 1764000012.34;
  const std::vector<prometheus::MetricFamily> families = {
      h,
      {"kvcellar_test_nan", "Line one\nline two.", prometheus::MetricType::Gauge, {nan}},
      {"process_start_time_seconds", "Start.", prometheus::MetricType::Gauge, {start}},
  };
  const std::string theirs = prometheus::TextSerializer().Serialize(families);
  const std::string ours = TextExposition().Serialize(families);
  // Histogram lines: _count and _sum before the buckets.
  EXPECT_THAT(theirs, HasSubstr("kvcellar_test_latency_seconds_count{method=\"Match\"} 3\n"
                                "kvcellar_test_latency_seconds_sum{method=\"Match\"} 0.3\n"
                                "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"0.25\"}"
                                " 2\n"));
  // 16 significant digits: 0.30000000000000004 is written 0.3 above, which does not round-trip.
  EXPECT_THAT(ours, HasSubstr("_sum{method=\"Match\"} 0.30000000000000004\n"));
  // NaN spelled "Nan"; help not escaped, so its newline ends the # HELP line.
  EXPECT_THAT(theirs, HasSubstr("kvcellar_test_nan Nan\n"));
  EXPECT_THAT(ours, HasSubstr("kvcellar_test_nan NaN\n"));
  EXPECT_THAT(theirs, HasSubstr("# HELP kvcellar_test_nan Line one\nline two.\n"));
  EXPECT_THAT(ours, HasSubstr("# HELP kvcellar_test_nan Line one\\nline two.\n"));
  // Non-integers of 10^6 and more in fixed notation (Go and TextExposition: exponent).
  EXPECT_THAT(theirs, HasSubstr("process_start_time_seconds 1764000012.34\n"));
  EXPECT_THAT(ours, HasSubstr("process_start_time_seconds 1.76400001234e+09\n"));
}

}  // namespace
}  // namespace kvcellar::server
