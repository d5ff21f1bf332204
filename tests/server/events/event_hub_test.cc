#include "server/events/event_hub.h"

#include <zmq.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <msgpack.hpp>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/events/kv_event_batch.h"

namespace kvcellar::server {
namespace {

core::PageKey Key(uint8_t id) {
  core::PageKey k;
  k.bytes.fill(id);
  return k;
}

core::NamespaceSpec Spec() {
  core::NamespaceSpec spec;
  spec.tenant = "team-a";
  spec.model_id = "llama";
  spec.model_revision = "r1";
  spec.kv_dtype = "bf16";
  spec.page_size = 16;
  return spec;
}

core::IndexEvent Stored(uint8_t key, int parent, int8_t medium = core::kMediumL2) {
  core::IndexEvent e;
  e.kind = core::IndexEvent::Kind::kStored;
  e.medium = medium;
  e.key = Key(key);
  if (parent >= 0) {
    e.has_parent = true;
    e.parent = Key(static_cast<uint8_t>(parent));
  }
  return e;
}

// `e` with the L3 tiers that hold its page after it (IndexEvent::l3_tiers).
core::IndexEvent AtTiers(core::IndexEvent e, uint8_t tiers_after) {
  e.l3_tiers = tiers_after;
  return e;
}

core::IndexEvent Removed(uint8_t key, int8_t medium = core::kMediumL2) {
  core::IndexEvent e;
  e.kind = core::IndexEvent::Kind::kRemoved;
  e.medium = medium;
  e.key = Key(key);
  return e;
}

class Collector : public EventWatcher {
 public:
  void Offer(const std::shared_ptr<const KvEventBatch>& batch) override {
    std::lock_guard<std::mutex> lock(mu_);
    batches_.push_back(batch);
    cv_.notify_all();
  }
  // The batches once there are at least n (or after 5 s).
  std::vector<std::shared_ptr<const KvEventBatch>> WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return batches_.size() >= n; });
    return batches_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<const KvEventBatch>> batches_;
};

EventHubOptions Options() {
  EventHubOptions o;
  o.topic = "kv@{node}@{model}";
  o.node = "node7";
  o.l3_tiers = {{"nvme", false}, {"cluster", true}};
  o.batch_interval = absl::Milliseconds(5);
  o.per_tier_media = true;
  o.first_seq = 0;
  return o;
}

TEST(EventHubTest, AnIdlePublisherSendsEmptyBatchesSoThatGapsShow) {
  EventHubOptions o = Options();
  o.endpoint = "tcp://127.0.0.1:*";
  o.heartbeat = absl::Milliseconds(50);
  auto hub = EventHub::Start(o);
  ASSERT_TRUE(hub.ok()) << hub.status();
  Collector watcher;
  (*hub)->Watch(&watcher, std::nullopt);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_TRUE(watcher.WaitFor(0).empty());  // Nothing published yet: no heartbeat either.
  (*hub)->SinkFor(1, Spec())->OnIndexEvent(Stored(1, -1));
  auto batches = watcher.WaitFor(3);
  ASSERT_GE(batches.size(), 3u);
  EXPECT_EQ(batches[0]->events.size(), 2u);  // AllBlocksCleared, BlockStored.
  for (size_t i = 1; i < batches.size(); ++i) {
    EXPECT_TRUE(batches[i]->events.empty());
    EXPECT_EQ(batches[i]->seq, batches[i - 1]->seq + 1);
    EXPECT_EQ(batches[i]->topic, "kv@node7@llama");
    EXPECT_GE(batches[i]->ts - batches[i - 1]->ts, 0.045);
    EXPECT_EQ(batches[i]->payload, EncodeKvEventBatch(batches[i]->ts, {}));
  }
  (*hub)->Unwatch(&watcher);
}

TEST(EventHubTest, ARestartedHubNumbersAboveTheLastRun) {
  // Without first_seq the first number is the start time in microseconds: above whatever an
  // earlier run published (at most one batch per millisecond), as subscribers that drop old
  // numbers need.
  EventHubOptions o = Options();
  o.first_seq.reset();
  const auto before = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  auto first = EventHub::Start(o);
  ASSERT_TRUE(first.ok()) << first.status();
  Collector watcher;
  const uint64_t seq = (*first)->Watch(&watcher, std::nullopt);
  EXPECT_GE(seq, before);
  (*first)->Unwatch(&watcher);
  first->reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  auto second = EventHub::Start(o);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_GT((*second)->Watch(&watcher, std::nullopt), seq + 1000);
  (*second)->Unwatch(&watcher);
}

TEST(EventHubTest, FoldsChainsIntoBatchesInOrder) {
  auto hub = EventHub::Start(Options());
  ASSERT_TRUE(hub.ok()) << hub.status();
  Collector watcher;
  EXPECT_EQ((*hub)->Watch(&watcher, std::nullopt), 0u);
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  // One chain into L2, the same pages into the shared tier, two removals, then a second chain
  // that does not continue the first.
  for (const core::IndexEvent& e : {Stored(1, -1), Stored(2, 1), Stored(3, 2), Stored(1, -1, 1),
                                    Stored(2, 1, 1), Removed(3), Removed(2), Stored(9, 1)}) {
    sink->OnIndexEvent(e);
  }
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);  // Queued within one interval, one namespace: one batch.
  const KvEventBatch& b = *batches[0];
  EXPECT_EQ(b.seq, 0u);
  EXPECT_EQ(b.topic, "kv@node7@llama");
  EXPECT_EQ(b.tenant, "team-a");
  ASSERT_EQ(b.events.size(), 5u);
  EXPECT_EQ(b.events[0].kind, KvEvent::Kind::kAllBlocksCleared);
  EXPECT_EQ(b.events[1].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(b.events[1].medium, "CPU");
  EXPECT_EQ(b.events[1].locality, "LOCAL");
  EXPECT_EQ(b.events[1].keys, (std::vector<core::PageKey>{Key(1), Key(2), Key(3)}));
  EXPECT_FALSE(b.events[1].parent.has_value());
  EXPECT_EQ(b.events[1].block_size, 16u);
  EXPECT_EQ(b.events[2].medium, "STORAGE:cluster");
  EXPECT_EQ(b.events[2].locality, "REMOTE");
  EXPECT_EQ(b.events[2].keys, (std::vector<core::PageKey>{Key(1), Key(2)}));
  EXPECT_EQ(b.events[3].kind, KvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(b.events[3].keys, (std::vector<core::PageKey>{Key(3), Key(2)}));
  EXPECT_EQ(b.events[4].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(b.events[4].keys, (std::vector<core::PageKey>{Key(9)}));
  ASSERT_TRUE(b.events[4].parent.has_value());
  EXPECT_EQ(*b.events[4].parent, Key(1));
  EXPECT_EQ(b.payload, EncodeKvEventBatch(b.ts, b.events));
  (*hub)->Unwatch(&watcher);
}

TEST(EventHubTest, QueuesNothingWithoutAReceiver) {
  auto hub = EventHub::Start(Options());
  ASSERT_TRUE(hub.ok()) << hub.status();
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  sink->OnIndexEvent(Stored(1, -1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  Collector watcher;
  // Nothing was published while nobody listened: the next batch is seq 0.
  EXPECT_EQ((*hub)->Watch(&watcher, std::optional<uint64_t>(0)), 0u);
  sink->OnIndexEvent(Stored(2, 1));
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0]->seq, 0u);
  ASSERT_EQ(batches[0]->events.size(), 1u);
  EXPECT_EQ(batches[0]->events[0].keys, std::vector<core::PageKey>{Key(2)});
  (*hub)->Unwatch(&watcher);
}

TEST(EventHubTest, DroppedEventsLeaveAGapInSequenceNumbers) {
  EventHubOptions o = Options();
  o.max_queue_size = 3;
  o.batch_interval = absl::Seconds(30);  // Only the destructor's flush publishes.
  Collector watcher;
  {
    auto hub = EventHub::Start(o);
    ASSERT_TRUE(hub.ok()) << hub.status();
    (*hub)->Watch(&watcher, std::nullopt);
    core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());  // AllBlocksCleared: 1 queued.
    for (uint8_t k = 1; k <= 5; ++k) sink->OnIndexEvent(Stored(k, k - 1 == 0 ? -1 : k - 1));
    (*hub)->Unwatch(&watcher);  // Re-watch below so the final flush reaches us.
    (*hub)->Watch(&watcher, std::nullopt);
  }
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0]->seq, 1u);  // Seq 0 is the gap that says events were lost.
  // What was queued before the loss, then AllBlocksCleared: subscribers start afresh.
  ASSERT_EQ(batches[0]->events.size(), 3u);
  EXPECT_EQ(batches[0]->events[1].keys, (std::vector<core::PageKey>{Key(1), Key(2)}));
  EXPECT_EQ(batches[0]->events[2].kind, KvEvent::Kind::kAllBlocksCleared);
}

TEST(EventHubTest, RejectsAnEndpointZmqCannotBind) {
  EventHubOptions o = Options();
  o.endpoint = "tcp://*:notaport";
  auto hub = EventHub::Start(o);
  ASSERT_FALSE(hub.ok());
  EXPECT_EQ(hub.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(hub.status().message().find("events.endpoint"), std::string::npos) << hub.status();
}

// Receives one multipart message, or an empty vector after `timeout_ms`.
std::vector<std::string> Receive(void* socket, int timeout_ms) {
  zmq_setsockopt(socket, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  std::vector<std::string> frames;
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, 0) < 0) {
      zmq_msg_close(&msg);
      return {};
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    const bool more = zmq_msg_more(&msg) != 0;
    zmq_msg_close(&msg);
    if (!more) return frames;
  }
}

std::string Seq(uint64_t seq) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, seq >>= 8) out[i] = static_cast<char>(seq & 0xff);
  return out;
}

TEST(EventHubTest, PublishesAndReplaysOverZmqAsVllmDoes) {
  EventHubOptions o = Options();
  o.endpoint = "tcp://127.0.0.1:*";
  o.replay_endpoint = "tcp://127.0.0.1:*";
  auto hub = EventHub::Start(o);
  ASSERT_TRUE(hub.ok()) << hub.status();
  ASSERT_NE((*hub)->endpoint().find("tcp://127.0.0.1:"), std::string::npos);
  void* ctx = zmq_ctx_new();
  void* sub = zmq_socket(ctx, ZMQ_SUB);
  ASSERT_EQ(zmq_connect(sub, (*hub)->endpoint().c_str()), 0);
  ASSERT_EQ(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "kv@", 3), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // ZMQ's slow joiner.

  Collector watcher;
  (*hub)->Watch(&watcher, std::nullopt);
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  sink->OnIndexEvent(Stored(1, -1));
  const std::vector<std::string> live = Receive(sub, 5000);
  ASSERT_EQ(live.size(), 3u);
  EXPECT_EQ(live[0], "kv@node7@llama");
  EXPECT_EQ(live[1], Seq(0));
  auto batches = watcher.WaitFor(1);
  ASSERT_FALSE(batches.empty());
  EXPECT_EQ(live[2], batches[0]->payload);

  // Replay: [empty, start seq] from a DEALER (a REQ socket adds the empty frame itself). A
  // malformed request first: ignored, and the next one is served.
  void* dealer = zmq_socket(ctx, ZMQ_DEALER);
  ASSERT_EQ(zmq_connect(dealer, (*hub)->replay_endpoint().c_str()), 0);
  const std::string too_long(9, '\0');
  zmq_send(dealer, "", 0, ZMQ_SNDMORE);
  zmq_send(dealer, too_long.data(), too_long.size(), 0);
  const std::string start = Seq(0);
  zmq_send(dealer, "", 0, ZMQ_SNDMORE);
  zmq_send(dealer, start.data(), start.size(), 0);
  const std::vector<std::string> replayed = Receive(dealer, 5000);
  ASSERT_EQ(replayed.size(), 4u);
  EXPECT_EQ(replayed[1], "kv@node7@llama");
  EXPECT_EQ(replayed[2], Seq(0));
  EXPECT_EQ(replayed[3], live[2]);
  const std::vector<std::string> end = Receive(dealer, 5000);
  ASSERT_EQ(end.size(), 4u);
  EXPECT_EQ(end[1], "");
  EXPECT_EQ(end[2], std::string(8, '\xff'));  // -1, signed big-endian.
  EXPECT_EQ(end[3], "");

  (*hub)->Unwatch(&watcher);
  zmq_close(dealer);
  zmq_close(sub);
  zmq_ctx_term(ctx);
}

TEST(KvEventBatchTest, EncodesVllmsLayout) {
  KvEvent stored;
  stored.kind = KvEvent::Kind::kBlockStored;
  stored.medium = "CPU";
  stored.locality = "LOCAL";
  stored.keys = {Key(1), Key(2)};
  stored.parent = Key(0);
  stored.block_size = 64;
  KvEvent removed;
  removed.kind = KvEvent::Kind::kBlockRemoved;
  removed.medium = "STORAGE:nvme";
  removed.keys = {Key(2)};
  const std::string payload = EncodeKvEventBatch(12.5, {stored, removed}, /*int_hashes=*/false);

  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = oh.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);  // [ts, events, data_parallel_rank]
  EXPECT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  EXPECT_EQ(batch.via.array.ptr[0].as<double>(), 12.5);
  EXPECT_TRUE(batch.via.array.ptr[2].is_nil());
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, 2u);
  auto field = [](const msgpack::object& map, const std::string& name) -> const msgpack::object* {
    for (uint32_t i = 0; i < map.via.map.size; ++i) {
      if (map.via.map.ptr[i].key.as<std::string>() == name) return &map.via.map.ptr[i].val;
    }
    return nullptr;
  };
  const msgpack::object& s = events.via.array.ptr[0];
  ASSERT_EQ(s.type, msgpack::type::MAP);
  EXPECT_EQ(s.via.map.ptr[0].key.as<std::string>(), "type");  // The tag comes first.
  EXPECT_EQ(field(s, "type")->as<std::string>(), "BlockStored");
  const msgpack::object* hashes = field(s, "block_hashes");
  ASSERT_NE(hashes, nullptr);
  ASSERT_EQ(hashes->via.array.size, 2u);
  EXPECT_EQ(hashes->via.array.ptr[1].type, msgpack::type::BIN);
  EXPECT_EQ(
      std::string(hashes->via.array.ptr[1].via.bin.ptr, hashes->via.array.ptr[1].via.bin.size),
      std::string(Key(2).AsBytes()));
  EXPECT_EQ(field(s, "parent_block_hash")->type, msgpack::type::BIN);
  EXPECT_EQ(field(s, "token_ids")->via.array.size, 0u);
  EXPECT_EQ(field(s, "block_size")->as<uint32_t>(), 64u);
  // Fields without a default in vLLM's BlockStored are present even when None.
  EXPECT_TRUE(field(s, "lora_id")->is_nil());
  EXPECT_TRUE(field(s, "lora_name")->is_nil());
  EXPECT_EQ(field(s, "medium")->as<std::string>(), "CPU");
  EXPECT_EQ(field(s, "locality")->as<std::string>(), "LOCAL");
  const msgpack::object& r = events.via.array.ptr[1];
  EXPECT_EQ(field(r, "type")->as<std::string>(), "BlockRemoved");
  EXPECT_EQ(field(r, "medium")->as<std::string>(), "STORAGE:nvme");
  EXPECT_EQ(field(r, "locality"), nullptr);  // Empty: omitted, as msgspec omits a default.
}

const msgpack::object* Field(const msgpack::object& map, const std::string& name) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (map.via.map.ptr[i].key.as<std::string>() == name) return &map.via.map.ptr[i].val;
  }
  return nullptr;
}

TEST(KvEventBatchTest, IntegerHashesAreVllmsAndTokensFollowTheChain) {
  // vLLM's maybe_convert_block_hash: int.from_bytes(hash, "big") & (2**64 - 1).
  core::PageKey k;
  for (size_t i = 0; i < k.bytes.size(); ++i) k.bytes[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(core::IntBlockHash(k), 0x18191a1b1c1d1e1full);

  KvEvent stored;
  stored.kind = KvEvent::Kind::kBlockStored;
  stored.medium = "CPU";
  stored.keys = {Key(1), Key(2)};
  stored.hashes = {7, 0xffffffffffffffffull};  // An engine's own hashes: sent as given.
  stored.parent = Key(0);
  stored.parent_hash = 5;
  stored.block_size = 2;
  stored.token_ids = {10, 11, 12, 4000000000u};
  KvEvent removed;
  removed.kind = KvEvent::Kind::kBlockRemoved;
  removed.medium = "CPU";
  removed.keys = {Key(3)};  // No hashes given: the key's integer form.
  const std::string payload = EncodeKvEventBatch(1.0, {stored, removed});
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& events = oh.get().via.array.ptr[1];
  const msgpack::object& s = events.via.array.ptr[0];
  const msgpack::object* hashes = Field(s, "block_hashes");
  ASSERT_EQ(hashes->via.array.size, 2u);
  EXPECT_EQ(hashes->via.array.ptr[0].type, msgpack::type::POSITIVE_INTEGER);
  EXPECT_EQ(hashes->via.array.ptr[0].as<uint64_t>(), 7u);
  EXPECT_EQ(hashes->via.array.ptr[1].as<uint64_t>(), 0xffffffffffffffffull);
  EXPECT_EQ(Field(s, "parent_block_hash")->as<uint64_t>(), 5u);
  EXPECT_EQ(Field(s, "token_ids")->as<std::vector<uint32_t>>(),
            (std::vector<uint32_t>{10, 11, 12, 4000000000u}));
  const msgpack::object* gone = Field(events.via.array.ptr[1], "block_hashes");
  EXPECT_EQ(gone->via.array.ptr[0].as<uint64_t>(), core::IntBlockHash(Key(3)));
}

TEST(EventHubTest, StorageMediaAnnounceTheFirstTierInAndTheLastTierOutPerLocality) {
  EventHubOptions o = Options();
  o.per_tier_media = false;  // events.storage_media: storage, the default.
  o.l3_tiers = {{"nvme", false}, {"fs", false}, {"cluster", true}};
  auto hub = EventHub::Start(o);
  ASSERT_TRUE(hub.ok()) << hub.status();
  Collector watcher;
  (*hub)->Watch(&watcher, std::nullopt);
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  // Page 1 into nvme (announced), into fs too (not), out of nvme (not: fs holds it), out of fs
  // (announced), into the shared tier (announced as REMOTE).
  for (const core::IndexEvent& e :
       {AtTiers(Stored(1, -1, 0), 0b001), AtTiers(Stored(1, -1, 1), 0b011),
        AtTiers(Removed(1, 0), 0b010), AtTiers(Removed(1, 1), 0b000),
        AtTiers(Stored(1, -1, 2), 0b100)}) {
    sink->OnIndexEvent(e);
  }
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);
  const std::vector<KvEvent>& ev = batches[0]->events;
  ASSERT_EQ(ev.size(), 4u);  // AllBlocksCleared first.
  EXPECT_EQ(ev[1].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(ev[1].medium, "STORAGE");
  EXPECT_EQ(ev[1].locality, "LOCAL");
  EXPECT_EQ(ev[2].kind, KvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(ev[2].medium, "STORAGE");
  EXPECT_EQ(ev[3].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(ev[3].medium, "STORAGE");
  EXPECT_EQ(ev[3].locality, "REMOTE");
  (*hub)->Unwatch(&watcher);
}

TEST(EventHubTest, StorageMediaOfBothLocalitiesNeverFoldIntoOneEvent) {
  EventHubOptions o = Options();
  o.per_tier_media = false;
  o.l3_tiers = {{"nvme", false}, {"cluster", true}};
  auto hub = EventHub::Start(o);
  ASSERT_TRUE(hub.ok()) << hub.status();
  Collector watcher;
  (*hub)->Watch(&watcher, std::nullopt);
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  // A parent stored in the local tier and its child in the shared one, within one batch: both
  // are "STORAGE", and the child must not be folded into the parent's LOCAL event. Their
  // removals, one from each, must not share an event either.
  for (const core::IndexEvent& e : {AtTiers(Stored(1, -1, 0), 0b01), AtTiers(Stored(2, 1, 1), 0b10),
                                    AtTiers(Removed(1, 0), 0b00), AtTiers(Removed(2, 1), 0b00)}) {
    sink->OnIndexEvent(e);
  }
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);
  const std::vector<KvEvent>& ev = batches[0]->events;
  ASSERT_EQ(ev.size(), 5u);  // AllBlocksCleared first.
  EXPECT_EQ(ev[1].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(ev[1].locality, "LOCAL");
  EXPECT_EQ(ev[1].keys, (std::vector<core::PageKey>{Key(1)}));
  EXPECT_EQ(ev[2].kind, KvEvent::Kind::kBlockStored);
  EXPECT_EQ(ev[2].locality, "REMOTE");
  EXPECT_EQ(ev[2].keys, (std::vector<core::PageKey>{Key(2)}));
  EXPECT_EQ(ev[3].kind, KvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(ev[3].locality, "LOCAL");
  EXPECT_EQ(ev[4].kind, KvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(ev[4].locality, "REMOTE");
  for (const KvEvent& e : ev) {
    if (e.kind != KvEvent::Kind::kAllBlocksCleared) {
      EXPECT_EQ(e.medium, "STORAGE");
    }
  }
  (*hub)->Unwatch(&watcher);
}

TEST(EventHubTest, StoredChainsCarryTheirPagesTokensAndSplitWhereSomeAreUnknown) {
  auto hub = EventHub::Start(Options());
  ASSERT_TRUE(hub.ok()) << hub.status();
  Collector watcher;
  (*hub)->Watch(&watcher, std::nullopt);
  core::IndexEventSink* sink = (*hub)->SinkFor(1, Spec());
  auto labelled = [](core::IndexEvent e, uint32_t token) {
    auto label = std::make_shared<core::PageLabel>();
    label->tokens.assign(16, token);
    e.label = label;
    e.hash = 100 + token;
    e.parent_hash = 100 + token - 1;
    return e;
  };
  // Pages 1 and 2 with tokens, 3 without, 4 with: three stored events.
  for (const core::IndexEvent& e : {labelled(Stored(1, -1), 1), labelled(Stored(2, 1), 2),
                                    Stored(3, 2), labelled(Stored(4, 3), 4)}) {
    sink->OnIndexEvent(e);
  }
  auto batches = watcher.WaitFor(1);
  ASSERT_EQ(batches.size(), 1u);
  const std::vector<KvEvent>& ev = batches[0]->events;
  ASSERT_EQ(ev.size(), 4u);  // AllBlocksCleared first.
  EXPECT_EQ(ev[1].keys, (std::vector<core::PageKey>{Key(1), Key(2)}));
  EXPECT_EQ(ev[1].hashes, (std::vector<uint64_t>{101, 102}));
  ASSERT_EQ(ev[1].token_ids.size(), 32u);
  EXPECT_EQ(ev[1].token_ids[0], 1u);
  EXPECT_EQ(ev[1].token_ids[16], 2u);
  EXPECT_EQ(ev[2].keys, (std::vector<core::PageKey>{Key(3)}));
  EXPECT_TRUE(ev[2].token_ids.empty());
  EXPECT_EQ(ev[3].keys, (std::vector<core::PageKey>{Key(4)}));
  EXPECT_EQ(ev[3].parent_hash, 103u);
  EXPECT_EQ(ev[3].token_ids, std::vector<uint32_t>(16, 4));
  (*hub)->Unwatch(&watcher);
}

}  // namespace
}  // namespace kvcellar::server
