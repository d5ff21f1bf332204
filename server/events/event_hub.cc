#include "server/events/event_hub.h"

#include <unistd.h>
#include <zmq.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "platform/log.h"

namespace kvcellar::server {
namespace {

// Keys in one batch at most: a Backup of a long prompt becomes several batches, none so large
// that a subscriber's buffer or the replay buffer holds a few huge messages.
constexpr size_t kMaxKeysPerBatch = 4096;

std::array<uint8_t, 8> BigEndian(uint64_t v) {
  std::array<uint8_t, 8> out;
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<uint8_t>(v & 0xff);
    v >>= 8;
  }
  return out;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

// vLLM's rule (ZmqEventPublisher._is_bind_endpoint): bind wildcard, ipc and inproc endpoints;
// connect to the rest (a subscriber that binds, e.g. a central indexer).
bool IsBindEndpoint(const std::string& endpoint) {
  return absl::StrContains(endpoint, "*") || absl::StrContains(endpoint, "::") ||
         absl::StartsWith(endpoint, "ipc://") || absl::StartsWith(endpoint, "inproc://");
}

std::string LastEndpoint(void* socket) {
  char buf[512] = {};
  size_t len = sizeof(buf);
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buf, &len) != 0) return "";
  return std::string(buf, strnlen(buf, sizeof(buf)));
}

// Sends frames as one multipart message; false when ZMQ refused (e.g. a full ROUTER queue).
bool SendMultipart(void* socket, std::initializer_list<std::string_view> frames) {
  size_t i = 0;
  for (std::string_view f : frames) {
    const int flags = ZMQ_DONTWAIT | (++i < frames.size() ? ZMQ_SNDMORE : 0);
    if (zmq_send(socket, f.data(), f.size(), flags) < 0) return false;
  }
  return true;
}

std::string_view AsView(const std::array<uint8_t, 8>& a) {
  return {reinterpret_cast<const char*>(a.data()), a.size()};
}

}  // namespace

class EventHub::NamespaceSink : public core::IndexEventSink {
 public:
  NamespaceSink(EventHub* hub, uint32_t ns_id, std::string topic, const core::NamespaceSpec& spec)
      : hub_(hub),
        ns_id_(ns_id),
        topic_(std::move(topic)),
        tenant_(spec.tenant),
        model_id_(spec.model_id),
        block_size_(spec.page_size),
        groups_(spec.Hybrid() ? spec.groups : std::vector<core::KvGroup>{}) {}

  void OnIndexEvent(const core::IndexEvent& event) override {
    if (hub_->Active()) hub_->Push(this, event, /*cleared=*/false);
  }

  uint32_t ns_id() const { return ns_id_; }
  const std::string& topic() const { return topic_; }
  const std::string& tenant() const { return tenant_; }
  const std::string& model_id() const { return model_id_; }
  uint32_t block_size() const { return block_size_; }
  // A hybrid model's KV groups (empty otherwise): what an event of group g says about it.
  const std::vector<core::KvGroup>& groups() const { return groups_; }

 private:
  EventHub* const hub_;
  const uint32_t ns_id_;
  const std::string topic_;
  const std::string tenant_;
  const std::string model_id_;
  const uint32_t block_size_;
  const std::vector<core::KvGroup> groups_;
};

EventHub::EventHub(EventHubOptions options) : options_(std::move(options)) {
  next_seq_ = options_.first_seq.has_value()
                  ? *options_.first_seq
                  : static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  media_.push_back("CPU");
  locality_.push_back("LOCAL");
  for (size_t t = 0; t < options_.l3_tiers.size(); ++t) {
    const EventHubOptions::L3Tier& tier = options_.l3_tiers[t];
    media_.push_back(options_.per_tier_media ? absl::StrCat("STORAGE:", tier.name) : "STORAGE");
    locality_.push_back(tier.shared ? "REMOTE" : "LOCAL");
    (tier.shared ? shared_tiers_ : local_tiers_) |= static_cast<uint8_t>(1u << t);
  }
}

absl::StatusOr<std::unique_ptr<EventHub>> EventHub::Start(EventHubOptions options) {
  std::unique_ptr<EventHub> hub(new EventHub(std::move(options)));
  if (absl::Status s = hub->OpenSockets(); !s.ok()) return s;
  hub->thread_ = std::thread([h = hub.get()] { h->Run(); });
  if (!hub->bound_endpoint_.empty()) {
    KVLOG(Info, "events publishing",
          {{"endpoint", hub->bound_endpoint_},
           {"replay_endpoint", hub->bound_replay_endpoint_},
           {"topic", hub->options_.topic}});
  }
  return hub;
}

absl::Status EventHub::OpenSockets() {
  if (options_.endpoint.empty() && options_.replay_endpoint.empty()) return absl::OkStatus();
  zmq_ = zmq_ctx_new();
  if (zmq_ == nullptr) return absl::InternalError("events: zmq_ctx_new failed");
  if (!options_.endpoint.empty()) {
    pub_ = zmq_socket(zmq_, ZMQ_PUB);
    const int hwm = static_cast<int>(options_.hwm);
    zmq_setsockopt(pub_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    const int linger = 0;
    zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof(linger));
    const bool bind = IsBindEndpoint(options_.endpoint);
    const int rc = bind ? zmq_bind(pub_, options_.endpoint.c_str())
                        : zmq_connect(pub_, options_.endpoint.c_str());
    if (rc != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("events.endpoint: ", bind ? "bind " : "connect ", options_.endpoint, ": ",
                       zmq_strerror(zmq_errno())));
    }
    bound_endpoint_ = bind ? LastEndpoint(pub_) : options_.endpoint;
  }
  if (!options_.replay_endpoint.empty()) {
    replay_ = zmq_socket(zmq_, ZMQ_ROUTER);
    // As vLLM: room for a whole replay and its end marker.
    const int hwm = static_cast<int>(2 * (options_.buffer_steps + 1));
    zmq_setsockopt(replay_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    const int linger = 0;
    zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(replay_, options_.replay_endpoint.c_str()) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("events.replay_endpoint: bind ",
                                                     options_.replay_endpoint, ": ",
                                                     zmq_strerror(zmq_errno())));
    }
    bound_replay_endpoint_ = LastEndpoint(replay_);
  }
  return absl::OkStatus();
}

EventHub::~EventHub() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stop_ = true;
    }
    queue_cv_.notify_all();
    thread_.join();
  }
  if (pub_ != nullptr) zmq_close(pub_);
  if (replay_ != nullptr) zmq_close(replay_);
  if (zmq_ != nullptr) zmq_ctx_term(zmq_);
}

bool EventHub::Active() const {
  return pub_ != nullptr || watcher_count_.load(std::memory_order_relaxed) > 0;
}

core::IndexEventSink* EventHub::SinkFor(uint32_t ns_id, const core::NamespaceSpec& spec) {
  const std::string node = options_.node.empty() ? HostName() : options_.node;
  std::string topic = absl::StrReplaceAll(
      options_.topic, {{"{node}", node}, {"{tenant}", spec.tenant}, {"{model}", spec.model_id}});
  NamespaceSink* sink;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sinks_.push_back(std::make_unique<NamespaceSink>(this, ns_id, std::move(topic), spec));
    sink = sinks_.back().get();
  }
  if (Active()) Push(sink, core::IndexEvent{}, /*cleared=*/true);
  return sink;
}

void EventHub::Push(const NamespaceSink* sink, const core::IndexEvent& event, bool cleared) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (queue_.size() >= static_cast<size_t>(options_.max_queue_size)) {
    ++lost_;
    return;
  }
  queue_.push_back(Pending{sink, event, cleared});
}

uint64_t EventHub::Watch(EventWatcher* watcher, std::optional<uint64_t> from_seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (from_seq.has_value()) {
    for (const auto& b : buffer_) {
      if (b->seq >= *from_seq) watcher->Offer(b);
    }
  }
  watchers_.insert(watcher);
  watcher_count_.store(static_cast<int>(watchers_.size()), std::memory_order_relaxed);
  return next_seq_;
}

void EventHub::Unwatch(EventWatcher* watcher) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.erase(watcher);
  watcher_count_.store(static_cast<int>(watchers_.size()), std::memory_order_relaxed);
}

void EventHub::Run() {
  const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.batch_interval));
  for (;;) {
    if (replay_ != nullptr) {
      zmq_pollitem_t item{replay_, 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, timeout_ms) > 0 && (item.revents & ZMQ_POLLIN) != 0) ServeReplay();
    } else {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return stop_; });
    }
    bool stop;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stop = stop_;
    }
    Flush();
    if (stop) return;
    Heartbeat();
  }
}

void EventHub::Heartbeat() {
  if (pub_ == nullptr || options_.heartbeat <= absl::ZeroDuration()) return;
  std::shared_ptr<KvEventBatch> beat;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (buffer_.empty()) return;  // Nothing published yet: nothing a subscriber could miss.
    const KvEventBatch& last = *buffer_.back();
    const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
    if (now - last.ts < absl::ToDoubleSeconds(options_.heartbeat)) return;
    beat = std::make_shared<KvEventBatch>();
    beat->ts = now;
    beat->topic = last.topic;
    beat->ns_id = last.ns_id;
    beat->tenant = last.tenant;
    beat->model_id = last.model_id;
  }
  beat->payload = EncodeKvEventBatch(beat->ts, {}, options_.int_hashes);
  Publish(std::move(beat));
}

void EventHub::Flush() {
  std::vector<Pending> pending;
  uint64_t lost;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    pending.swap(queue_);
    lost = lost_;
    lost_ = 0;
  }
  if (lost > 0) {
    // Subscribers see the gap, which no replay fills (the events never made a batch), and then
    // an AllBlocksCleared per namespace, after what was queued before the loss: a subscriber
    // forgets this node's pages and relearns them from later events, so its index may miss pages
    // for a while but never names one that is gone.
    dropped_.fetch_add(lost, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    ++next_seq_;
    for (const auto& sink : sinks_) pending.push_back(Pending{sink.get(), {}, true});
    KVLOG(Warn, "events dropped", {{"events", lost}, {"max_queue_size", options_.max_queue_size}});
  }
  if (pending.empty()) return;

  // Per namespace, in order of first appearance: the batches being built, and the keys in the
  // last one.
  struct Builder {
    std::vector<std::shared_ptr<KvEventBatch>> list;
    size_t keys = 0;
  };
  std::vector<const NamespaceSink*> order;
  absl::flat_hash_map<const NamespaceSink*, Builder> batches;
  const double ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  size_t published = 0;
  for (const Pending& p : pending) {
    if (!p.cleared && !Announced(p.event)) continue;
    ++published;
    const NamespaceSink* sink = p.sink;
    auto [it, fresh] = batches.try_emplace(sink);
    if (fresh) order.push_back(sink);
    Builder& builder = it->second;
    if (builder.list.empty() || builder.keys >= kMaxKeysPerBatch) {
      auto b = std::make_shared<KvEventBatch>();
      b->ts = ts;
      b->topic = sink->topic();
      b->ns_id = sink->ns_id();
      b->tenant = sink->tenant();
      b->model_id = sink->model_id();
      builder.list.push_back(std::move(b));
      builder.keys = 0;
    }
    std::vector<KvEvent>& events = builder.list.back()->events;
    if (p.cleared) {
      events.emplace_back().kind = KvEvent::Kind::kAllBlocksCleared;
      continue;
    }
    const core::IndexEvent& e = p.event;
    const KvEvent::Kind kind = e.kind == core::IndexEvent::Kind::kStored
                                   ? KvEvent::Kind::kBlockStored
                                   : KvEvent::Kind::kBlockRemoved;
    const std::string& medium = media_[static_cast<size_t>(e.medium + 1)];
    KvEvent* last = events.empty() ? nullptr : &events.back();
    // A stored event's token_ids cover all its pages or none.
    const bool tokens =
        kind == KvEvent::Kind::kBlockStored && e.label != nullptr && !e.label->tokens.empty();
    const bool extends =
        last != nullptr && last->kind == kind && last->medium == medium &&
        last->locality == locality_[static_cast<size_t>(e.medium + 1)] && last->group == e.group &&
        (kind == KvEvent::Kind::kBlockRemoved ||
         (e.has_parent && last->keys.back() == e.parent && last->token_ids.empty() != tokens));
    if (!extends) {
      KvEvent ev;
      ev.kind = kind;
      ev.medium = medium;
      ev.locality = locality_[static_cast<size_t>(e.medium + 1)];
      ev.group = e.group;
      if (kind == KvEvent::Kind::kBlockStored) {
        if (e.has_parent) {
          ev.parent = e.parent;
          ev.parent_hash = e.parent_hash;
        }
        ev.block_size = sink->block_size();
        if (e.group >= 0 && static_cast<size_t>(e.group) < sink->groups().size()) {
          ev.group_kind = sink->groups()[e.group].kind;
          ev.sliding_window = sink->groups()[e.group].window_tokens;
        }
      }
      events.push_back(std::move(ev));
      last = &events.back();
    }
    last->keys.push_back(e.key);
    last->hashes.push_back(e.hash);
    if (tokens) {
      last->token_ids.insert(last->token_ids.end(), e.label->tokens.begin(), e.label->tokens.end());
    }
    ++builder.keys;
  }
  for (const NamespaceSink* sink : order) {
    for (std::shared_ptr<KvEventBatch>& b : batches[sink].list) {
      b->payload = EncodeKvEventBatch(b->ts, b->events, options_.int_hashes);
      Publish(std::move(b));
    }
  }
  events_.fetch_add(published, std::memory_order_relaxed);
}

bool EventHub::Announced(const core::IndexEvent& e) const {
  if (e.medium < 0 || options_.per_tier_media) return true;
  // "STORAGE" of a locality: stored when its first tier holds the page, removed when its last
  // lets it go; what the other tiers of that kind do in between is no news.
  const uint8_t kind_tiers = (shared_tiers_ >> e.medium & 1) != 0 ? shared_tiers_ : local_tiers_;
  const uint8_t left = e.l3_tiers & kind_tiers;
  return e.kind == core::IndexEvent::Kind::kStored ? left == (1u << e.medium) : left == 0;
}

void EventHub::Publish(std::shared_ptr<KvEventBatch> batch) {
  std::lock_guard<std::mutex> lock(mu_);
  batch->seq = next_seq_++;
  std::shared_ptr<const KvEventBatch> b = std::move(batch);
  if (pub_ != nullptr) {
    // PUB never blocks: past the high-water mark ZMQ drops the message for that subscriber.
    SendMultipart(pub_, {b->topic, AsView(BigEndian(b->seq)), b->payload});
  }
  buffer_.push_back(b);
  while (buffer_.size() > static_cast<size_t>(options_.buffer_steps)) buffer_.pop_front();
  for (EventWatcher* w : watchers_) w->Offer(b);
  batches_.fetch_add(1, std::memory_order_relaxed);
}

void EventHub::ServeReplay() {
  // vLLM's replay request: [client id, empty, start seq big-endian]; anything else is ignored.
  std::vector<std::string> frames;
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&msg);
      return;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    const bool more = zmq_msg_more(&msg) != 0;
    zmq_msg_close(&msg);
    if (!more) break;
  }
  if (frames.size() != 3 || frames[2].empty() || frames[2].size() > 8) {
    // Counted; logged at most once a minute, so that a broken or hostile client cannot flood
    // the log.
    const uint64_t rejected = replays_rejected_.fetch_add(1, std::memory_order_relaxed) + 1;
    const absl::Time now = absl::Now();
    if (now - last_reject_log_ >= absl::Minutes(1)) {
      last_reject_log_ = now;
      KVLOG(Warn, "events replay request ignored",
            {{"frames", frames.size()}, {"rejected_total", rejected}});
    }
    return;
  }
  uint64_t start = 0;
  for (char c : frames[2]) start = (start << 8) | static_cast<uint8_t>(c);
  replays_.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::shared_ptr<const KvEventBatch>> replay;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& b : buffer_) {
      if (b->seq >= start) replay.push_back(b);
    }
  }
  const std::string& id = frames[0];
  for (const auto& b : replay) {
    if (!SendMultipart(replay_, {id, "", b->topic, AsView(BigEndian(b->seq)), b->payload})) return;
  }
  SendMultipart(replay_, {id, "", "", AsView(BigEndian(~uint64_t{0})), ""});
}

void EventHub::Collect(MetricWriter& out) const {
  out.AddCounter("kvcellar_events_batches_total",
                 "KV event batches published (ZMQ, replay buffer, WatchEvents).",
                 static_cast<double>(batches_.load(std::memory_order_relaxed)));
  out.AddCounter("kvcellar_events_total",
                 "Index events (a page stored or removed in a medium) "
                 "published.",
                 static_cast<double>(events_.load(std::memory_order_relaxed)));
  out.AddCounter("kvcellar_events_dropped_total",
                 "Index events dropped because the queue was full (events.max_queue_size).",
                 static_cast<double>(dropped_.load(std::memory_order_relaxed)));
  out.AddCounter("kvcellar_events_replays_total",
                 "Replay requests served (events.replay_endpoint).",
                 static_cast<double>(replays_.load(std::memory_order_relaxed)));
  out.AddCounter("kvcellar_events_replays_rejected_total",
                 "Malformed replay requests ignored (not [empty frame, start seq of 1-8 bytes]).",
                 static_cast<double>(replays_rejected_.load(std::memory_order_relaxed)));
  out.AddGauge("kvcellar_events_watchers", "Open WatchEvents streams.",
               static_cast<double>(watcher_count_.load(std::memory_order_relaxed)));
}

}  // namespace kvcellar::server
