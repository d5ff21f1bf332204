// JsonObject: the one-line JSON objects the command-line tools print (kvcellar-engine-sim's
// results, kvcellar-bench's summary): fields in insertion order, strings escaped.
//
// Threads: a value type; no sharing.
#ifndef KVCELLAR_CLIENT_TOOLS_JSON_OBJECT_H_
#define KVCELLAR_CLIENT_TOOLS_JSON_OBJECT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace kvcellar::tools {

class JsonObject {
 public:
  JsonObject& Num(absl::string_view k, uint64_t v) { return Raw(k, absl::StrCat(v)); }
  // Six significant digits.
  JsonObject& Real(absl::string_view k, double v) { return Raw(k, absl::StrFormat("%.6g", v)); }
  JsonObject& Bool(absl::string_view k, bool v) { return Raw(k, v ? "true" : "false"); }
  JsonObject& Str(absl::string_view k, absl::string_view v) { return Raw(k, Quote(v)); }
  JsonObject& Obj(absl::string_view k, const JsonObject& j) { return Raw(k, j.Dump()); }
  // `v` is already JSON (a number, an array, an object).
  JsonObject& Raw(absl::string_view k, absl::string_view v) {
    fields_.push_back(absl::StrCat(Quote(k), ": ", v));
    return *this;
  }
  std::string Dump() const { return absl::StrCat("{", absl::StrJoin(fields_, ", "), "}"); }

  static std::string Quote(absl::string_view v) {
    std::string q = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        q += absl::StrFormat("\\u%04x", c);
      } else {
        q += c;
      }
    }
    return q + "\"";
  }

 private:
  std::vector<std::string> fields_;
};

}  // namespace kvcellar::tools

#endif  // KVCELLAR_CLIENT_TOOLS_JSON_OBJECT_H_
