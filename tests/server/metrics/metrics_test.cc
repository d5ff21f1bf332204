// Tests server/metrics/metrics.h and server/metrics/process_metrics.h: the exposition byte for byte, validation,
// cardinality bounds, concurrent updates, process statistics, and the real promtool's verdict.
#include "server/metrics/metrics.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/process_metrics.h"

namespace kvcellar::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs `promtool check metrics` on `text`; returns its exit status and everything it printed.
struct PromtoolResult {
  int exit_code;
  std::string output;
};

bool HavePromtool() { return std::system("command -v promtool > /dev/null 2>&1") == 0; }

PromtoolResult RunPromtool(const std::string& text) {
  const std::string dir = ::testing::TempDir();
  const std::string in = absl::StrCat(dir, "/metrics_", getpid(), ".prom");
  const std::string out = absl::StrCat(dir, "/promtool_", getpid(), ".out");
  std::ofstream(in, std::ios::binary) << text;
  const int status =
      std::system(absl::StrCat("promtool check metrics < '", in, "' > '", out, "' 2>&1").c_str());
  std::stringstream printed;
  printed << std::ifstream(out).rdbuf();
  unlink(in.c_str());
  unlink(out.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, printed.str()};
}

TEST(MetricsFormatTest, Values) {
  using metrics_internal::FormatValue;
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-42), "-42");
  EXPECT_EQ(FormatValue(1e15), "1000000000000000");
  EXPECT_EQ(FormatValue(9007199254740992.0), "9007199254740992");
  EXPECT_EQ(FormatValue(1e20), "1e+20");
  EXPECT_EQ(FormatValue(0.5), "0.5");
  EXPECT_EQ(FormatValue(-1.5), "-1.5");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.000025), "2.5e-05");
  EXPECT_EQ(FormatValue(0.0001), "0.0001");
  EXPECT_EQ(FormatValue(0.00025), "0.00025");
  EXPECT_EQ(FormatValue(2.5), "2.5");
  EXPECT_EQ(FormatValue(123456.5), "123456.5");
  EXPECT_EQ(FormatValue(1234567.5), "1.2345675e+06");
  EXPECT_EQ(FormatValue(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  // Shortest round trip: parsing the text gives the same double back.
  for (double v : {0.1 + 0.2, 1e-300, 5e-324, 1.7976931348623157e308, 123.456e-7}) {
    EXPECT_EQ(std::strtod(FormatValue(v).c_str(), nullptr), v) << FormatValue(v);
  }
}

TEST(MetricsFormatTest, Escaping) {
  EXPECT_EQ(metrics_internal::EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(metrics_internal::EscapeHelp("say \"hi\"\nback\\slash"), "say \"hi\"\\nback\\\\slash");
  EXPECT_EQ(metrics_internal::SanitizeUtf8("ok \xC3\xA9 \xFF end"), "ok \xC3\xA9 \xEF\xBF\xBD end");
  EXPECT_EQ(metrics_internal::SanitizeUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(metrics_internal::SanitizeUtf8("\xED\xA0\x80"),                           // surrogate
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(MetricsRegistryTest, GoldenExposition) {
  MetricsRegistry r;
  CounterFamily* requests =
      r.RegisterCounter("kvcellar_test_requests_total", "Requests handled.", {"method", "code"})
          .value();
  requests->WithLabels({"Match", "OK"}).Add(3);
  requests->WithLabels({"Backup", "OK"}).Increment();
  Counter& unavailable = requests->WithLabels({"Match", "UNAVAILABLE"});
  unavailable.Add(2);
  unavailable.Add(0.5);

  GaugeFamily* pool =
      r.RegisterGauge("kvcellar_test_pool_bytes", "Bytes in use.", {"tier"}).value();
  pool->WithLabels({"l3"}).Set(-1.5);
  pool->WithLabels({"l2"}).Set(1024);

  HistogramFamily* latency =
      r.RegisterHistogram("kvcellar_test_latency_seconds", "Latency.", {"method"}, {0.25, 1, 4})
          .value();
  Histogram& match = latency->WithLabels({"Match"});
  for (double v : {0.125, 0.25, 2.0, 8.0}) match.Observe(v);
  latency->WithLabels({"Load"});  // a series with no observations is still written

  ASSERT_TRUE(
      r.AddCallbackGauge("kvcellar_test_uptime_seconds", "Uptime.", [] { return 42.25; }).ok());
  // Registered but never used: not written.
  ASSERT_TRUE(r.RegisterCounter("kvcellar_test_unused_total", "Unused.", {"x"}).ok());

  EXPECT_EQ(r.Scrape(),
            "# HELP kvcellar_test_latency_seconds Latency.\n"
            "# TYPE kvcellar_test_latency_seconds histogram\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Load\",le=\"0.25\"} 0\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Load\",le=\"1\"} 0\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Load\",le=\"4\"} 0\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Load\",le=\"+Inf\"} 0\n"
            "kvcellar_test_latency_seconds_sum{method=\"Load\"} 0\n"
            "kvcellar_test_latency_seconds_count{method=\"Load\"} 0\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"0.25\"} 2\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"1\"} 2\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"4\"} 3\n"
            "kvcellar_test_latency_seconds_bucket{method=\"Match\",le=\"+Inf\"} 4\n"
            "kvcellar_test_latency_seconds_sum{method=\"Match\"} 10.375\n"
            "kvcellar_test_latency_seconds_count{method=\"Match\"} 4\n"
            "# HELP kvcellar_test_pool_bytes Bytes in use.\n"
            "# TYPE kvcellar_test_pool_bytes gauge\n"
            "kvcellar_test_pool_bytes{tier=\"l2\"} 1024\n"
            "kvcellar_test_pool_bytes{tier=\"l3\"} -1.5\n"
            "# HELP kvcellar_test_requests_total Requests handled.\n"
            "# TYPE kvcellar_test_requests_total counter\n"
            "kvcellar_test_requests_total{method=\"Backup\",code=\"OK\"} 1\n"
            "kvcellar_test_requests_total{method=\"Match\",code=\"OK\"} 3\n"
            "kvcellar_test_requests_total{method=\"Match\",code=\"UNAVAILABLE\"} 2.5\n"
            "# HELP kvcellar_test_uptime_seconds Uptime.\n"
            "# TYPE kvcellar_test_uptime_seconds gauge\n"
            "kvcellar_test_uptime_seconds 42.25\n");
}

TEST(MetricsRegistryTest, UnlabeledFamiliesAndEscaping) {
  MetricsRegistry r;
  r.RegisterCounter("kvcellar_test_events_total", "Events.").value()->WithLabels({}).Add(7);
  GaugeFamily* paths = r.RegisterGauge("kvcellar_test_path_info",
                                       "Paths with \"quotes\",\nnewlines and \\.", {"path"})
                           .value();
  paths->WithLabels({"a\\b\"c\nd"}).Set(1);
  paths->WithLabels({"bad \xFF byte"}).Set(2);
  EXPECT_EQ(r.Scrape(),
            "# HELP kvcellar_test_events_total Events.\n"
            "# TYPE kvcellar_test_events_total counter\n"
            "kvcellar_test_events_total 7\n"
            "# HELP kvcellar_test_path_info Paths with \"quotes\",\\nnewlines and \\\\.\n"
            "# TYPE kvcellar_test_path_info gauge\n"
            "kvcellar_test_path_info{path=\"a\\\\b\\\"c\\nd\"} 1\n"
            "kvcellar_test_path_info{path=\"bad \xEF\xBF\xBD byte\"} 2\n");
}

TEST(MetricsRegistryTest, RejectsInvalidNames) {
  MetricsRegistry r;
  const auto invalid = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kInvalidArgument;
  };
  for (const char* name : {"", "1abc_total", "a-b_total", "a b_total", "é_total", "a.b_total"}) {
    EXPECT_TRUE(invalid(r.RegisterCounter(name, "h").status())) << name;
  }
  EXPECT_TRUE(r.RegisterCounter("ns:sub_total", "colons are legal").ok());
  EXPECT_TRUE(r.RegisterCounter("_x_total", "leading underscore is legal").ok());
  for (const char* label : {"", "1a", "a-b", "__reserved", "le", "quantile", "é"}) {
    EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_g", "h", {label}).status())) << label;
  }
  EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_g", "h", {"a", "a"}).status()));
  // Suffix rules.
  absl::Status no_total = r.RegisterCounter("kvcellar_requests", "h").status();
  EXPECT_TRUE(invalid(no_total));
  EXPECT_THAT(no_total.message(), HasSubstr("_total"));
  EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_things_total", "h").status()));
  EXPECT_TRUE(invalid(r.RegisterHistogram("kvcellar_things_total", "h").status()));
  EXPECT_TRUE(invalid(r.RegisterHistogram("kvcellar_latency_count", "h").status()));
  EXPECT_TRUE(invalid(r.RegisterHistogram("kvcellar_latency_bucket", "h").status()));
  // Help must be there and be UTF-8.
  EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_g", "").status()));
  EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_g", "bad \xFF").status()));
  // Bounds must be finite and strictly increasing; max_series positive.
  EXPECT_TRUE(invalid(r.RegisterHistogram("kvcellar_h1_seconds", "h", {}, {1, 1}).status()));
  EXPECT_TRUE(invalid(r.RegisterHistogram("kvcellar_h2_seconds", "h", {}, {2, 1}).status()));
  EXPECT_TRUE(
      invalid(r.RegisterHistogram("kvcellar_h3_seconds", "h", {}, {std::nan("")}).status()));
  EXPECT_TRUE(invalid(r.RegisterGauge("kvcellar_g", "h", {}, 0).status()));
  // A trailing +Inf is accepted and folded into the implicit +Inf bucket.
  HistogramFamily* h = r.RegisterHistogram("kvcellar_h4_seconds", "h", {},
                                           {1, std::numeric_limits<double>::infinity()})
                           .value();
  EXPECT_EQ(h->bounds().size(), 1u);
  EXPECT_EQ(h->WithLabels({}).bucket_count(), 2u);
}

TEST(MetricsRegistryTest, DuplicateRegistration) {
  MetricsRegistry r;
  CounterFamily* a = r.RegisterCounter("kvcellar_x_total", "h", {"method"}).value();
  EXPECT_EQ(r.RegisterCounter("kvcellar_x_total", "other help is fine", {"method"}).value(), a);
  const auto exists = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kAlreadyExists;
  };
  EXPECT_TRUE(exists(r.RegisterCounter("kvcellar_x_total", "h", {"code"}).status()));
  EXPECT_TRUE(exists(r.RegisterCounter("kvcellar_x_total", "h", {"method", "code"}).status()));
  EXPECT_TRUE(exists(r.RegisterCounter("kvcellar_x_total", "h").status()));

  GaugeFamily* g = r.RegisterGauge("kvcellar_y", "h").value();
  EXPECT_EQ(r.RegisterGauge("kvcellar_y", "h").value(), g);
  EXPECT_TRUE(exists(r.RegisterHistogram("kvcellar_y", "h").status()));

  HistogramFamily* h = r.RegisterHistogram("kvcellar_z_seconds", "h", {}, {1, 2}).value();
  EXPECT_EQ(r.RegisterHistogram("kvcellar_z_seconds", "h", {}, {1, 2}).value(), h);
  EXPECT_TRUE(exists(r.RegisterHistogram("kvcellar_z_seconds", "h", {}, {1, 3}).status()));
  EXPECT_TRUE(exists(r.RegisterGauge("kvcellar_z_seconds", "h").status()));
  // Names a histogram writes are taken, both ways round.
  EXPECT_TRUE(exists(r.RegisterGauge("kvcellar_z_seconds_count", "h").status()));
  EXPECT_TRUE(exists(r.RegisterGauge("kvcellar_z_seconds_sum", "h").status()));
  ASSERT_TRUE(r.RegisterGauge("kvcellar_w_count", "h").ok());
  EXPECT_TRUE(exists(r.RegisterHistogram("kvcellar_w", "h").status()));

  // Callback gauges reserve their name too, and are not handed out as gauge families.
  ASSERT_TRUE(r.AddCallbackGauge("kvcellar_cb", "h", [] { return 1.0; }).ok());
  EXPECT_TRUE(exists(r.RegisterGauge("kvcellar_cb", "h").status()));
  EXPECT_TRUE(exists(r.AddCallbackGauge("kvcellar_cb", "h", [] { return 2.0; }).status()));
  EXPECT_TRUE(exists(r.AddCallbackGauge("kvcellar_y", "h", [] { return 2.0; }).status()));
}

TEST(MetricsRegistryTest, SeriesAreStableAndOverflowIsBounded) {
  MetricsRegistry r;
  CounterFamily* f =
      r.RegisterCounter("kvcellar_tenant_requests_total", "h", {"tenant", "method"}, 2).value();
  Counter& a = f->WithLabels({"a", "Match"});
  Counter& b = f->WithLabels({"b", "Match"});
  EXPECT_EQ(&f->WithLabels({"a", "Match"}), &a);
  EXPECT_NE(&a, &b);
  // Past max_series, every new label set lands in one overflow series.
  Counter& c = f->WithLabels({"c", "Match"});
  Counter& d = f->WithLabels({"d", "Load"});
  EXPECT_EQ(&c, &d);
  EXPECT_EQ(&c, &f->WithLabels({"other", "other"}));
  EXPECT_EQ(&f->WithLabels({"a", "Match"}), &a);  // known series still resolve
  a.Increment();
  c.Add(2);
  d.Add(3);
  // A wrong number of label values is a bug; it is counted in the overflow series too.
  f->WithLabels({"only-one"}).Increment();
  EXPECT_EQ(r.Scrape(),
            "# HELP kvcellar_tenant_requests_total h\n"
            "# TYPE kvcellar_tenant_requests_total counter\n"
            "kvcellar_tenant_requests_total{tenant=\"a\",method=\"Match\"} 1\n"
            "kvcellar_tenant_requests_total{tenant=\"b\",method=\"Match\"} 0\n"
            "kvcellar_tenant_requests_total{tenant=\"other\",method=\"other\"} 6\n");

  // Unlabeled: one series whatever is passed.
  CounterFamily* u = r.RegisterCounter("kvcellar_u_total", "h").value();
  EXPECT_EQ(&u->WithLabels({}), &u->WithLabels({"stray"}));
}

TEST(MetricsRegistryTest, CounterIgnoresDecreases) {
  Counter c;
  c.Add(5);
  c.Add(-3);
  c.Add(-0.5);
  c.Add(std::nan(""));
  c.Add(std::numeric_limits<double>::infinity());
  c.Add(int64_t{-1});
  EXPECT_EQ(c.Value(), 5);
  c.Add(0.25);
  c.Add(uint64_t{1} << 60);
  EXPECT_EQ(c.IntegerPart(), 5 + (uint64_t{1} << 60));
  EXPECT_EQ(c.FractionalPart(), 0.25);
  Gauge g;
  g.Set(3);
  g.Sub(4.5);
  g.Increment();
  g.Decrement();
  EXPECT_EQ(g.Value(), -1.5);
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulativeAndInclusive) {
  MetricsRegistry r;
  Histogram& h =
      r.RegisterHistogram("kvcellar_h_seconds", "h", {}, {1, 2, 3}).value()->WithLabels({});
  // Upper bounds are inclusive: 1 goes in le="1", 1.5 in le="2", 3.5 in +Inf.
  for (double v : {0.0, 1.0, 1.5, 2.0, 2.0, 3.0, 3.5, -1.0}) h.Observe(v);
  h.Observe(std::nan(""));          // ignored
  EXPECT_EQ(h.BucketCount(0), 3u);  // -1, 0, 1
  EXPECT_EQ(h.BucketCount(1), 3u);  // 1.5, 2, 2
  EXPECT_EQ(h.BucketCount(2), 1u);  // 3
  EXPECT_EQ(h.BucketCount(3), 1u);  // 3.5
  EXPECT_EQ(h.Count(), 8u);
  EXPECT_EQ(h.Sum(), 12.0);
  EXPECT_EQ(r.Scrape(),
            "# HELP kvcellar_h_seconds h\n"
            "# TYPE kvcellar_h_seconds histogram\n"
            "kvcellar_h_seconds_bucket{le=\"1\"} 3\n"
            "kvcellar_h_seconds_bucket{le=\"2\"} 6\n"
            "kvcellar_h_seconds_bucket{le=\"3\"} 7\n"
            "kvcellar_h_seconds_bucket{le=\"+Inf\"} 8\n"
            "kvcellar_h_seconds_sum 12\n"
            "kvcellar_h_seconds_count 8\n");
}

TEST(MetricsRegistryTest, DefaultBuckets) {
  absl::Span<const double> b = DefaultLatencyBuckets();
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(b.front(), 25e-6);
  EXPECT_EQ(b.back(), 10);
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
  EXPECT_EQ(ExponentialBuckets(1024, 4, 3), (std::vector<double>{1024, 4096, 16384}));
  EXPECT_TRUE(ExponentialBuckets(0, 2, 3).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 1, 3).empty());
}

TEST(MetricsRegistryTest, ConcurrentUpdatesSumExactly) {
  MetricsRegistry r;
  CounterFamily* counters = r.RegisterCounter("kvcellar_c_total", "h", {"shard"}).value();
  GaugeFamily* gauges = r.RegisterGauge("kvcellar_g", "h").value();
  HistogramFamily* hists =
      r.RegisterHistogram("kvcellar_h_seconds", "h", {"shard"}, {0.25, 1}).value();
  constexpr int kThreads = 8;
  constexpr int kIterations = 100000;
  std::vector<Counter*> seen(kThreads);
  std::vector<std::thread> threads;
  std::atomic<bool> done{false};
  // A scraper running all the while.
  std::thread scraper([&] {
    while (!done.load()) r.Scrape();
  });
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Every thread resolves the same series concurrently, and gets the same one.
      Counter& ints = counters->WithLabels({"ints"});
      Counter& halves = counters->WithLabels({"halves"});
      seen[t] = &ints;
      Gauge& g = gauges->WithLabels({});
      Histogram& h = hists->WithLabels({std::to_string(t % 2)});
      for (int i = 0; i < kIterations; ++i) {
        ints.Increment();
        halves.Add(0.5);
        g.Add(1);
        h.Observe(i % 2 == 0 ? 0.5 : 2.0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done = true;
  scraper.join();
  for (Counter* c : seen) EXPECT_EQ(c, seen[0]);
  EXPECT_EQ(counters->WithLabels({"ints"}).Value(), kThreads * kIterations);
  EXPECT_EQ(counters->WithLabels({"halves"}).Value(), kThreads * kIterations * 0.5);
  EXPECT_EQ(gauges->WithLabels({}).Value(), kThreads * kIterations);
  for (const char* shard : {"0", "1"}) {
    Histogram& h = hists->WithLabels({shard});
    EXPECT_EQ(h.Count(), uint64_t{kThreads / 2 * kIterations});
    EXPECT_EQ(h.BucketCount(0), 0u);
    EXPECT_EQ(h.BucketCount(1), uint64_t{kThreads / 2 * kIterations / 2});
    EXPECT_EQ(h.BucketCount(2), uint64_t{kThreads / 2 * kIterations / 2});
    EXPECT_EQ(h.Sum(), kThreads / 2 * kIterations / 2 * 2.5);
  }
  EXPECT_THAT(r.Scrape(), HasSubstr("kvcellar_c_total{shard=\"ints\"} 800000\n"));
}

TEST(MetricsRegistryTest, CollectorsAndCallbackGauges) {
  MetricsRegistry r;
  ASSERT_TRUE(r.RegisterGauge("kvcellar_registered", "h").ok());
  r.RegisterGauge("kvcellar_registered", "h").value()->WithLabels({}).Set(1);
  ASSERT_TRUE(r.RegisterHistogram("kvcellar_lat_seconds", "h").ok());
  double pool_used = 10;
  CollectorId pool = r.AddCollector([&](MetricWriter& w) {
    w.AddGauge("kvcellar_pool_used_bytes", "Pool bytes in use.", pool_used, {{"tier", "l2"}});
    w.AddGauge("kvcellar_pool_used_bytes", "ignored", 20, {{"tier", "l3"}});
    w.AddCounter("kvcellar_pool_evictions_total", "Evictions.", 3);
    // Each of these is dropped: bad name, wrong suffix, reserved label, repeated series, clash
    // with a registered family or one of a histogram's sample names, type change.
    w.AddGauge("bad-name", "h", 1);
    w.AddCounter("kvcellar_no_suffix", "h", 1);
    w.AddGauge("kvcellar_x", "h", 1, {{"le", "1"}});
    w.AddGauge("kvcellar_pool_used_bytes", "h", 30, {{"tier", "l2"}});
    w.AddGauge("kvcellar_registered", "h", 1);
    w.AddGauge("kvcellar_lat_seconds_count", "h", 1);
    w.AddGauge("kvcellar_pool_evictions_total", "h", 1);
  });
  int calls = 0;
  CollectorId uptime = r.AddCallbackGauge("kvcellar_cb_value", "h", [&] {
                          ++calls;
                          return 1.5;
                        }).value();
  std::string text = r.Scrape();
  EXPECT_EQ(calls, 1);
  EXPECT_THAT(text, HasSubstr("# HELP kvcellar_pool_used_bytes Pool bytes in use.\n"
                              "# TYPE kvcellar_pool_used_bytes gauge\n"
                              "kvcellar_pool_used_bytes{tier=\"l2\"} 10\n"
                              "kvcellar_pool_used_bytes{tier=\"l3\"} 20\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE kvcellar_pool_evictions_total counter\n"
                              "kvcellar_pool_evictions_total 3\n"));
  EXPECT_THAT(text, HasSubstr("kvcellar_cb_value 1.5\n"));
  EXPECT_THAT(text, HasSubstr("kvcellar_registered 1\n"));
  for (const char* dropped :
       {"bad-name", "kvcellar_no_suffix", "kvcellar_x", "kvcellar_lat_seconds_count"}) {
    EXPECT_THAT(text, Not(HasSubstr(dropped)));
  }
  EXPECT_THAT(text, Not(HasSubstr(" 30\n")));

  pool_used = 11;  // read at scrape time
  EXPECT_THAT(r.Scrape(), HasSubstr("kvcellar_pool_used_bytes{tier=\"l2\"} 11\n"));

  r.RemoveCollector(pool);
  r.RemoveCollector(uptime);
  r.RemoveCollector(12345);  // unknown: ignored
  text = r.Scrape();
  EXPECT_THAT(text, Not(HasSubstr("kvcellar_pool_used_bytes")));
  EXPECT_THAT(text, Not(HasSubstr("kvcellar_cb_value")));
  EXPECT_EQ(calls, 2);
  // The callback gauge's name is free again.
  EXPECT_TRUE(r.RegisterGauge("kvcellar_cb_value", "h").ok());
}

TEST(MetricsRegistryTest, CollectorsMayRegisterMetrics) {
  MetricsRegistry r;
  r.AddCollector([&](MetricWriter& w) {
    r.RegisterCounter("kvcellar_lazy_total", "h").value()->WithLabels({}).Increment();
    w.AddGauge("kvcellar_from_collector", "h", 1);
  });
  // Registered families are read before collectors run: the new counter shows from the next
  // scrape on, with the value it had then.
  std::string text = r.Scrape();
  EXPECT_THAT(text, HasSubstr("kvcellar_from_collector 1\n"));
  EXPECT_THAT(text, Not(HasSubstr("kvcellar_lazy_total")));
  EXPECT_THAT(r.Scrape(), HasSubstr("kvcellar_lazy_total 1\n"));
}

TEST(MetricsRegistryTest, CollectGivesPrometheusCppFamilies) {
  MetricsRegistry r;
  r.RegisterCounter("kvcellar_test_requests_total", "Requests.", {"method", "code"})
      .value()
      ->WithLabels({"Match", "OK"})
      .Add(3);
  r.RegisterGauge("kvcellar_test_unused", "Unused.", {"x"}).value();  // no series: not collected
  r.RegisterHistogram("kvcellar_test_latency_seconds", "Latency.", {}, {1})
      .value()
      ->WithLabels({})
      .Observe(0.5);
  r.AddCollector([](MetricWriter& w) {
    w.AddGauge("kvcellar_test_a_pool_bytes", "Pool.", 10, {{"tier", "l2"}});
  });
  const std::vector<prometheus::MetricFamily> families = r.Collect();
  ASSERT_EQ(families.size(), 3u);
  // By name, collectors' families among the registered ones.
  EXPECT_EQ(families[0].name, "kvcellar_test_a_pool_bytes");
  EXPECT_EQ(families[0].type, prometheus::MetricType::Gauge);
  EXPECT_EQ(families[0].metric[0].gauge.value, 10);
  EXPECT_EQ(families[1].name, "kvcellar_test_latency_seconds");
  const prometheus::ClientMetric::Histogram& h = families[1].metric[0].histogram;
  ASSERT_EQ(h.bucket.size(), 2u);
  EXPECT_EQ(h.bucket[0].upper_bound, 1);
  EXPECT_EQ(h.bucket[1].upper_bound, std::numeric_limits<double>::infinity());
  EXPECT_EQ(h.bucket[1].cumulative_count, 1u);
  EXPECT_EQ(h.sample_count, 1u);
  EXPECT_EQ(h.sample_sum, 0.5);
  EXPECT_EQ(families[2].name, "kvcellar_test_requests_total");
  EXPECT_EQ(families[2].help, "Requests.");
  EXPECT_EQ(families[2].type, prometheus::MetricType::Counter);
  // Labels in registration order, as the exposition writes them.
  ASSERT_EQ(families[2].metric[0].label.size(), 2u);
  EXPECT_EQ(families[2].metric[0].label[0].name, "method");
  EXPECT_EQ(families[2].metric[0].label[1].name, "code");
  EXPECT_EQ(families[2].metric[0].counter.value, 3);
  EXPECT_EQ(r.Scrape(), TextExposition().Serialize(families));
}

TEST(MetricsRegistryTest, DefaultRegistryIsOneInstance) {
  EXPECT_EQ(&DefaultRegistry(), &DefaultRegistry());
}

// --- Process metrics --------------------------------------------------------------------------

TEST(ProcessMetricsTest, ParsesProcStat) {
  // Field k (from 3 on) holds 10*k; the command name holds spaces and parentheses.
  std::string text = "4242 (kv (cellar) d) S";
  for (int k = 4; k <= 52; ++k) absl::StrAppend(&text, " ", 10 * k);
  text += "\n";
  ProcStat stat = ParseProcStat(text).value();
  EXPECT_EQ(stat.utime_ticks, 140u);
  EXPECT_EQ(stat.stime_ticks, 150u);
  EXPECT_EQ(stat.start_ticks, 220u);
  EXPECT_EQ(stat.vsize_bytes, 230u);
  EXPECT_EQ(stat.rss_pages, 240u);
  EXPECT_FALSE(ParseProcStat("4242 (truncated) S 1 2 3").ok());
  EXPECT_FALSE(ParseProcStat("no paren at all").ok());
  EXPECT_EQ(ParseBootTime("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n").value(), 1700000000u);
  EXPECT_FALSE(ParseBootTime("cpu  1 2 3\n").ok());
}

TEST(ProcessMetricsTest, ReadsSaneValues) {
  ProcessStats before = ReadProcessStats().value();
  EXPECT_GT(before.resident_bytes, 0);
  EXPECT_GE(before.virtual_bytes, before.resident_bytes);
  EXPECT_GE(before.open_fds, 3);  // stdin, stdout, stderr
  EXPECT_GE(before.max_fds, before.open_fds);
  EXPECT_GE(before.cpu_seconds, 0);
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(before.start_time_seconds, now + 1);
  EXPECT_GT(before.start_time_seconds, now - 24 * 3600);

  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ProcessStats after = ReadProcessStats().value();
  close(fd);
  EXPECT_EQ(after.open_fds, before.open_fds + 1);
  EXPECT_EQ(after.start_time_seconds, before.start_time_seconds);
}

TEST(ProcessMetricsTest, CollectorAndBuildInfo) {
  MetricsRegistry r;
  RegisterProcessCollector(r);
  ASSERT_TRUE(RegisterBuildInfo(r, "0.1.0", "abc123def456", "Release", true).ok());
  ASSERT_TRUE(RegisterBuildInfo(r, "0.1.0", "abc123def456", "Release", true).ok());  // idempotent
  const std::string text = r.Scrape();
  EXPECT_THAT(text, HasSubstr("# TYPE kvcellar_build_info gauge\n"
                              "kvcellar_build_info{version=\"0.1.0\",commit=\"abc123def456\","
                              "build_type=\"Release\",cuda=\"true\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  for (const char* gauge : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                            "process_start_time_seconds", "process_open_fds", "process_max_fds"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", gauge, " gauge\n"))) << gauge;
  }
  // The values are positive numbers.
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, "process_resident_memory_bytes ") &&
        !absl::StartsWith(line, "process_open_fds ")) {
      continue;
    }
    double v = 0;
    ASSERT_TRUE(absl::SimpleAtod(line.substr(line.find(' ') + 1), &v)) << line;
    EXPECT_GT(v, 0) << line;
  }
}

// --- promtool ---------------------------------------------------------------------------------

TEST(MetricsPromtoolTest, FullExpositionPassesPromtoolCleanly) {
  if (!HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  MetricsRegistry r;
  RegisterProcessCollector(r);
  ASSERT_TRUE(RegisterBuildInfo(r, "0.1.0", "abc123def456", "Release", false).ok());
  CounterFamily* rpcs =
      r.RegisterCounter("kvcellar_rpc_requests_total", "RPCs handled, by method and status code.",
                        {"method", "code"})
          .value();
  rpcs->WithLabels({"kvcellar.v1.CacheService/Match", "OK"}).Add(12);
  rpcs->WithLabels({"kvcellar.v1.CacheService/Load", "UNAVAILABLE"}).Add(0.5);
  HistogramFamily* latency =
      r.RegisterHistogram("kvcellar_rpc_duration_seconds", "RPC latency in seconds.", {"method"})
          .value();
  for (double v : {0.00001, 0.0003, 0.002, 0.7, 30.0}) {
    latency->WithLabels({"kvcellar.v1.CacheService/Match"}).Observe(v);
  }
  HistogramFamily* sizes = r.RegisterHistogram("kvcellar_page_size_bytes", "Object sizes.", {},
                                               ExponentialBuckets(4096, 4, 8))
                               .value();
  sizes->WithLabels({}).Observe(65536);
  GaugeFamily* pool =
      r.RegisterGauge("kvcellar_pool_used_bytes", "Host pool bytes in use.", {"tier"}).value();
  pool->WithLabels({"l2"}).Set(1 << 30);
  pool->WithLabels({"we\"ird\\ \nvalue \xFF"}).Set(std::nan(""));
  r.RegisterGauge("kvcellar_inf", "Infinities are values too.", {"sign"})
      .value()
      ->WithLabels({"+"})
      .Set(std::numeric_limits<double>::infinity());
  ASSERT_TRUE(r.AddCallbackGauge("kvcellar_uptime_seconds", "Seconds since start.", [] {
                 return 12.5;
               }).ok());
  r.AddCollector([](MetricWriter& w) {
    w.AddGauge("kvcellar_sessions", "Engine sessions.", 3, {{"tenant", "default"}});
    w.AddCounter("kvcellar_l3_dropped_writes_total", "Dropped L3 writes.", 7,
                 {{"backend", "file"}});
  });

  const std::string text = r.Scrape();
  const PromtoolResult result = RunPromtool(text);
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- exposition ---\n" << text;
  EXPECT_EQ(result.output, "") << "\n--- exposition ---\n" << text;
}

TEST(MetricsPromtoolTest, PromtoolCatchesProblems) {
  // Guards the test above: the harness does see promtool's complaints.
  if (!HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  const PromtoolResult result = RunPromtool("# HELP foo x\n# TYPE foo counter\nfoo 1\n");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.output, HasSubstr("_total"));
}

}  // namespace
}  // namespace kvcellar::server
