// The metrics registry: counters, gauges and histograms exported in the Prometheus text format.
//
// Built on prometheus-cpp 1.0.1 (Debian 12's prometheus-cpp-dev, target prometheus-cpp::core):
// families and the registry are prometheus::Collectable, a scrape collects prometheus-cpp's data
// model (prometheus::MetricFamily, ClientMetric), names are checked with its CheckMetricName and
// CheckLabelName, and the text is written by a prometheus::Serializer (text_exposition.h says why
// that one is ours). Still written here, because prometheus-cpp 1.0.1's classes would change what
// kvcellard does:
// - The series (Counter, Gauge, Histogram). prometheus::Counter holds a double, so counts past
//   2^53 lose units, and it takes NaN; prometheus::Histogram::Observe locks a mutex per series
//   and puts NaN in its first bucket. Ours are lock-free relaxed atomics, exact integer counters.
// - The label index (MetricFamily<T>). prometheus::Family::Add takes a std::map of strings, so
//   every lookup allocates (the RPC interceptor looks its series up per call), it orders labels
//   by name (ours: as registered, e.g. service,method,code), keeps series in hash order, has no
//   bound on series and throws on errors.
// - The registry. prometheus::Registry takes only families its builders made: no scrape-time
//   collectors or callback gauges; it orders families by type, not name; and it does not check
//   Prometheus' naming rules (_total, reserved labels, histogram suffix clashes).
//
// What it gives: label families with fixed label names, lock-free updates on hot paths,
// scrape-time collectors, bounded series cardinality, and a correct text exposition (format
// 0.0.4) that `promtool check metrics` accepts without warnings.
//
// Usage:
//   MetricsRegistry& registry = DefaultRegistry();
//   CounterFamily* rpcs = registry.RegisterCounter("kvcellar_rpc_requests_total",
//                                                  "RPCs handled.", {"method", "code"}).value();
//   Counter& match_ok = rpcs->WithLabels({"CacheService/Match", "OK"});  // cache this
//   match_ok.Increment();                                                 // lock-free
//
// Threading: every method of every class here may be called from any thread.
// - Register*, WithLabels, AddCollector, RemoveCollector take a mutex. WithLabels is a map lookup
//   (no allocation once the series exists); hot paths call it once and keep the reference.
// - Counter, Gauge and Histogram updates are lock-free atomics (relaxed order: a metric orders no
//   other memory). Integer counter adds are a single fetch_add; double adds and histogram sums are
//   a compare-and-swap loop on the double's bits.
// - Collect() and Scrape() run collectors and callback gauges on the calling (HTTP) thread. They
//   are serialized with each other and with RemoveCollector, so a removed collector never runs
//   again once RemoveCollector returns. Collectors and callbacks must not call Collect, Scrape,
//   AddCollector, AddCallbackGauge or RemoveCollector (they may register and update metrics).
// - A scrape reads each atomic once; values of different series, or the _sum and the buckets of
//   one histogram, may come from slightly different instants. _count always equals the +Inf
//   bucket because both are computed from the same bucket reads.
//
// Lifetime: families and series live as long as their registry and never move, so references
// returned by Register* and WithLabels stay valid. DefaultRegistry() is never destroyed.
#ifndef KVCELLAR_SERVER_METRICS_METRICS_H_
#define KVCELLAR_SERVER_METRICS_METRICS_H_

#include <atomic>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"
#include "server/metrics/text_exposition.h"

namespace kvcellar::server {

// Series per family before new label sets are folded into the overflow series. Labels here are
// RPC methods, status codes, tiers and the like: tens of values. The bound exists so that a label
// fed from an unbounded input (a tenant name, a path) cannot grow the daemon's memory and the
// Prometheus server's index without limit.
inline constexpr size_t kDefaultMaxSeries = 1000;

// The label value that every label of the overflow series carries.
inline constexpr char kOverflowLabelValue[] = "other";

// Counter, Gauge or Histogram (kvcellard makes no Summary or Untyped families).
using MetricType = prometheus::MetricType;

// Histogram bucket upper bounds, in seconds, for RPC and copy latencies: 25 µs to 10 s in 1-2.5-5
// steps (the 1-2.5-5 series is Prometheus' DefBuckets pattern, extended down to the µs scale of
// local RPCs and host-memory copies).
absl::Span<const double> DefaultLatencyBuckets();

// `count` bounds start, start*factor, start*factor^2, ... (for sizes in bytes and the like).
// Empty when start <= 0, factor <= 1 or count == 0.
std::vector<double> ExponentialBuckets(double start, double factor, size_t count);

// A monotonic counter series. Integer adds go to an exact 64-bit count; fractional adds (seconds
// of CPU, bytes of a ratio) to a separate double. Value() is their sum.
class alignas(64) Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  void Increment() { ints_.fetch_add(1, std::memory_order_relaxed); }
  // Negative values are ignored: a counter only goes up.
  template <std::integral T>
  void Add(T n) {
    if constexpr (std::is_signed_v<T>) {
      if (n < 0) return;
    }
    ints_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  }
  // Negative, NaN and infinite values are ignored.
  void Add(double v);

  double Value() const;
  uint64_t IntegerPart() const { return ints_.load(std::memory_order_relaxed); }
  double FractionalPart() const;

  // The value as prometheus-cpp's counter sample (no labels).
  prometheus::ClientMetric Collect() const;

 private:
  std::atomic<uint64_t> ints_{0};
  std::atomic<uint64_t> double_bits_{0};  // bits of a double, 0.0 initially
};

// A gauge series: a double that goes up and down.
class alignas(64) Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v) { bits_.store(std::bit_cast<uint64_t>(v), std::memory_order_relaxed); }
  void Add(double v);
  void Sub(double v) { Add(-v); }
  void Increment() { Add(1.0); }
  void Decrement() { Add(-1.0); }
  double Value() const { return std::bit_cast<double>(bits_.load(std::memory_order_relaxed)); }

  // The value as prometheus-cpp's gauge sample (no labels).
  prometheus::ClientMetric Collect() const;

 private:
  std::atomic<uint64_t> bits_{0};  // bits of a double, 0.0 initially
};

// A histogram series with the bucket bounds of its family. Counts are kept per bucket
// (non-cumulative) so that Observe touches one bucket; Collect accumulates them.
class Histogram {
 public:
  // `bounds` is owned by the family and outlives the series.
  explicit Histogram(absl::Span<const double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Counts v in the first bucket whose upper bound is >= v (Prometheus' `le` is inclusive), or
  // +Inf. NaN is ignored: it would make _sum NaN for the life of the process.
  void Observe(double v);

  // Snapshot accessors. Bucket i < bounds.size() has upper bound bounds[i]; the last is +Inf.
  size_t bucket_count() const { return bounds_.size() + 1; }
  uint64_t BucketCount(size_t i) const { return counts_[i].load(std::memory_order_relaxed); }
  uint64_t Count() const;
  double Sum() const { return std::bit_cast<double>(sum_bits_.load(std::memory_order_relaxed)); }
  absl::Span<const double> bounds() const { return bounds_; }

  // Cumulative buckets ending with +Inf, _sum and _count as prometheus-cpp's histogram sample
  // (no labels); _count is the +Inf bucket's count.
  prometheus::ClientMetric Collect() const;

 private:
  absl::Span<const double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<uint64_t> sum_bits_{0};                // bits of a double
};

namespace metrics_internal {

// The text format is UTF-8: help texts must be, label values are repaired. SanitizeUtf8 replaces
// each byte that is not part of valid UTF-8 with U+FFFD.
bool IsValidUtf8(absl::string_view s);
std::string SanitizeUtf8(absl::string_view s);

// Name syntax (prometheus::CheckMetricName, CheckLabelName), as an error that names the culprit.
absl::Status ValidateMetricName(absl::string_view name);
absl::Status ValidateLabelName(absl::string_view name);

// Orders label-value tuples and looks them up without building a key.
struct LabelValuesLess {
  using is_transparent = void;
  bool operator()(const std::vector<std::string>& a, const std::vector<std::string>& b) const;
  bool operator()(const std::vector<std::string>& a, absl::Span<const absl::string_view> b) const;
  bool operator()(absl::Span<const absl::string_view> a, const std::vector<std::string>& b) const;
};

}  // namespace metrics_internal

// What every family has, whatever its series type. Owned by the registry. Collect() gives no
// family when there is no series, else one with its series in label-value order.
class MetricFamilyBase : public prometheus::Collectable {
 public:
  MetricFamilyBase(const MetricFamilyBase&) = delete;
  MetricFamilyBase& operator=(const MetricFamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

 protected:
  MetricFamilyBase(std::string name, std::string help, MetricType type,
                   std::vector<std::string> label_names)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)) {}

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// A family of series of type T (Counter, Gauge or Histogram) sharing a name and label names.
template <typename T>
class MetricFamily final : public MetricFamilyBase {
 public:
  // The series for these label values (one per label name, in registration order), created on
  // first use. Stable for the registry's lifetime: callers on hot paths keep the reference.
  //
  // Bounded cardinality: once the family holds max_series() series, a label set not seen before
  // gets the overflow series, whose every label value is "other"; a warning is logged once.
  // A wrong number of label values is a programming error: it is logged (once per family) and
  // also gets the overflow series, so that nothing crashes in production.
  // Label values that are not valid UTF-8 are stored with U+FFFD in place of the bad bytes.
  T& WithLabels(absl::Span<const absl::string_view> label_values);

  size_t max_series() const { return max_series_; }
  absl::Span<const double> bounds() const { return bounds_; }  // histograms only

  // Labels in registration order.
  std::vector<prometheus::MetricFamily> Collect() const override;

  // Internal: use MetricsRegistry::Register*.
  MetricFamily(std::string name, std::string help, MetricType type,
               std::vector<std::string> label_names, size_t max_series, std::vector<double> bounds);

 private:
  std::unique_ptr<T> NewSeries() const;
  T& Overflow() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_series_;
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>, metrics_internal::LabelValuesLess> series_
      ABSL_GUARDED_BY(mu_);
  std::atomic<bool> warned_overflow_{false};
  std::atomic<bool> warned_arity_{false};
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

extern template class MetricFamily<Counter>;
extern template class MetricFamily<Gauge>;
extern template class MetricFamily<Histogram>;

// What a collector writes at scrape time: values read from their owner (pool statistics, /proc),
// never stored in the registry. Names and labels are validated as at registration; a sample that
// is invalid, repeats a series, or clashes with a registered family or with another type of the
// same name is dropped and logged. Samples of one name from several calls form one family.
class MetricWriter {
 public:
  struct Label {
    absl::string_view name;
    absl::string_view value;
  };

  // `name` must end in _total.
  void AddCounter(absl::string_view name, absl::string_view help, double value,
                  absl::Span<const Label> labels = {});
  void AddGauge(absl::string_view name, absl::string_view help, double value,
                absl::Span<const Label> labels = {});

 private:
  friend class MetricsRegistry;
  MetricWriter(std::map<std::string, prometheus::MetricFamily>* families,
               const std::set<std::string>* reserved)
      : families_(families), reserved_(reserved) {}
  void Add(MetricType type, absl::string_view name, absl::string_view help, double value,
           absl::Span<const Label> labels);
  void Drop(std::string reason);

  std::map<std::string, prometheus::MetricFamily>* families_;
  // Sample names of the registered families: a collector may not write them.
  const std::set<std::string>* reserved_;
  std::set<std::string> series_seen_;  // name{labels} of each sample written
  size_t dropped_ = 0;
  std::string first_drop_reason_;
};

using CollectorId = uint64_t;

class MetricsRegistry final : public prometheus::Collectable {
 public:
  MetricsRegistry() = default;
  ~MetricsRegistry() override;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registers a family, or returns the existing one when `name` was registered with the same
  // type, label names (and bounds); a different type, label names or bounds is AlreadyExists.
  // InvalidArgument for: a name outside [a-zA-Z_:][a-zA-Z0-9_:]* or starting with "__"; a label
  // name outside [a-zA-Z_][a-zA-Z0-9_]*, starting with "__", repeated, or reserved ("le",
  // "quantile"); an empty or non-UTF-8 help; a counter name without the _total suffix, or another
  // type's name with it; max_series == 0; histogram bounds not finite and strictly increasing (a
  // trailing +Inf is accepted and dropped: the +Inf bucket is always there).
  absl::StatusOr<CounterFamily*> RegisterCounter(
      absl::string_view name, absl::string_view help,
      absl::Span<const absl::string_view> label_names = {}, size_t max_series = kDefaultMaxSeries);
  absl::StatusOr<GaugeFamily*> RegisterGauge(absl::string_view name, absl::string_view help,
                                             absl::Span<const absl::string_view> label_names = {},
                                             size_t max_series = kDefaultMaxSeries);
  absl::StatusOr<HistogramFamily*> RegisterHistogram(
      absl::string_view name, absl::string_view help,
      absl::Span<const absl::string_view> label_names = {},
      absl::Span<const double> bounds = DefaultLatencyBuckets(),
      size_t max_series = kDefaultMaxSeries);

  // An unlabeled gauge whose value is `value()`, called at each scrape. The name is reserved
  // like a registered family's (AlreadyExists if taken). RemoveCollector(id) unregisters it.
  absl::StatusOr<CollectorId> AddCallbackGauge(absl::string_view name, absl::string_view help,
                                               std::function<double()> value);

  // Runs `collect` at each scrape, in the order added. Keep the id to remove it when what it
  // reads goes away.
  CollectorId AddCollector(std::function<void(MetricWriter&)> collect);
  // Removes a collector or callback gauge; waits for a scrape that is running it. Unknown ids
  // are ignored.
  void RemoveCollector(CollectorId id);

  // Every family with at least one series, registered and collected, sorted by name; series in
  // label-value order (collectors' in the order written), labels in registration order.
  std::vector<prometheus::MetricFamily> Collect() const override;

  // Collect() as text (format 0.0.4, TextExposition): each family with # HELP and # TYPE.
  std::string Scrape() const;

 private:
  class CallbackGauge;
  struct Collector {
    CollectorId id;
    std::function<void(MetricWriter&)> collect;
  };

  template <typename Family>
  absl::StatusOr<Family*> Register(MetricType type, absl::string_view name, absl::string_view help,
                                   absl::Span<const absl::string_view> label_names,
                                   size_t max_series, absl::Span<const double> bounds);
  // Checks that `name` (of `type`) clashes with no sample name of another family.
  absl::Status CheckSampleNamesFree(absl::string_view name, MetricType type) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Lock order: scrape_mu_ before mu_. scrape_mu_ is held while collectors and callback gauges
  // run; mu_ never is, so they may register metrics.
  mutable absl::Mutex scrape_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(scrape_mu_);
  std::map<CollectorId, std::string> callback_gauges_ ABSL_GUARDED_BY(scrape_mu_);  // id -> name
  CollectorId next_id_ ABSL_GUARDED_BY(scrape_mu_) = 1;

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<MetricFamilyBase>, std::less<>> families_
      ABSL_GUARDED_BY(mu_);
};

// The process-wide registry: the one global mutable state kvcellard has (DESIGN.md, STYLE.md).
// Created on first use and never destroyed. Tests construct their own MetricsRegistry instead.
MetricsRegistry& DefaultRegistry();

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_METRICS_METRICS_H_
