#include "client/tools/bench/flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace kvcellar::bench {

void Flags::Define(const std::string& name, const std::string& dflt, const std::string& help,
                   const std::string& metavar) {
  defs_[name] = Def{dflt, help, metavar, false};
  order_.push_back(name);
}

void Flags::DefineBool(const std::string& name, const std::string& help) {
  defs_[name] = Def{"", help, "", true};
  order_.push_back(name);
}

void Flags::Section(const std::string& title) { order_.push_back("#" + title); }

absl::Status Flags::Parse(int argc, char** argv, const std::vector<std::string>& optional_value) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    auto it = defs_.find(name);
    if (it == defs_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
    if (values_.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " given twice"));
    }
    if (it->second.is_bool) {
      if (eq != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
      }
      values_.emplace(name, "1");  // (operator= of a literal trips GCC 12 -Wrestrict)
      continue;
    }
    if (eq != std::string::npos) {
      values_[name] = arg.substr(eq + 1);
      continue;
    }
    const bool optional =
        std::find(optional_value.begin(), optional_value.end(), name) != optional_value.end();
    const bool has_next = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
    if (has_next) {
      values_[name] = argv[++i];
    } else if (optional) {
      values_[name] = "";
    } else {
      return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
    }
  }
  return absl::OkStatus();
}

std::string Flags::Str(const std::string& name) const {
  if (auto it = values_.find(name); it != values_.end()) return it->second;
  auto d = defs_.find(name);
  return d == defs_.end() ? "" : d->second.dflt;
}

absl::Status Flags::U64(const std::string& name, uint64_t min, uint64_t max, uint64_t* out) const {
  const std::string v = Str(name);
  uint64_t n = 0;
  if (v.empty() || v[0] == '-' || !absl::SimpleAtoi(v, &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": '", v, "' is not a non-negative integer"));
  }
  if (n < min || n > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", n, " is out of range [", min, ", ", max, "]"));
  }
  *out = n;
  return absl::OkStatus();
}

absl::Status Flags::Double(const std::string& name, double min, double max, double* out) const {
  const std::string v = Str(name);
  double d = 0;
  if (v.empty() || !absl::SimpleAtod(v, &d) || !std::isfinite(d)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": '", v, "' is not a number"));
  }
  if (d < min || d > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", v, " is out of range [", min, ", ", max, "]"));
  }
  *out = d;
  return absl::OkStatus();
}

std::string Flags::HelpText() const {
  std::string out;
  for (const std::string& name : order_) {
    if (name[0] == '#') {
      absl::StrAppend(&out, "\n", name.substr(1), ":\n");
      continue;
    }
    const Def& d = defs_.at(name);
    std::vector<std::string> lines = absl::StrSplit(d.help, '\n');
    if (!d.dflt.empty()) absl::StrAppend(&lines.back(), " (default ", d.dflt, ")");
    std::string head = absl::StrCat("  ", name, d.is_bool ? "" : " ", d.metavar);
    if (head.size() > 22) {
      absl::StrAppend(&out, head, "\n");
      head.clear();
    }
    for (const std::string& line : lines) {
      absl::StrAppend(&out, absl::StrFormat("%-23s%s\n", head, line));
      head.clear();
    }
  }
  return out;
}

}  // namespace kvcellar::bench
