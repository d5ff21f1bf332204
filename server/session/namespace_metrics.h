// Per-namespace Prometheus series, labelled {tenant, model}, with bounded cardinality.
//
// Tenants and model ids come from engines, so as labels they are unbounded in principle; in
// practice a node serves a few models. The series are written at scrape time from each
// namespace's NamespaceCounters (no work on hot paths) and bounded so:
//   - namespaces that share (tenant, model_id) (other revisions, dtypes, page sizes) share series;
//   - the first `max_series` distinct (tenant, model) pairs, in namespace creation order, get
//     series of their own; namespaces past the cap are summed into tenant="other",
//     model="other" (kOverflowLabelValue, as the registry's own overflow series).
// Namespaces are never removed, so a pair once given its series keeps it and every counter,
// overflow included, only goes up. The cap is http.max_namespace_series (0: all in "other").
//
// Threads: called by the metrics HTTP thread (a registry collector).
#ifndef KVCELLAR_SERVER_SESSION_NAMESPACE_METRICS_H_
#define KVCELLAR_SERVER_SESSION_NAMESPACE_METRICS_H_

#include <cstddef>
#include <memory>

#include "absl/types/span.h"
#include "server/metrics/metrics.h"
#include "server/session/namespace_registry.h"

namespace kvcellar::server {

// `in_creation_order`: NamespaceRegistry::Snapshot().
void CollectNamespaceMetrics(absl::Span<const std::shared_ptr<Namespace>> in_creation_order,
                             size_t max_series, MetricWriter& out);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SESSION_NAMESPACE_METRICS_H_
