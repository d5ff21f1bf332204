#include "server/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// 2^53: every integer of at most this magnitude is exact in a double, so it prints as an integer.
constexpr double kMaxExactInteger = 9007199254740992.0;

// Go's strconv.FormatFloat(v, 'g', -1, 64) switches to exponent notation at 10^6 for values it
// does not print as integers; Go clients format `le` this way, and so do we.
constexpr int kExponentNotationFrom = 6;
constexpr int kExponentNotationBelow = -4;

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

bool IsValidUtf8(absl::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SequenceLength(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

bool IsReservedLabel(absl::string_view name) {
  return std::find(std::begin(kReservedLabels), std::end(kReservedLabels), name) !=
         std::end(kReservedLabels);
}

absl::string_view TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
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
  if (type == MetricType::kCounter && !total) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter '", name, "' must end in _total (Prometheus naming)"));
  }
  if (type != MetricType::kCounter && total) {
    return absl::InvalidArgumentError(
        absl::StrCat(TypeName(type), " '", name, "' must not end in _total: only counters do"));
  }
  if (type == MetricType::kHistogram) {
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

// `a="x",b="y"`, values sanitized and escaped.
std::string RenderLabels(absl::Span<const std::string> names,
                         absl::Span<const std::string> values) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", names[i], "=\"",
                    metrics_internal::EscapeLabelValue(values[i]), "\"");
  }
  return out;
}

std::vector<std::string> SampleNames(absl::string_view name, MetricType type) {
  std::vector<std::string> names;
  if (type == MetricType::kHistogram) {
    for (absl::string_view suffix : kHistogramSuffixes) names.push_back(absl::StrCat(name, suffix));
  } else {
    names.emplace_back(name);
  }
  return names;
}

void RenderFamily(const metrics_internal::FamilySnapshot& family, std::string* out) {
  absl::StrAppend(out, "# HELP ", family.name, " ", metrics_internal::EscapeHelp(family.help),
                  "\n# TYPE ", family.name, " ", TypeName(family.type), "\n");
  for (const metrics_internal::Sample& s : family.samples) {
    absl::StrAppend(out, family.name, s.suffix);
    if (!s.labels.empty()) absl::StrAppend(out, "{", s.labels, "}");
    absl::StrAppend(out, " ", s.value, "\n");
  }
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

// --- Formatting and validation ----------------------------------------------------------------

namespace metrics_internal {

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::trunc(v) && std::fabs(v) <= kMaxExactInteger) {
    return absl::StrCat(static_cast<int64_t>(v));  // -0.0 prints as 0
  }
  // Shortest round-trip digits, as d[.ddd]e±XX.
  char buf[64];
  const std::to_chars_result r =
      std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  if (r.ec != std::errc()) return absl::StrCat(v);  // cannot happen with 64 bytes
  const absl::string_view sci(buf, r.ptr - buf);
  const size_t e = sci.find('e');
  int exp = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exp);
  if (exp < kExponentNotationBelow || exp >= kExponentNotationFrom) return std::string(sci);

  // Fixed notation from the same digits.
  std::string digits;
  const bool negative = sci[0] == '-';
  for (char c : sci.substr(negative ? 1 : 0, e - (negative ? 1 : 0))) {
    if (c != '.') digits.push_back(c);
  }
  std::string out = negative ? "-" : "";
  if (exp < 0) {
    absl::StrAppend(&out, "0.", std::string(-exp - 1, '0'), digits);
  } else {
    const size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_digits) {
      absl::StrAppend(&out, digits, std::string(int_digits - digits.size(), '0'));
    } else {
      absl::StrAppend(&out, absl::string_view(digits).substr(0, int_digits), ".",
                      absl::string_view(digits).substr(int_digits));
    }
  }
  return out;
}

std::string EscapeLabelValue(absl::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
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
  const auto head = [](char c) { return absl::ascii_isalpha(c) || c == '_' || c == ':'; };
  const auto tail = [&](char c) { return head(c) || absl::ascii_isdigit(c); };
  if (name.empty() || !head(name[0]) || !std::all_of(name.begin() + 1, name.end(), tail)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name '", name, "' is invalid: must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(absl::string_view name) {
  const auto head = [](char c) { return absl::ascii_isalpha(c) || c == '_'; };
  const auto tail = [&](char c) { return head(c) || absl::ascii_isdigit(c); };
  if (name.empty() || !head(name[0]) || !std::all_of(name.begin() + 1, name.end(), tail)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label name '", name, "' is invalid: must match [a-zA-Z_][a-zA-Z0-9_]*"));
  }
  if (absl::StartsWith(name, "__")) {
    return absl::InvalidArgumentError(
        absl::StrCat("label name '", name, "' is invalid: names starting with __ are reserved"));
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
void MetricFamily<T>::Snapshot(metrics_internal::FamilySnapshot* out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [values, series] : series_) {
    std::string labels = RenderLabels(label_names(), values);
    if constexpr (std::is_same_v<T, Counter>) {
      const double fractional = series->FractionalPart();
      out->samples.push_back({"", std::move(labels),
                              fractional == 0 ? absl::StrCat(series->IntegerPart())
                                              : metrics_internal::FormatValue(series->Value())});
    } else if constexpr (std::is_same_v<T, Gauge>) {
      out->samples.push_back(
          {"", std::move(labels), metrics_internal::FormatValue(series->Value())});
    } else {
      const absl::string_view sep = labels.empty() ? "" : ",";
      uint64_t cumulative = 0;
      for (size_t i = 0; i < series->bucket_count(); ++i) {
        cumulative += series->BucketCount(i);
        const std::string le =
            i < bounds_.size() ? metrics_internal::FormatValue(bounds_[i]) : "+Inf";
        out->samples.push_back(
            {"_bucket", absl::StrCat(labels, sep, "le=\"", le, "\""), absl::StrCat(cumulative)});
      }
      out->samples.push_back({"_sum", labels, metrics_internal::FormatValue(series->Sum())});
      out->samples.push_back({"_count", std::move(labels), absl::StrCat(cumulative)});
    }
  }
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

// An unlabeled gauge evaluated at scrape time.
class MetricsRegistry::CallbackGauge final : public MetricFamilyBase {
 public:
  CallbackGauge(std::string name, std::string help, std::function<double()> value)
      : MetricFamilyBase(std::move(name), std::move(help), MetricType::kGauge, {}),
        value_(std::move(value)) {}

 private:
  void Snapshot(metrics_internal::FamilySnapshot* out) const override {
    out->samples.push_back({"", "", metrics_internal::FormatValue(value_())});
  }

  const std::function<double()> value_;
};

// --- Collector output -------------------------------------------------------------------------

void MetricWriter::AddCounter(absl::string_view name, absl::string_view help, double value,
                              absl::Span<const Label> labels) {
  Add(MetricType::kCounter, name, help, value, labels);
}

void MetricWriter::AddGauge(absl::string_view name, absl::string_view help, double value,
                            absl::Span<const Label> labels) {
  Add(MetricType::kGauge, name, help, value, labels);
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
  std::vector<std::string> names_owned;
  std::vector<std::string> values;
  for (const Label& l : labels) {
    names.push_back(l.name);
    names_owned.emplace_back(l.name);
    values.push_back(metrics_internal::SanitizeUtf8(l.value));
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
  std::string rendered = RenderLabels(names_owned, values);
  if (!series_seen_.insert(absl::StrCat(name, "{", rendered, "}")).second) {
    return Drop(absl::StrCat("collector metric '", name, "' repeats the series {", rendered, "}"));
  }
  if (it == families_->end()) {
    metrics_internal::FamilySnapshot family;
    family.name = std::string(name);
    family.help = std::string(help);
    family.type = type;
    it = families_->emplace(family.name, std::move(family)).first;
  }
  it->second.samples.push_back({"", std::move(rendered), metrics_internal::FormatValue(value)});
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
      if (it != families_.end() && it->second->type() == MetricType::kHistogram) {
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
  return Register<CounterFamily>(MetricType::kCounter, name, help, label_names, max_series, {});
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::RegisterGauge(
    absl::string_view name, absl::string_view help, absl::Span<const absl::string_view> label_names,
    size_t max_series) {
  return Register<GaugeFamily>(MetricType::kGauge, name, help, label_names, max_series, {});
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::RegisterHistogram(
    absl::string_view name, absl::string_view help, absl::Span<const absl::string_view> label_names,
    absl::Span<const double> bounds, size_t max_series) {
  return Register<HistogramFamily>(MetricType::kHistogram, name, help, label_names, max_series,
                                   bounds);
}

absl::StatusOr<CollectorId> MetricsRegistry::AddCallbackGauge(absl::string_view name,
                                                              absl::string_view help,
                                                              std::function<double()> value) {
  if (absl::Status s = ValidateFamily(MetricType::kGauge, name, help); !s.ok()) return s;
  if (!value) {
    return absl::InvalidArgumentError(absl::StrCat("callback gauge '", name, "' has no callback"));
  }
  absl::MutexLock scrape_lock(&scrape_mu_);
  absl::MutexLock lock(&mu_);
  if (families_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("metric '", name, "' is already registered"));
  }
  if (absl::Status s = CheckSampleNamesFree(name, MetricType::kGauge); !s.ok()) return s;
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

std::string MetricsRegistry::Scrape() {
  absl::MutexLock scrape_lock(&scrape_mu_);
  // Families are never removed while scrape_mu_ is held (only callback gauges are removed, and
  // under it), so the pointers stay valid after mu_ is released.
  std::vector<const MetricFamilyBase*> registered;
  {
    absl::ReaderMutexLock lock(&mu_);
    registered.reserve(families_.size());
    for (const auto& [name, family] : families_) registered.push_back(family.get());
  }
  std::map<std::string, metrics_internal::FamilySnapshot> families;
  std::set<std::string> reserved;
  for (const MetricFamilyBase* family : registered) {
    reserved.insert(family->name());
    for (std::string& sample : SampleNames(family->name(), family->type())) {
      reserved.insert(std::move(sample));
    }
    metrics_internal::FamilySnapshot& snapshot = families[family->name()];
    snapshot.name = family->name();
    snapshot.help = family->help();
    snapshot.type = family->type();
    family->Snapshot(&snapshot);
  }
  MetricWriter writer(&families, &reserved);
  for (const Collector& c : collectors_) c.collect(writer);
  if (writer.dropped_ > 0) {
    KVLOG(Warn, "metrics collectors wrote invalid samples; dropped",
          {{"dropped", writer.dropped_}, {"first_reason", writer.first_drop_reason_}});
  }

  std::string out;
  for (const auto& [name, family] : families) {
    // Like the Go client, a family without series (labels never used) is not written.
    if (!family.samples.empty()) RenderFamily(family, &out);
  }
  return out;
}

MetricsRegistry& DefaultRegistry() {
  static MetricsRegistry* const registry = new MetricsRegistry();
  return *registry;
}

}  // namespace kvcellar::server
