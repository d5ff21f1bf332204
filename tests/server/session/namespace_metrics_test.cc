// Tests server/session/namespace_metrics.h: per-(tenant, model) series from the namespaces'
// counters, shared across revisions, capped, with the rest summed into "other".
#include "server/session/namespace_metrics.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/component_fixtures.h"

namespace kvcellar::server::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class NamespaceMetricsTest : public ::testing::Test {
 protected:
  // A namespace of (tenant, model, revision) that saw `matches` Match calls looking up `pages`
  // pages of which `hits` hit L2.
  void AddNamespace(const std::string& tenant, const std::string& model,
                    const std::string& revision, uint64_t matches, uint64_t pages, uint64_t hits) {
    core::NamespaceSpec spec = NsSpec(1, false, model, tenant);
    spec.model_revision = revision;
    std::shared_ptr<Namespace> ns = world_.namespaces().GetOrCreate(spec);
    NamespaceCounters& c = ns->counters();
    NamespaceCounters::Add(c.match_calls, matches);
    NamespaceCounters::Add(c.lookup_pages, pages);
    NamespaceCounters::Add(c.l2_hit_pages, hits);
  }

  std::string Scrape(size_t max_series) {
    MetricsRegistry registry;
    registry.AddCollector([&](MetricWriter& out) {
      CollectNamespaceMetrics(world_.namespaces().Snapshot(), max_series, out);
    });
    return registry.Scrape();
  }

  L2World world_;
};

TEST_F(NamespaceMetricsTest, RevisionsOfOneModelShareTheirSeries) {
  AddNamespace("team-a", "llama", "rev1", 2, 10, 4);
  AddNamespace("team-a", "llama", "rev2", 3, 6, 2);
  const std::string text = Scrape(8);
  EXPECT_THAT(text, HasSubstr(
      "kvcellar_namespace_match_requests_total{tenant=\"team-a\",model=\"llama\"} 5\n"));
  // Tokens: pages times the page size.
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
      "kvcellar_namespace_lookup_tokens_total{tenant=\"team-a\",model=\"llama\"} ",
      16 * kPageSize, "\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
      "kvcellar_namespace_hit_tokens_total{tenant=\"team-a\",model=\"llama\",tier=\"l2\"} ",
      6 * kPageSize, "\n")));
}

TEST_F(NamespaceMetricsTest, PairsPastTheCapAreSummedIntoOther) {
  AddNamespace("team-a", "llama", "r", 1, 1, 0);
  AddNamespace("team-b", "qwen", "r", 2, 1, 0);
  AddNamespace("team-c", "mistral", "r", 3, 1, 0);
  const std::string text = Scrape(1);
  EXPECT_THAT(text, HasSubstr(
      "kvcellar_namespace_match_requests_total{tenant=\"team-a\",model=\"llama\"} 1\n"));
  EXPECT_THAT(text, HasSubstr(
      "kvcellar_namespace_match_requests_total{tenant=\"other\",model=\"other\"} 5\n"));
  EXPECT_THAT(text, Not(HasSubstr("team-b")));
  EXPECT_THAT(text, Not(HasSubstr("mistral")));
}

TEST_F(NamespaceMetricsTest, ACapOfZeroPutsEverythingInOther) {
  AddNamespace("team-a", "llama", "r", 4, 1, 0);
  const std::string text = Scrape(0);
  EXPECT_THAT(text, HasSubstr(
      "kvcellar_namespace_match_requests_total{tenant=\"other\",model=\"other\"} 4\n"));
  EXPECT_THAT(text, Not(HasSubstr("team-a")));
}

}  // namespace
}  // namespace kvcellar::server::testing
