#include "server/config/cache_limits.h"

#include <algorithm>

#include "core/kv_layout.h"
#include "core/signal_layout.h"

namespace kvcellar::server {

CacheLimits CacheLimits::FromConfig(const Config& config) {
  CacheLimits l;
  l.max_batch_pages = static_cast<uint32_t>(config.server.max_batch_pages);
  l.max_message_bytes = config.server.max_message_bytes;
  l.default_pin_lease_ms =
      static_cast<uint32_t>(std::min<int64_t>(config.sessions.pin_lease_ms, kMaxPinLeaseMs));
  l.max_completion_slots = core::SignalLayout::kMaxSlots;
  l.max_layers = core::kMaxLayers;
  l.max_regions = core::kMaxRegions;
  l.lease_ms = static_cast<uint32_t>(config.sessions.lease_ms);
  l.heartbeat_interval_ms = std::max<uint32_t>(1, l.lease_ms / kHeartbeatsPerLease);
  l.page_tokens = config.events.page_tokens && !config.events.endpoint.empty();
  l.max_token_bytes = config.events.max_token_bytes;
  l.label_pages = !config.events.endpoint.empty();
  return l;
}

void CacheLimits::ToProto(v1::ServerLimits* out) const {
  out->set_max_batch_pages(max_batch_pages);
  out->set_max_batch_sequences(max_batch_sequences);
  out->set_max_message_bytes(max_message_bytes);
  out->set_default_pin_lease_ms(default_pin_lease_ms);
  out->set_max_pin_lease_ms(max_pin_lease_ms);
  out->set_max_wait_ms(max_wait_ms);
  out->set_max_inflight_ops(max_inflight_ops);
  out->set_max_prefetch_timeout_ms(max_prefetch_timeout_ms);
  out->set_op_result_retention_ms(op_result_retention_ms);
  out->set_max_completion_slots(max_completion_slots);
  out->set_max_layers(max_layers);
  out->set_max_regions(max_regions);
  out->set_group_match_window_ms(group_match_window_ms);
  out->set_page_tokens(page_tokens);
}

uint32_t CacheLimits::PinLeaseMs(uint32_t requested) const {
  if (requested == 0) return default_pin_lease_ms;
  return std::min(requested, max_pin_lease_ms);
}

}  // namespace kvcellar::server
