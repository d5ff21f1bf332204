// One Markdown table of a benchmark's summary: its title, header and rule lines, then its rows;
// nothing when there are no rows (the cases that would fill it did not run).
#ifndef KVCELLAR_TESTS_BENCH_MARKDOWN_TABLE_H_
#define KVCELLAR_TESTS_BENCH_MARKDOWN_TABLE_H_

#include <cstdio>
#include <string>
#include <vector>

namespace kvcellar::bench {

inline void PrintMarkdownTable(std::FILE* out, const char* title, const char* header,
                               const char* rule, const std::vector<std::string>& rows) {
  if (rows.empty()) return;
  std::fprintf(out, "\n%s\n\n%s\n%s\n", title, header, rule);
  for (const std::string& r : rows) std::fprintf(out, "%s\n", r.c_str());
}

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_MARKDOWN_TABLE_H_
