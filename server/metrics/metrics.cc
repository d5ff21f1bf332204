#include "server/metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/log.h"
#include "prometheus/check_names.h"

namespace kvcellar::server {

using metrics_internal::IsValidUtf8;
using metrics_internal::TypeName;

namespace {

// Label names Prometheus gives a meaning to: `le` on histogram buckets, `quantile` on summaries.
// promtool flags them on any other type, and our histograms add `le` themselves.
constexpr absl::string_view kReservedLabels[] = {"le", "quantile"};

constexpr absl::string_view kHistogramSuffixes[] = {"_bucket", "_sum", "_count"};

void AtomicAddDouble(std::atomic<uint64_t>& bits, double v) {
  uint64_t old = bits.load(std::memory_order_relaxed);
  while (!bits.compare_exchange_weak(old, std::bit_cast<uint64_t>(std::bit_cast<double>(old) + v),
                                     std::memory_order_relaxed)) {
  }
}

// Length of the valid UTF-8 sequence at s[i], or 0 when the bytes there are not one.
size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  // Overlong encodings, UTF-16 surrogates and code points past U+10FFFF are invalid.
  static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return 0;
  return n;
}

bool IsReservedLabel(absl::string_view name) {
  return std::find(std::begin(kReservedLabels), std::end(kReservedLabels), name) !=
         std::end(kReservedLabels);
}

// Checks label names as a family or a collector sample declares them.
absl::Status ValidateLabelNames(absl::string_view metric,
                                absl::Span<const absl::string_view> names) {
  for (size_t i = 0; i < names.size(); ++i) {
    if (absl::Status s = metrics_internal::ValidateLabelName(names[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("metric '", metric, "': ", s.message()));
    }
    if (IsReservedLabel(names[i])) {
      return absl::InvalidArgumentError(absl::StrCat("metric '", metric, "': label name '",
                                                     names[i], "' is reserved by Prometheus"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (names[i] == names[j]) {
        return absl::InvalidArgumentError(
            absl::StrCat("metric '", metric, "': label name '", names[i], "' is repeated"));
      }
    }
  }
  return absl::OkStatus();
}

// The name, help and suffix rules common to registered families and collector samples.
absl::Status ValidateFamily(MetricType type, absl::string_view name, absl::string_view help) {
  if (absl::Status s = metrics_internal::ValidateMetricName(name); !s.ok()) return s;
  const bool total = absl::EndsWith(name, "_total");
  if (type == MetricType::Counter && !total) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter '", name, "' must end in _total (Prometheus naming)"));
  }
  if (type != MetricType::Counter && total) {
    return absl::InvalidArgumentError(
        absl::StrCat(TypeName(type), " '", name, "' must not end in _total: only counters do"));
  }
  if (type == MetricType::Histogram) {
    for (absl::string_view suffix : kHistogramSuffixes) {
      if (absl::EndsWith(name, suffix)) {
        return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "' must not end in ",
                                                       suffix, ": the exposition adds it"));
      }
    }
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' needs a help text"));
  }
  if (!IsValidUtf8(help)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric '", name, "': help text is not valid UTF-8"));
  }
  return absl::OkStatus();
}

// `name{a="x",b="y"}`: one series of a collector, as its repeats are recognized and reported.
std::string SeriesKey(absl::string_view name,
                      const std::vector<prometheus::ClientMetric::Label>& labels) {
  return absl::StrCat(name, "{",
                      absl::StrJoin(labels, ",",
                                    [](std::string* out, const prometheus::ClientMetric::Label& l) {
                                      absl::StrAppend(out, l.name, "=\"",
                                                      metrics_internal::EscapeLabelValue(l.value),
                                                      "\"");
                                    }),
                      "}");
}

std::vector<std::string> SampleNames(absl::string_view name, MetricType type) {
  std::vector<std::string> names;
  if (type == MetricType::Histogram) {
    for (absl::string_view suffix : kHistogramSuffixes) names.push_back(absl::StrCat(name, suffix));
  } else {
    names.emplace_back(name);
  }
  return names;
}

}  // namespace

// --- Buckets ----------------------------------------------------------------------------------

absl::Span<const double> DefaultLatencyBuckets() {
  static constexpr double kBuckets[] = {
      0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,    0.05,    0.1,    0.25,    0.5,    1,     2.5,    5,     10,
  };
  return kBuckets;
}

std::vector<double> ExponentialBuckets(double start, double factor, size_t count) {
  std::vector<double> bounds;
  if (!(start > 0) || !(factor > 1) || !std::isfinite(start) || !std::isfinite(factor)) {
    return bounds;
  }
  double b = start;
  for (size_t i = 0; i < count && std::isfinite(b); ++i, b *= factor) bounds.push_back(b);
  return bounds;
}

// --- Series -----------------------------------------------------------------------------------

void Counter::Add(double v) {
  if (!(v > 0) || !std::isfinite(v)) return;  // also rejects NaN
  AtomicAddDouble(double_bits_, v);
}

double Counter::FractionalPart() const {
  return std::bit_cast<double>(double_bits_.load(std::memory_order_relaxed));
}

double Counter::Value() const { return static_cast<double>(IntegerPart()) + FractionalPart(); }

void Gauge::Add(double v) { AtomicAddDouble(bits_, v); }

Histogram::Histogram(absl::Span<const double> bounds)
    : bounds_(bounds), counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds.size() + 1)) {}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAddDouble(sum_bits_, v);
}

uint64_t Histogram::Count() const {
  uint64_t total = 0;
  for (size_t i = 0; i < bucket_count(); ++i) total += BucketCount(i);
  return total;
}

prometheus::ClientMetric Counter::Collect() const {
  prometheus::ClientMetric m;
  m.counter.value = Value();
  return m;
}

prometheus::ClientMetric Gauge::Collect() const {
  prometheus::ClientMetric m;
  m.gauge.value = Value();
  return m;
}

prometheus::ClientMetric Histogram::Collect() const {
  prometheus::ClientMetric m;
  m.histogram.bucket.reserve(bucket_count());
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bucket_count(); ++i) {
    cumulative += BucketCount(i);
    m.histogram.bucket.push_back(
        {cumulative, i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity()});
  }
  m.histogram.sample_count = cumulative;
  m.histogram.sample_sum = Sum();
  return m;
}

// --- UTF-8 and names --------------------------------------------------------------------------

namespace metrics_internal {

bool IsValidUtf8(absl::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SequenceLength(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string SanitizeUtf8(absl::string_view s) {
  static constexpr absl::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SequenceLength(s, i);
    if (n == 0) {
      out.append(kReplacement.data(), kReplacement.size());
      ++i;
    } else {
      out.append(s.data() + i, n);
      i += n;
    }
  }
  return out;
}

absl::Status ValidateMetricName(absl::string_view name) {
  if (!prometheus::CheckMetricName(std::string(name))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric name '", name, "' is invalid: must match [a-zA-Z_:][a-zA-Z0-9_:]*, not __*"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(absl::string_view name) {
  if (!prometheus::CheckLabelName(std::string(name))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "label name '", name, "' is invalid: must match [a-zA-Z_][a-zA-Z0-9_]*, not __*"));
  }
  return absl::OkStatus();
}

namespace {
template <typename A, typename B>
bool LexLess(const A& a, const B& b) {
  return std::lexicographical_compare(
      a.begin(), a.end(), b.begin(), b.end(),
      [](absl::string_view x, absl::string_view y) { return x < y; });
}
}  // namespace

bool LabelValuesLess::operator()(const std::vector<std::string>& a,
                                 const std::vector<std::string>& b) const {
  return LexLess(a, b);
}
bool LabelValuesLess::operator()(const std::vector<std::string>& a,
                                 absl::Span<const absl::string_view> b) const {
  return LexLess(a, b);
}
bool LabelValuesLess::operator()(absl::Span<const absl::string_view> a,
                                 const std::vector<std::string>& b) const {
  return LexLess(a, b);
}

}  // namespace metrics_internal

// --- Families ---------------------------------------------------------------------------------

template <typename T>
MetricFamily<T>::MetricFamily(std::string name, std::string help, MetricType type,
                              std::vector<std::string> label_names, size_t max_series,
                              std::vector<double> bounds)
    : MetricFamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
      max_series_(max_series),
      bounds_(std::move(bounds)) {}

template <typename T>
std::unique_ptr<T> MetricFamily<T>::NewSeries() const {
  if constexpr (std::is_same_v<T, Histogram>) {
    return std::make_unique<Histogram>(bounds_);
  } else {
    return std::make_unique<T>();
  }
}

template <typename T>
T& MetricFamily<T>::Overflow() {
  const std::vector<std::string> key(label_names().size(), kOverflowLabelValue);
  auto it = series_.find(key);
  if (it == series_.end()) it = series_.emplace(key, NewSeries()).first;
  return *it->second;
}

template <typename T>
T& MetricFamily<T>::WithLabels(absl::Span<const absl::string_view> label_values) {
  if (label_values.size() != label_names().size()) {
    if (!warned_arity_.exchange(true, std::memory_order_relaxed)) {
      KVLOG(Error, "metric used with the wrong number of label values",
            {{"metric", name()}, {"expected", label_names().size()}, {"got", label_values.size()}});
    }
    if (label_names().empty()) return WithLabels({});
    absl::MutexLock lock(&mu_);
    return Overflow();
  }
  for (absl::string_view v : label_values) {
    if (!IsValidUtf8(v)) {
      std::vector<std::string> clean;
      for (absl::string_view w : label_values) clean.push_back(metrics_internal::SanitizeUtf8(w));
      const std::vector<absl::string_view> views(clean.begin(), clean.end());
      return WithLabels(views);
    }
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = series_.find(label_values);
    if (it != series_.end()) return *it->second;
  }
  absl::MutexLock lock(&mu_);
  auto it = series_.find(label_values);
  if (it != series_.end()) return *it->second;
  if (series_.size() >= max_series_) {
    if (!warned_overflow_.exchange(true, std::memory_order_relaxed)) {
      KVLOG(Warn, "metric series limit reached; new label sets count in the overflow series",
            {{"metric", name()}, {"max_series", max_series_}, {"overflow_value", "other"}});
    }
    return Overflow();
  }
  std::vector<std::string> key(label_values.begin(), label_values.end());
  return *series_.emplace(std::move(key), NewSeries()).first->second;
}

template <typename T>
std::vector<prometheus::MetricFamily> MetricFamily<T>::Collect() const {
  absl::ReaderMutexLock lock(&mu_);
  if (series_.empty()) return {};
  prometheus::MetricFamily family{name(), help(), type(), {}};
  family.metric.reserve(series_.size());
  for (const auto& [values, series] : series_) {
    prometheus::ClientMetric& m = family.metric.emplace_back(series->Collect());
    m.label.reserve(values.size());
    for (size_t i = 0; i < values.size(); ++i) m.label.push_back({label_names()[i], values[i]});
  }
  std::vector<prometheus::MetricFamily> out;
  out.push_back(std::move(family));
  return out;
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

// An unlabeled gauge evaluated at scrape time.
class MetricsRegistry::CallbackGauge final : public MetricFamilyBase {
 public:
  CallbackGauge(std::string name, std::string help, std::function<double()> value)
      : MetricFamilyBase(std::move(name), std::move(help), MetricType::Gauge, {}),
        value_(std::move(value)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::ClientMetric m;
    m.gauge.value = value_();
    return {{name(), help(), type(), {std::move(m)}}};
  }

 private:
  const std::function<double()> value_;
};

// --- Collector output -------------------------------------------------------------------------

void MetricWriter::AddCounter(absl::string_view name, absl::string_view help, double value,
                              absl::Span<const Label> labels) {
  Add(MetricType::Counter, name, help, value, labels);
}

void MetricWriter::AddGauge(absl::string_view name, absl::string_view help, double value,
                            absl::Span<const Label> labels) {
  Add(MetricType::Gauge, name, help, value, labels);
}

void MetricWriter::Drop(std::string reason) {
  if (dropped_++ == 0) first_drop_reason_ = std::move(reason);
}

void MetricWriter::Add(MetricType type, absl::string_view name, absl::string_view help,
                       double value, absl::Span<const Label> labels) {
  if (absl::Status s = ValidateFamily(type, name, help); !s.ok()) {
    return Drop(std::string(s.message()));
  }
  std::vector<absl::string_view> names;
  prometheus::ClientMetric sample;
  for (const Label& l : labels) {
    names.push_back(l.name);
    sample.label.push_back({std::string(l.name), metrics_internal::SanitizeUtf8(l.value)});
  }
  if (absl::Status s = ValidateLabelNames(name, names); !s.ok()) {
    return Drop(std::string(s.message()));
  }
  if (reserved_->contains(std::string(name))) {
    return Drop(absl::StrCat("collector metric '", name, "' clashes with a registered family"));
  }
  auto it = families_->find(std::string(name));
  if (it != families_->end() && it->second.type != type) {
    return Drop(absl::StrCat("collector metric '", name, "' written as both ",
                             TypeName(it->second.type), " and ", TypeName(type)));
  }
  if (std::string key = SeriesKey(name, sample.label); !series_seen_.insert(key).second) {
    return Drop(absl::StrCat("collector metric '", name, "' repeats the series ", key));
  }
  if (it == families_->end()) {
    prometheus::MetricFamily family{std::string(name), std::string(help), type, {}};
    it = families_->emplace(family.name, std::move(family)).first;
  }
  (type == MetricType::Counter ? sample.counter.value : sample.gauge.value) = value;
  it->second.metric.push_back(std::move(sample));
}

// --- Registry ---------------------------------------------------------------------------------

MetricsRegistry::~MetricsRegistry() = default;

absl::Status MetricsRegistry::CheckSampleNamesFree(absl::string_view name, MetricType type) const {
  for (const std::string& sample : SampleNames(name, type)) {
    if (sample != name && families_.contains(sample)) {
      return absl::AlreadyExistsError(absl::StrCat("histogram '", name, "' would write ", sample,
                                                   ", which is a registered metric"));
    }
    for (absl::string_view suffix : kHistogramSuffixes) {
      if (!absl::EndsWith(sample, suffix)) continue;
      auto it = families_.find(absl::string_view(sample).substr(0, sample.size() - suffix.size()));
      if (it != families_.end() && it->second->type() == MetricType::Histogram) {
        return absl::AlreadyExistsError(absl::StrCat("metric '", name, "' clashes with the ",
                                                     suffix, " series of histogram '", it->first,
                                                     "'"));
      }
    }
  }
  return absl::OkStatus();
}

template <typename Family>
absl::StatusOr<Family*> MetricsRegistry::Register(MetricType type, absl::string_view name,
                                                  absl::string_view help,
                                                  absl::Span<const absl::string_view> label_names,
                                                  size_t max_series,
                                                  absl::Span<const double> bounds) {
  if (absl::Status s = ValidateFamily(type, name, help); !s.ok()) return s;
  if (absl::Status s = ValidateLabelNames(name, label_names); !s.ok()) return s;
  if (max_series == 0) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "': max_series must be > 0"));
  }
  std::vector<double> bounds_owned(bounds.begin(), bounds.end());
  if (!bounds_owned.empty() && bounds_owned.back() == std::numeric_limits<double>::infinity())
    bounds_owned.pop_back();
  for (size_t i = 0; i < bounds_owned.size(); ++i) {
    if (!std::isfinite(bounds_owned[i]) || (i > 0 && !(bounds_owned[i - 1] < bounds_owned[i]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram '", name, "': bucket bounds must be finite and strictly increasing"));
    }
  }
  std::vector<std::string> labels(label_names.begin(), label_names.end());

  absl::MutexLock lock(&mu_);
  if (auto it = families_.find(name); it != families_.end()) {
    auto* existing = dynamic_cast<Family*>(it->second.get());
    if (existing == nullptr || existing->type() != type) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric '", name, "' is already registered as another type (",
                       TypeName(it->second->type()),
                       dynamic_cast<CallbackGauge*>(it->second.get()) ? ", callback" : "", ")"));
    }
    if (existing->label_names() != labels) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric '", name, "' is already registered with other label names"));
    }
    if (!std::equal(existing->bounds().begin(), existing->bounds().end(), bounds_owned.begin(),
                    bounds_owned.end())) {
      return absl::AlreadyExistsError(
          absl::StrCat("histogram '", name, "' is already registered with other bucket bounds"));
    }
    return existing;
  }
  if (absl::Status s = CheckSampleNamesFree(name, type); !s.ok()) return s;
  auto family = std::make_unique<Family>(std::string(name), std::string(help), type,
                                         std::move(labels), max_series, std::move(bounds_owned));
  Family* raw = family.get();
  families_.emplace(std::string(name), std::move(family));
  return raw;
}

absl::StatusOr<CounterFamily*> MetricsRegistry::RegisterCounter(
    absl::string_view name, absl::string_view help, absl::Span<const absl::string_view> label_names,
    size_t max_series) {
  return Register<CounterFamily>(MetricType::Counter, name, help, label_names, max_series, {});
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::RegisterGauge(
    absl::string_view name, absl::string_view help, absl::Span<const absl::string_view> label_names,
    size_t max_series) {
  return Register<GaugeFamily>(MetricType::Gauge, name, help, label_names, max_series, {});
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::RegisterHistogram(
    absl::string_view name, absl::string_view help, absl::Span<const absl::string_view> label_names,
    absl::Span<const double> bounds, size_t max_series) {
  return Register<HistogramFamily>(MetricType::Histogram, name, help, label_names, max_series,
                                   bounds);
}

absl::StatusOr<CollectorId> MetricsRegistry::AddCallbackGauge(absl::string_view name,
                                                              absl::string_view help,
                                                              std::function<double()> value) {
  if (absl::Status s = ValidateFamily(MetricType::Gauge, name, help); !s.ok()) return s;
  if (!value) {
    return absl::InvalidArgumentError(absl::StrCat("callback gauge '", name, "' has no callback"));
  }
  absl::MutexLock scrape_lock(&scrape_mu_);
  absl::MutexLock lock(&mu_);
  if (families_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("metric '", name, "' is already registered"));
  }
  if (absl::Status s = CheckSampleNamesFree(name, MetricType::Gauge); !s.ok()) return s;
  families_.emplace(std::string(name), std::make_unique<CallbackGauge>(
                                           std::string(name), std::string(help), std::move(value)));
  const CollectorId id = next_id_++;
  callback_gauges_.emplace(id, std::string(name));
  return id;
}

CollectorId MetricsRegistry::AddCollector(std::function<void(MetricWriter&)> collect) {
  absl::MutexLock lock(&scrape_mu_);
  const CollectorId id = next_id_++;
  collectors_.push_back({id, std::move(collect)});
  return id;
}

void MetricsRegistry::RemoveCollector(CollectorId id) {
  absl::MutexLock scrape_lock(&scrape_mu_);
  std::erase_if(collectors_, [id](const Collector& c) { return c.id == id; });
  if (auto it = callback_gauges_.find(id); it != callback_gauges_.end()) {
    absl::MutexLock lock(&mu_);
    families_.erase(it->second);
    callback_gauges_.erase(it);
  }
}

std::vector<prometheus::MetricFamily> MetricsRegistry::Collect() const {
  absl::MutexLock scrape_lock(&scrape_mu_);
  // Families are never removed while scrape_mu_ is held (only callback gauges are removed, and
  // under it), so the pointers stay valid after mu_ is released.
  std::vector<const MetricFamilyBase*> registered;
  {
    absl::ReaderMutexLock lock(&mu_);
    registered.reserve(families_.size());
    for (const auto& [name, family] : families_) registered.push_back(family.get());
  }
  std::map<std::string, prometheus::MetricFamily> families;  // by name: the exposition's order
  std::set<std::string> reserved;
  for (const MetricFamilyBase* family : registered) {
    reserved.insert(family->name());
    for (std::string& sample : SampleNames(family->name(), family->type())) {
      reserved.insert(std::move(sample));
    }
    for (prometheus::MetricFamily& f : family->Collect()) families.emplace(f.name, std::move(f));
  }
  MetricWriter writer(&families, &reserved);
  for (const Collector& c : collectors_) c.collect(writer);
  if (writer.dropped_ > 0) {
    KVLOG(Warn, "metrics collectors wrote invalid samples; dropped",
          {{"dropped", writer.dropped_}, {"first_reason", writer.first_drop_reason_}});
  }
  std::vector<prometheus::MetricFamily> out;
  out.reserve(families.size());
  for (auto& [name, family] : families) out.push_back(std::move(family));
  return out;
}

std::string MetricsRegistry::Scrape() const { return TextExposition().Serialize(Collect()); }

MetricsRegistry& DefaultRegistry() {
  static MetricsRegistry* const registry = new MetricsRegistry();
  return *registry;
}

}  // namespace kvcellar::server
