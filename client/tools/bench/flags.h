// Flags of kvcellar-bench: a table of named flags that parses argv, checks every value, and
// writes the --help text from the same table, so the help always shows the real defaults.
//
// Every error names the flag: "--clients: 'x' is not a non-negative integer", "unknown flag
// --clinets". Threading: used by main() only.
#ifndef KVCELLAR_CLIENT_TOOLS_BENCH_FLAGS_H_
#define KVCELLAR_CLIENT_TOOLS_BENCH_FLAGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvcellar::bench {

class Flags {
 public:
  // A flag with a value. `dflt` is shown in --help ("" shows nothing); `help` may hold newlines;
  // `metavar` names the value in --help.
  void Define(const std::string& name, const std::string& dflt, const std::string& help,
              const std::string& metavar = "N");
  // A flag without a value (--name sets it).
  void DefineBool(const std::string& name, const std::string& help);
  // A heading in --help before the flags defined next.
  void Section(const std::string& title);

  // Parses argv. Values come as "--name VALUE" or "--name=VALUE". A flag named in
  // optional_value may stand alone ("--json") or take a value that does not start with "--".
  absl::Status Parse(int argc, char** argv, const std::vector<std::string>& optional_value);

  bool help() const { return help_; }
  std::string HelpText() const;

  bool Given(const std::string& name) const { return values_.count(name) > 0; }
  std::string Str(const std::string& name) const;
  bool Bool(const std::string& name) const { return Given(name); }
  // The value (or the default) as a number; InvalidArgument naming the flag when it is not one,
  // or outside [min, max].
  absl::Status U64(const std::string& name, uint64_t min, uint64_t max, uint64_t* out) const;
  absl::Status Double(const std::string& name, double min, double max, double* out) const;

 private:
  struct Def {
    std::string dflt;
    std::string help;
    std::string metavar;
    bool is_bool = false;
  };
  std::map<std::string, Def> defs_;
  std::vector<std::string> order_;  // Names and "#section" lines, in definition order.
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_CLIENT_TOOLS_BENCH_FLAGS_H_
