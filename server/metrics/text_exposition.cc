#include "server/metrics/text_exposition.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"

namespace kvcellar::server {
namespace {

// 2^53: every integer of at most this magnitude is exact in a double, so it prints as an integer.
constexpr double kMaxExactInteger = 9007199254740992.0;

// Go's strconv.FormatFloat(v, 'g', -1, 64) switches to exponent notation at 10^6 for values it
// does not print as integers; Go clients format `le` this way, and so do we.
constexpr int kExponentNotationFrom = 6;
constexpr int kExponentNotationBelow = -4;

// `a="x",b="y"` of one series, with `le` appended for a histogram bucket.
void AppendLabels(const std::vector<prometheus::ClientMetric::Label>& labels, absl::string_view le,
                  std::string* out) {
  if (labels.empty() && le.empty()) return;
  out->push_back('{');
  for (size_t i = 0; i < labels.size(); ++i) {
    absl::StrAppend(out, i == 0 ? "" : ",", labels[i].name, "=\"",
                    metrics_internal::EscapeLabelValue(labels[i].value), "\"");
  }
  if (!le.empty()) absl::StrAppend(out, labels.empty() ? "" : ",", "le=\"", le, "\"");
  out->push_back('}');
}

void AppendSample(absl::string_view name, absl::string_view suffix,
                  const prometheus::ClientMetric& metric, absl::string_view le,
                  absl::string_view value, std::string* out) {
  absl::StrAppend(out, name, suffix);
  AppendLabels(metric.label, le, out);
  absl::StrAppend(out, " ", value, "\n");
}

void AppendFamily(const prometheus::MetricFamily& family, std::string* out) {
  absl::StrAppend(out, "# HELP ", family.name, " ", metrics_internal::EscapeHelp(family.help),
                  "\n# TYPE ", family.name, " ", metrics_internal::TypeName(family.type), "\n");
  for (const prometheus::ClientMetric& m : family.metric) {
    switch (family.type) {
      case prometheus::MetricType::Counter:
        AppendSample(family.name, "", m, "", metrics_internal::FormatValue(m.counter.value), out);
        break;
      case prometheus::MetricType::Gauge:
        AppendSample(family.name, "", m, "", metrics_internal::FormatValue(m.gauge.value), out);
        break;
      case prometheus::MetricType::Histogram:
        // Buckets are cumulative and end with +Inf, whose count is _count.
        for (const prometheus::ClientMetric::Bucket& b : m.histogram.bucket) {
          AppendSample(family.name, "_bucket", m, metrics_internal::FormatValue(b.upper_bound),
                       absl::StrCat(b.cumulative_count), out);
        }
        AppendSample(family.name, "_sum", m, "",
                     metrics_internal::FormatValue(m.histogram.sample_sum), out);
        AppendSample(family.name, "_count", m, "", absl::StrCat(m.histogram.sample_count), out);
        break;
      case prometheus::MetricType::Summary:
      case prometheus::MetricType::Untyped:
        break;  // kvcellard makes neither
    }
  }
}

std::string Escape(absl::string_view s, bool quotes) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

std::string TextExposition::Serialize(const std::vector<prometheus::MetricFamily>& families) const {
  std::string out;
  for (const prometheus::MetricFamily& family : families) {
    if (!family.metric.empty()) AppendFamily(family, &out);
  }
  return out;
}

void TextExposition::Serialize(std::ostream& out,
                               const std::vector<prometheus::MetricFamily>& families) const {
  const std::string text = Serialize(families);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

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

std::string EscapeLabelValue(absl::string_view v) { return Escape(v, /*quotes=*/true); }

std::string EscapeHelp(absl::string_view help) { return Escape(help, /*quotes=*/false); }

absl::string_view TypeName(prometheus::MetricType type) {
  switch (type) {
    case prometheus::MetricType::Counter:
      return "counter";
    case prometheus::MetricType::Gauge:
      return "gauge";
    case prometheus::MetricType::Histogram:
      return "histogram";
    case prometheus::MetricType::Summary:
      return "summary";
    case prometheus::MetricType::Untyped:
      return "untyped";
  }
  return "untyped";
}

}  // namespace metrics_internal
}  // namespace kvcellar::server
