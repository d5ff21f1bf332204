#include "storage/redis_backend.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "platform/log.h"
#include "storage/backend_batch.h"
#include "storage/object_format.h"
#include "storage/object_name.h"
#include "storage/redis_cluster.h"
#include "storage/redis_connection.h"
#include "storage/result_handoff.h"

namespace kvcellar::storage {
namespace {

constexpr size_t kMaxPrefixBytes = 64;
// After a node fails, how long the slot map is refreshed every refresh_interval: Redis's default
// cluster-node-timeout (15 s) plus the replica's election, with room.
constexpr absl::Duration kFailoverWatch = absl::Seconds(60);
// "<prefix><ns16>:<key64>:<shard>" fits with room to spare.
constexpr size_t kMaxKeyBytes = kMaxPrefixBytes + 16 + 1 + 64 + 1 + 10 + 1;

// What an error reply means for the object.
ObjectStatus StatusFromError(absl::string_view e) {
  if (absl::StartsWith(e, "OOM")) return ObjectStatus::kRejected;
  if (absl::StartsWith(e, "TRYAGAIN") || absl::StartsWith(e, "CLUSTERDOWN") ||
      absl::StartsWith(e, "LOADING") || absl::StartsWith(e, "BUSY") ||
      absl::StartsWith(e, "MASTERDOWN") || absl::StartsWith(e, "READONLY")) {
    return ObjectStatus::kRetry;
  }
  return ObjectStatus::kDeviceError;
}

class RedisBackendImpl final : public RedisBackend {
 public:
  explicit RedisBackendImpl(const RedisBackendOptions& options) : options_(options) {}
  ~RedisBackendImpl() override;

  absl::Status Init();

  absl::string_view name() const override { return name_; }
  Capabilities capabilities() const override;
  absl::Status Exists(const ExistsRequest& request, ExistsCallback done) override;
  absl::Status Get(const GetRequest& request, BatchCallback done) override;
  absl::Status Put(const PutRequest& request, BatchCallback done) override;
  absl::Status Delete(const DeleteRequest& request, BatchCallback done) override;
  BackendStats Stats() const override;
  std::string ObjectKey(const PageKey& ns, const PageKey& key, uint32_t shard) const override;
  std::string IndexKey(const PageKey& ns, const PageKey& key, uint32_t shard) const override;
  void SetIndexSink(RedisIndexSink sink) override;
  void SetRemovalSink(RedisRemovalWatch::Sink sink) override {
    if (watch_ != nullptr) watch_->SetSink(std::move(sink));
  }
  RedisWatchStats WatchStats() const override {
    return watch_ != nullptr ? watch_->Stats() : RedisWatchStats{};
  }

 private:
  struct Item {
    PageKey key;
    uint32_t shard = 0;
    uint8_t* buf = nullptr;  // Get: destination; Put: source.
    uint64_t len = 0;        // Get: capacity; Put: size.
    uint16_t slot = 0;
    uint8_t redirects = 0;
    bool header_ready = false;
    ParentLink parent;  // Put: recorded in the header.
    uint8_t key_len = 0;
    char rkey[kMaxKeyBytes];
    uint8_t header[kObjectHeaderBytes];  // Put: encoded once, resent as is after a redirect.

    absl::string_view redis_key() const { return absl::string_view(rkey, key_len); }
  };

  struct Batch : BatchState {
    std::vector<Item> items;
    std::atomic<size_t> remaining{0};  // Unresolved items, plus one while submitting.
  };

  // Items of one batch for one node, run as one pipeline on one connection.
  struct Chunk {
    Batch* batch = nullptr;
    std::vector<uint32_t> items;
    bool asking = false;
    Chunk* next = nullptr;
  };

  struct Node {
    RedisAddress address;
    std::string address_text;
    absl::Mutex mu;
    Chunk* head ABSL_GUARDED_BY(mu) = nullptr;
    Chunk* tail ABSL_GUARDED_BY(mu) = nullptr;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    // After a failed connect, no new attempt before this (absl::ToUnixNanos).
    std::atomic<int64_t> retry_after_ns{0};
    std::vector<std::thread> workers;

    bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return head != nullptr || stopping; }
  };

  struct Redirected {
    uint32_t item;
    int node;
    bool asking;
  };

  // What a pipeline's replies left to do once it has run.
  struct FollowUp {
    absl::InlinedVector<Redirected, 4> redirected;  // To resend elsewhere.
    absl::InlinedVector<uint32_t, 4> corrupt;       // To remove, then resolve.
    absl::InlinedVector<uint32_t, 4> missing;       // Gets that found nothing: stale entries.
  };

  // Submission.
  template <typename Request>
  absl::Status Admit(const Request& request) const;
  Batch* NewBatch(OpKind kind, const PageKey& ns, absl::Duration timeout, size_t n);
  // Get, Put and Delete: every item is addressed, and dispatched unless AdmitItem settles it.
  template <typename RequestItem>
  absl::Status SubmitItems(OpKind kind, const ItemsRequest<RequestItem>& request,
                           BatchCallback done);
  bool AdmitItem(Batch* b, uint32_t i, const GetItem& item);
  bool AdmitItem(Batch* b, uint32_t i, const PutItem& item);
  bool AdmitItem(Batch* b, uint32_t i, const ObjectRef& item);
  // Names item i of `b` (key, shard), formats its Redis key and picks its cluster slot from that
  // very key, so the key a command sends and the node it goes to never disagree.
  Item& AddressItem(Batch* b, size_t i, const PageKey& key, uint32_t shard) const;
  size_t FormatKey(const PageKey& ns, const PageKey& key, uint32_t shard, char* out) const;
  void Dispatch(Batch* b, absl::Span<const uint32_t> items, int node_hint, bool asking);
  Node* EnsureNode(int id);
  void Enqueue(Node* node, Chunk* c);

  // A connection's worker: one chunk at a time, in phases.
  void WorkerLoop(Node* node);
  void RunChunk(Node* node, RedisConnection* conn, Chunk* c);
  bool EnsureConnected(Node* node, RedisConnection* conn, const Batch* b, absl::Time now);
  void NodeFailed(Node* node);
  void BuildPipeline(RedisConnection* conn, const Chunk* c);
  // HSET (Put) or HDEL (Delete, a corrupt object removed) of item i's index entry.
  void AddIndexCommand(RedisConnection* conn, const Batch* b, uint32_t i, bool set);
  void OnReply(Batch* b, const RedisConnection::Expect& e, const RedisReply& r, FollowUp* follow);
  void PruneIndex(RedisConnection* conn, Batch* b, absl::Span<const uint32_t> missing);
  void OnErrorReply(Batch* b, uint32_t i, const RedisReply& r, FollowUp* follow);
  void OnGetReply(Batch* b, uint32_t i, const RedisReply& r, FollowUp* follow);
  void FailUnanswered(Node* node, RedisConnection* conn, Batch* b, size_t got,
                      const absl::Status& status);
  void RemoveCorrupt(RedisConnection* conn, Batch* b, absl::Span<const uint32_t> corrupt);
  void Resend(Batch* b, absl::InlinedVector<Redirected, 4>* redirected);
  // `node` failed with `items` unsent or unanswered: in a cluster, those whose slot has another
  // primary after a refresh go there; the rest fail transiently.
  void Reroute(Node* node, Batch* b, absl::Span<const uint32_t> items);

  // Resolution.
  void Resolve(Batch* b, uint32_t item, ObjectStatus status, uint64_t bytes);
  void ResolveExists(Batch* b, uint32_t item, Presence p);
  // An object that failed with `status` (never kOk): for Exists, an unknown presence (transient
  // when kRetry).
  void ResolveFailed(Batch* b, uint32_t item, ObjectStatus status);
  void FailItems(Batch* b, absl::Span<const uint32_t> items, bool timeout);
  void ReleaseSubmitRef(Batch* b);
  void Deliver(Batch* b);
  void CallbackLoop();

  // Cluster topology.
  void RequestRefresh();
  void RefreshLoop();
  bool RefreshNow();
  // A worker's refresh after a node failed: at most one per refresh_interval; a worker arriving
  // while another refreshes waits for that map.
  void RefreshFromWorker();
  bool CallbackWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !deferred_.empty();
  }
  bool RefreshWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || refresh_requested_;
  }

  // Index readback (redis_index.h), on readback_.
  void ReadbackLoop();
  // Every node that owns a slot (the one node standalone); the cluster map is refreshed first
  // when it is empty.
  std::vector<std::string> Primaries();

  const RedisBackendOptions options_;
  std::string name_;
  std::string ttl_args_;  // "$2\r\nPX\r\n$<n>\r\n<ms>\r\n", or empty without a TTL.
  StatsCounters stats_;
  SlotMap slots_;
  std::thread refresher_;
  std::thread callbacks_;

  InFlightBatches in_flight_{"redis backend"};

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);  // Indexed by SlotMap node id.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool refresh_requested_ ABSL_GUARDED_BY(mu_) = false;
  // Until then (absl::ToUnixNanos) the map is refreshed every refresh_interval: a node failed,
  // and a failover may promote its replica at any moment (cluster-node-timeout plus an election).
  std::atomic<int64_t> watch_until_ns_{0};
  absl::Mutex worker_refresh_mu_;
  absl::Time last_worker_refresh_ ABSL_GUARDED_BY(worker_refresh_mu_) = absl::InfinitePast();
  std::deque<Batch*> deferred_ ABSL_GUARDED_BY(mu_);  // Completed while submitting.

  std::thread readback_;
  std::atomic<bool> readback_stop_{false};
  // The readback's result until a sink takes it.
  ResultHandoff<RedisIndexResult> index_handoff_;
  std::unique_ptr<RedisRemovalWatch> watch_;  // With watch_removals.
};

// ---- Open and close ---------------------------------------------------------------------------

absl::Status RedisBackendImpl::Init() {
  if (options_.addresses.empty()) return absl::InvalidArgumentError("addresses: empty");
  if (!options_.cluster && options_.addresses.size() != 1) {
    return absl::InvalidArgumentError("addresses: standalone mode takes exactly one address");
  }
  if (options_.key_prefix.size() > kMaxPrefixBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key_prefix: longer than ", kMaxPrefixBytes, " bytes"));
  }
  if (options_.connections_per_node < 1) {
    return absl::InvalidArgumentError("connections_per_node: must be at least 1");
  }
  for (const std::string& a : options_.addresses) {
    absl::StatusOr<RedisAddress> parsed = ParseRedisAddress(a);
    if (!parsed.ok()) return parsed.status();
    if (options_.cluster && parsed->is_unix) {
      return absl::InvalidArgumentError("addresses: a cluster is reached over TCP");
    }
    EnsureNode(slots_.NodeId(parsed->ToString()));
  }
  if (const int64_t ms = absl::ToInt64Milliseconds(options_.ttl); ms > 0) {
    const std::string v = absl::StrCat(ms);
    ttl_args_ = absl::StrCat("$2\r\nPX\r\n$", v.size(), "\r\n", v, "\r\n");
  }
  name_ = absl::StrCat(options_.cluster ? "redis-cluster:" : "redis:", options_.addresses[0]);
  callbacks_ = std::thread([this] { CallbackLoop(); });
  if (options_.cluster) {
    if (!RefreshNow()) {
      KVLOG(Warn, "redis cluster unreachable at startup, will retry",
            {{"seeds", options_.addresses[0]}});
    }
    refresher_ = std::thread([this] { RefreshLoop(); });
  }
  if (options_.index) readback_ = std::thread([this] { ReadbackLoop(); });
  if (options_.watch_removals) {
    RedisWatchOptions w;
    w.key_prefix = options_.key_prefix;
    w.password = options_.password;
    w.connect_timeout = options_.connect_timeout;
    watch_ = std::make_unique<RedisRemovalWatch>(std::move(w), [this] { return Primaries(); });
  }
  return absl::OkStatus();
}

std::vector<std::string> RedisBackendImpl::Primaries() {
  std::vector<std::string> nodes;
  if (!options_.cluster) {
    nodes.push_back(options_.addresses[0]);
    return nodes;
  }
  for (int attempt = 0; attempt < 2 && nodes.empty(); ++attempt) {
    if (attempt > 0 && !RefreshNow()) break;
    std::vector<bool> seen(slots_.node_count(), false);
    for (int slot = 0; slot < kClusterSlots; ++slot) {
      const int node = slots_.Lookup(static_cast<uint16_t>(slot));
      if (node < 0 || static_cast<size_t>(node) >= seen.size() || seen[node]) continue;
      seen[node] = true;
      nodes.push_back(slots_.Address(node));
    }
  }
  return nodes;
}

// Reads every primary's index hashes; the result waits for a sink.
void RedisBackendImpl::ReadbackLoop() {
  RedisIndexReadback r;
  r.key_prefix = options_.key_prefix;
  r.password = options_.password;
  r.connect_timeout = options_.connect_timeout;
  r.deadline = absl::Now() + options_.index_readback_timeout;
  r.stop = &readback_stop_;
  r.nodes = Primaries();
  RedisIndexResult result = ReadRedisIndex(r);
  if (r.nodes.empty()) result.complete = false;
  index_handoff_.Deliver(std::move(result));
}

void RedisBackendImpl::SetIndexSink(RedisIndexSink sink) {
  index_handoff_.SetSink(std::move(sink));
}

RedisBackendImpl::~RedisBackendImpl() {
  watch_.reset();  // Its node list reads the slot map: first.
  readback_stop_.store(true, std::memory_order_relaxed);
  if (readback_.joinable()) readback_.join();
  in_flight_.Close();
  in_flight_.WaitIdle();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  std::vector<Node*> nodes;
  {
    absl::MutexLock lock(&mu_);
    for (auto& n : nodes_) {
      if (n != nullptr) nodes.push_back(n.get());
    }
  }
  for (Node* n : nodes) {
    absl::MutexLock lock(&n->mu);
    n->stopping = true;
  }
  for (Node* n : nodes) {
    for (std::thread& t : n->workers) t.join();
  }
  if (refresher_.joinable()) refresher_.join();
  if (callbacks_.joinable()) callbacks_.join();
}

Capabilities RedisBackendImpl::capabilities() const {
  Capabilities c;
  c.shared_across_nodes = true;
  c.max_object_bytes = options_.max_object_bytes;
  c.persistent = false;  // Whether Redis persists (RDB/AOF) is its configuration, not ours.
  c.max_batch_items = options_.max_batch_items;
  return c;
}

BackendStats RedisBackendImpl::Stats() const {
  BackendStats s;
  stats_.Snapshot(&s);
  return s;
}

// ---- Submission -------------------------------------------------------------------------------

size_t RedisBackendImpl::FormatKey(const PageKey& ns, const PageKey& key, uint32_t shard,
                                   char* out) const {
  char* p = out;
  std::memcpy(p, options_.key_prefix.data(), options_.key_prefix.size());
  p += options_.key_prefix.size();
  p = AppendNamespaceTag(ns, p);
  *p++ = ':';
  p = AppendHex(key.bytes.data(), key.bytes.size(), p);
  *p++ = ':';
  p = AppendDecimal(shard, p);
  return static_cast<size_t>(p - out);
}

std::string RedisBackendImpl::IndexKey(const PageKey& ns, const PageKey& key,
                                       uint32_t shard) const {
  char buf[kMaxPrefixBytes + kMaxIndexKeySuffix];
  const uint16_t slot = KeyHashSlot(ObjectKey(ns, key, shard));
  return std::string(buf, FormatIndexKey(options_.key_prefix, ns, options_.cluster, slot, buf));
}

std::string RedisBackendImpl::ObjectKey(const PageKey& ns, const PageKey& key,
                                        uint32_t shard) const {
  char buf[kMaxKeyBytes];
  return std::string(buf, FormatKey(ns, key, shard, buf));
}

template <typename Request>
absl::Status RedisBackendImpl::Admit(const Request& request) const {
  if (absl::Status s = CheckRequest(request, options_.max_batch_items); !s.ok()) return s;
  return in_flight_.CheckOpen();
}

RedisBackendImpl::Batch* RedisBackendImpl::NewBatch(OpKind kind, const PageKey& ns,
                                                    absl::Duration timeout, size_t n) {
  auto* b = new Batch;
  b->kind = kind;
  b->ns = ns;
  b->deadline = BatchDeadline(timeout, options_.command_timeout);
  b->items.resize(n);
  b->remaining.store(n + 1, std::memory_order_relaxed);  // +1: the submission itself.
  in_flight_.Add();
  return b;
}

RedisBackendImpl::Item& RedisBackendImpl::AddressItem(Batch* b, size_t i, const PageKey& key,
                                                      uint32_t shard) const {
  Item& it = b->items[i];
  it.key = key;
  it.shard = shard;
  it.key_len = static_cast<uint8_t>(FormatKey(b->ns, it.key, it.shard, it.rkey));
  it.slot = KeyHashSlot(it.redis_key());
  return it;
}

absl::Status RedisBackendImpl::Get(const GetRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kGet, request, std::move(done));
}
absl::Status RedisBackendImpl::Put(const PutRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kPut, request, std::move(done));
}
absl::Status RedisBackendImpl::Delete(const DeleteRequest& request, BatchCallback done) {
  return SubmitItems(OpKind::kDelete, request, std::move(done));
}

template <typename RequestItem>
absl::Status RedisBackendImpl::SubmitItems(OpKind kind, const ItemsRequest<RequestItem>& request,
                                           BatchCallback done) {
  if (absl::Status s = Admit(request); !s.ok()) return s;
  Batch* b = NewBatch(kind, request.ns, request.timeout, request.items.size());
  b->done = std::move(done);
  b->results.resize(request.items.size());
  absl::InlinedVector<uint32_t, 64> admitted;
  for (size_t i = 0; i < request.items.size(); ++i) {
    AddressItem(b, i, request.items[i].key, request.items[i].shard);
    if (AdmitItem(b, static_cast<uint32_t>(i), request.items[i])) {
      admitted.push_back(static_cast<uint32_t>(i));
    }
  }
  Dispatch(b, admitted, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

bool RedisBackendImpl::AdmitItem(Batch* b, uint32_t i, const GetItem& item) {
  b->items[i].buf = item.dst;
  b->items[i].len = item.capacity;
  return true;
}

// Redis refuses values over proto-max-bulk-len: rejected here rather than sent.
bool RedisBackendImpl::AdmitItem(Batch* b, uint32_t i, const PutItem& item) {
  b->items[i].buf = const_cast<uint8_t*>(item.src);  // Only ever sent from.
  b->items[i].len = item.size;
  b->items[i].parent = item.parent;
  if (item.size <= options_.max_object_bytes) return true;
  Resolve(b, i, ObjectStatus::kRejected, 0);
  return false;
}

bool RedisBackendImpl::AdmitItem(Batch*, uint32_t, const ObjectRef&) { return true; }

absl::Status RedisBackendImpl::Exists(const ExistsRequest& request, ExistsCallback done) {
  if (absl::Status s = Admit(request); !s.ok()) return s;
  const size_t n = ExistsObjectCount(request);
  Batch* b = NewBatch(OpKind::kExists, request.ns, request.timeout, n);
  b->exists_done = std::move(done);
  b->nkeys = request.keys.size();
  b->nshards = request.shards.size();
  b->presence.assign(n, Presence::kPending);
  absl::InlinedVector<uint32_t, 64> all;
  for (size_t k = 0; k < b->nkeys; ++k) {
    for (size_t s = 0; s < b->nshards; ++s) {
      const size_t i = k * b->nshards + s;
      AddressItem(b, i, request.keys[k], request.shards[s]);
      all.push_back(static_cast<uint32_t>(i));
    }
  }
  Dispatch(b, all, -1, false);
  ReleaseSubmitRef(b);
  return absl::OkStatus();
}

// Groups items by node (the slot map's, or node_hint for redirects) and spreads each node's share
// over its connections.
void RedisBackendImpl::Dispatch(Batch* b, absl::Span<const uint32_t> items, int node_hint,
                                bool asking) {
  if (items.empty()) return;
  absl::InlinedVector<std::pair<int, std::vector<uint32_t>>, 4> groups;
  for (uint32_t i : items) {
    int node = node_hint;
    if (node < 0) node = options_.cluster ? slots_.Lookup(b->items[i].slot) : 0;
    if (node < 0) {
      // No node serves this slot as far as we know: the map is being (re)built.
      RequestRefresh();
      ResolveFailed(b, i, ObjectStatus::kRetry);
      continue;
    }
    auto it = std::find_if(groups.begin(), groups.end(),
                           [node](const auto& g) { return g.first == node; });
    if (it == groups.end()) {
      groups.emplace_back(node, std::vector<uint32_t>{});
      it = groups.end() - 1;
    }
    it->second.push_back(i);
  }
  for (auto& [node_id, list] : groups) {
    Node* node = EnsureNode(node_id);
    const size_t nchunks =
        std::min<size_t>(static_cast<size_t>(options_.connections_per_node), list.size());
    for (size_t c = 0; c < nchunks; ++c) {
      auto* chunk = new Chunk;
      chunk->batch = b;
      chunk->asking = asking;
      const size_t begin = list.size() * c / nchunks, end = list.size() * (c + 1) / nchunks;
      chunk->items.assign(list.begin() + begin, list.begin() + end);
      Enqueue(node, chunk);
    }
  }
}

RedisBackendImpl::Node* RedisBackendImpl::EnsureNode(int id) {
  absl::MutexLock lock(&mu_);
  if (static_cast<size_t>(id) >= nodes_.size()) nodes_.resize(id + 1);
  if (nodes_[id] == nullptr) {
    auto node = std::make_unique<Node>();
    node->address_text = slots_.Address(id);
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(node->address_text);
    if (a.ok()) node->address = *a;
    Node* raw = node.get();
    for (int i = 0; i < options_.connections_per_node; ++i) {
      raw->workers.emplace_back([this, raw] { WorkerLoop(raw); });
    }
    nodes_[id] = std::move(node);
  }
  return nodes_[id].get();
}

void RedisBackendImpl::Enqueue(Node* node, Chunk* c) {
  absl::MutexLock lock(&node->mu);
  c->next = nullptr;
  if (node->tail == nullptr)
    node->head = c;
  else
    node->tail->next = c;
  node->tail = c;
}

// ---- A connection's worker --------------------------------------------------------------------

void RedisBackendImpl::WorkerLoop(Node* node) {
  RedisConnection conn;
  for (;;) {
    Chunk* c;
    {
      absl::MutexLock lock(&node->mu, absl::Condition(node, &Node::HasWork));
      if (node->head == nullptr) return;  // Stopping, and nothing left.
      c = node->head;
      node->head = c->next;
      if (node->head == nullptr) node->tail = nullptr;
    }
    RunChunk(node, &conn, c);
    delete c;
  }
}

// Runs one chunk as one pipeline: connect if needed, send every command, settle each object by
// its reply, then deal with what the replies left: objects found corrupt are removed, redirected
// ones resent where the cluster says they live.
void RedisBackendImpl::RunChunk(Node* node, RedisConnection* conn, Chunk* c) {
  Batch* b = c->batch;
  const absl::Time now = absl::Now();
  if (now >= b->deadline) return FailItems(b, c->items, /*timeout=*/true);
  const bool pooled = conn->connected();
  if (!EnsureConnected(node, conn, b, now)) return Reroute(node, b, c->items);

  FollowUp follow;
  absl::Status status;
  auto run = [&] {
    BuildPipeline(conn, c);
    return conn->Run(
        b->deadline, &status,
        [&](const RedisConnection::Expect& e, const RedisReply& r) { OnReply(b, e, r, &follow); });
  };
  size_t got = run();
  if (!status.ok() && got == 0 && pooled && !absl::IsDeadlineExceeded(status)) {
    // A pooled connection that failed before any reply was most likely closed while it sat idle
    // (the server restarted, or dropped idle clients): the other end never saw the pipeline, or
    // saw commands that are safe to repeat (SET of the same bytes, GET, EXISTS, UNLINK). One fresh
    // connection runs it again; without this every pooled connection would fail one chunk after
    // a server restart.
    conn->Close();
    if (!EnsureConnected(node, conn, b, absl::Now())) return Reroute(node, b, c->items);
    status = absl::OkStatus();
    got = run();
  }
  if (!status.ok()) FailUnanswered(node, conn, b, got, status);
  if (!follow.corrupt.empty()) RemoveCorrupt(conn, b, follow.corrupt);
  if (!follow.missing.empty()) PruneIndex(conn, b, follow.missing);
  if (!follow.redirected.empty()) Resend(b, &follow.redirected);
}

// Connects when the connection is not; false when that is not possible now: the node failed a
// moment ago (fail fast during the backoff), or the connect failed.
bool RedisBackendImpl::EnsureConnected(Node* node, RedisConnection* conn, const Batch* b,
                                       absl::Time now) {
  if (conn->connected()) return true;
  if (absl::ToUnixNanos(now) < node->retry_after_ns.load(std::memory_order_relaxed)) return false;
  absl::Status s = conn->Connect(
      node->address, std::min(options_.connect_timeout, b->deadline - now), options_.password);
  if (!s.ok()) {
    NodeFailed(node);
    return false;
  }
  stats_.reconnects.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The node did not answer: no new connect before the backoff ends; in a cluster the primary may
// have moved.
void RedisBackendImpl::NodeFailed(Node* node) {
  const absl::Time now = absl::Now();
  node->retry_after_ns.store(absl::ToUnixNanos(now + options_.reconnect_backoff),
                             std::memory_order_relaxed);
  watch_until_ns_.store(absl::ToUnixNanos(now + kFailoverWatch), std::memory_order_relaxed);
  RequestRefresh();
}

void RedisBackendImpl::Reroute(Node* node, Batch* b, absl::Span<const uint32_t> items) {
  absl::InlinedVector<Redirected, 4> moved;
  absl::InlinedVector<uint32_t, 16> failed;
  if (options_.cluster && absl::Now() < b->deadline) {
    RefreshFromWorker();
    const int self = slots_.NodeId(node->address_text);
    for (uint32_t i : items) {
      Item& it = b->items[i];
      const int target = slots_.Lookup(it.slot);
      if (target >= 0 && target != self && ++it.redirects <= options_.max_redirects) {
        moved.push_back({i, target, /*asking=*/false});
      } else {
        failed.push_back(i);
      }
    }
  } else {
    failed.assign(items.begin(), items.end());
  }
  FailItems(b, failed, /*timeout=*/false);
  Resend(b, &moved);
}

void RedisBackendImpl::BuildPipeline(RedisConnection* conn, const Chunk* c) {
  Batch* b = c->batch;
  conn->Begin();
  for (uint32_t i : c->items) {
    Item& it = b->items[i];
    if (c->asking) conn->AddAsking();
    switch (b->kind) {
      case OpKind::kGet:
        conn->AddSimple(RedisCommand::kGet, "GET", it.redis_key(), i, it.buf, it.len);
        break;
      case OpKind::kPut:
        if (!it.header_ready) {
          EncodeObjectHeader(
              MakeObjectHeader(b->ns, it.key, it.shard, it.buf, it.len,
                               static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())), it.parent),
              it.header);
          it.header_ready = true;
        }
        conn->AddSet(it.redis_key(), it.header, it.buf, it.len, ttl_args_, i);
        if (options_.index) {
          if (c->asking) conn->AddAsking();
          AddIndexCommand(conn, b, i, /*set=*/true);
        }
        break;
      case OpKind::kExists:
        conn->AddSimple(RedisCommand::kExists, "EXISTS", it.redis_key(), i);
        break;
      case OpKind::kDelete:
        conn->AddSimple(RedisCommand::kUnlink, "UNLINK", it.redis_key(), i);
        if (options_.index) {
          if (c->asking) conn->AddAsking();
          AddIndexCommand(conn, b, i, /*set=*/false);
        }
        break;
    }
  }
}

// The entry goes to the object's own slot (redis_index.h), so it follows the object's MOVED or
// ASK: an ASKING before the SET covers only the next command, hence one before the HSET too.
void RedisBackendImpl::AddIndexCommand(RedisConnection* conn, const Batch* b, uint32_t i,
                                       bool set) {
  const Item& it = b->items[i];
  char key[kMaxPrefixBytes + kMaxIndexKeySuffix];
  const size_t key_len = FormatIndexKey(options_.key_prefix, b->ns, options_.cluster, it.slot, key);
  char field[kIndexFieldBytes];
  EncodeIndexField(it.key, it.shard, field);
  char entry[kIndexEntryBytes];
  if (set) {
    IndexEntry e;
    e.ns = b->ns;
    e.key = it.key;
    e.shard = it.shard;
    e.parent = it.parent;
    e.payload_bytes = it.len;
    EncodeIndexEntry(e, entry);
  }
  conn->AddIndex(absl::string_view(key, key_len), absl::string_view(field, kIndexFieldBytes),
                 set ? absl::string_view(entry, kIndexEntryBytes) : absl::string_view(), i);
}

void RedisBackendImpl::OnReply(Batch* b, const RedisConnection::Expect& e, const RedisReply& r,
                               FollowUp* follow) {
  // The index's replies settle nothing: an entry that failed is a hint lost (its object is still
  // found by lookups); one redirected goes again with its object's SET.
  if (e.cmd == RedisCommand::kAsking || e.cmd == RedisCommand::kHset ||
      e.cmd == RedisCommand::kHdel) {
    return;
  }
  const uint32_t i = e.item;
  if (r.type == RedisReplyType::kError) return OnErrorReply(b, i, r, follow);
  switch (e.cmd) {
    case RedisCommand::kGet:
      return OnGetReply(b, i, r, follow);
    case RedisCommand::kSet:
      return Resolve(
          b, i, r.type == RedisReplyType::kStatus ? ObjectStatus::kOk : ObjectStatus::kDeviceError,
          b->items[i].len);
    case RedisCommand::kExists:
      return ResolveExists(b, i,
                           r.type == RedisReplyType::kInteger
                               ? (r.integer > 0 ? Presence::kPresent : Presence::kAbsent)
                               : Presence::kUnknownError);
    case RedisCommand::kUnlink:
      if (r.type != RedisReplyType::kInteger) return Resolve(b, i, ObjectStatus::kDeviceError, 0);
      return Resolve(b, i, r.integer > 0 ? ObjectStatus::kOk : ObjectStatus::kNotFound, 0);
    case RedisCommand::kAsking:
    case RedisCommand::kHset:
    case RedisCommand::kHdel:
      return;
  }
}

// A redirect is followed (up to max_redirects per object); any other error settles the object.
void RedisBackendImpl::OnErrorReply(Batch* b, uint32_t i, const RedisReply& r, FollowUp* follow) {
  Item& it = b->items[i];
  Redirect rd;
  if (ParseRedirect(r.text, &rd)) {
    stats_.redirects.fetch_add(1, std::memory_order_relaxed);
    if (++it.redirects > options_.max_redirects) return ResolveFailed(b, i, ObjectStatus::kRetry);
    const int target = slots_.NodeId(rd.address);
    if (rd.kind == Redirect::Kind::kMoved) {
      slots_.SetSlot(rd.slot, target);
      RequestRefresh();
    }
    follow->redirected.push_back({i, target, rd.kind == Redirect::Kind::kAsk});
    return;
  }
  const ObjectStatus s = StatusFromError(r.text);
  if (absl::StartsWith(r.text, "CLUSTERDOWN") || absl::StartsWith(r.text, "READONLY")) {
    RequestRefresh();
  }
  ResolveFailed(b, i, s);
}

void RedisBackendImpl::OnGetReply(Batch* b, uint32_t i, const RedisReply& r, FollowUp* follow) {
  Item& it = b->items[i];
  if (r.type == RedisReplyType::kNil) {
    // The object expired (ttl_s), was evicted (maxmemory) or deleted by another node: its index
    // entry, if any, is stale and goes after the pipeline (without the prune, a long-running
    // daemon's hashes would keep every expired object's entry until the next readback).
    if (options_.index) {
      follow->missing.push_back(i);  // Resolved once the entry is gone.
      return;
    }
    return Resolve(b, i, ObjectStatus::kNotFound, 0);
  }
  if (r.type != RedisReplyType::kString) return Resolve(b, i, ObjectStatus::kDeviceError, 0);
  ExpectedObject expected;
  expected.ns = &b->ns;
  expected.key = &it.key;
  expected.shard = it.shard;
  expected.capacity = it.len;
  const uint64_t payload = r.oversize ? it.len + 1 : r.payload_len;
  const ObjectDefect d = VerifyObject(r.header, r.header_len, expected, it.buf, payload);
  if (d == ObjectDefect::kNone) return Resolve(b, i, ObjectStatus::kOk, r.payload_len);
  // A newer daemon's object (a mixed fleet during an upgrade): a miss here, kept for them.
  if (d == ObjectDefect::kNewerVersion) return Resolve(b, i, ObjectStatus::kNotFound, 0);
  KVLOG(Warn, "l3 object corrupt, removed",
        {{"backend", name_}, {"key", it.redis_key()}, {"defect", ObjectDefectName(d)}});
  follow->corrupt.push_back(i);  // Resolved once it is gone.
}

// Unanswered commands: the connection is in an unknown state (replies may still come), so it
// goes; the objects are transient failures.
void RedisBackendImpl::FailUnanswered(Node* node, RedisConnection* conn, Batch* b, size_t got,
                                      const absl::Status& status) {
  const bool timeout = absl::IsDeadlineExceeded(status);
  absl::InlinedVector<uint32_t, 16> unanswered;
  for (size_t k = got; k < conn->pending(); ++k) {
    const RedisCommand cmd = conn->expect(k).cmd;
    if (cmd == RedisCommand::kAsking || cmd == RedisCommand::kHset || cmd == RedisCommand::kHdel) {
      continue;  // One object per command that settles it.
    }
    unanswered.push_back(conn->expect(k).item);
  }
  conn->Close();
  if (timeout) return FailItems(b, unanswered, /*timeout=*/true);
  NodeFailed(node);
  Reroute(node, b, unanswered);
}

// HDELs the index entries of objects a Get found missing, within the batch deadline, then settles
// those objects (kNotFound); an entry left behind (deadline, connection lost) is only a stale hint.
void RedisBackendImpl::PruneIndex(RedisConnection* conn, Batch* b,
                                  absl::Span<const uint32_t> missing) {
  if (conn->connected()) {
    conn->Begin();
    for (uint32_t i : missing) AddIndexCommand(conn, b, i, /*set=*/false);
    absl::Status s;
    conn->Run(b->deadline, &s, [](const RedisConnection::Expect&, const RedisReply&) {});
    if (!s.ok()) conn->Close();
  }
  for (uint32_t i : missing) Resolve(b, i, ObjectStatus::kNotFound, 0);
}

// Removes what failed verification before answering, so a retry does not find it again.
void RedisBackendImpl::RemoveCorrupt(RedisConnection* conn, Batch* b,
                                     absl::Span<const uint32_t> corrupt) {
  if (conn->connected()) {
    conn->Begin();
    for (uint32_t i : corrupt) {
      conn->AddSimple(RedisCommand::kUnlink, "UNLINK", b->items[i].redis_key(), i);
      if (options_.index) AddIndexCommand(conn, b, i, /*set=*/false);
    }
    // Within the batch deadline: past it, the bad value stays and the next read finds it again.
    absl::Status s;
    size_t removed = 0;
    conn->Run(b->deadline, &s, [&](const RedisConnection::Expect& e, const RedisReply& r) {
      removed += e.cmd == RedisCommand::kUnlink && r.type == RedisReplyType::kInteger;
    });
    if (!s.ok()) conn->Close();
    stats_.corrupt_removed.fetch_add(removed, std::memory_order_relaxed);
  }
  for (uint32_t i : corrupt) Resolve(b, i, ObjectStatus::kChecksumError, 0);
}

// Regroups by (target, asking) and sends again; they count against the batch like any item.
void RedisBackendImpl::Resend(Batch* b, absl::InlinedVector<Redirected, 4>* redirected) {
  while (!redirected->empty()) {
    const int target = redirected->front().node;
    const bool asking = redirected->front().asking;
    absl::InlinedVector<uint32_t, 16> same;
    for (size_t k = 0; k < redirected->size();) {
      if ((*redirected)[k].node == target && (*redirected)[k].asking == asking) {
        same.push_back((*redirected)[k].item);
        redirected->erase(redirected->begin() + k);
      } else {
        ++k;
      }
    }
    Dispatch(b, same, target, asking);
  }
}

// ---- Resolution -------------------------------------------------------------------------------

void RedisBackendImpl::Resolve(Batch* b, uint32_t item, ObjectStatus status, uint64_t bytes) {
  b->results[item] = ItemResult{status, status == ObjectStatus::kOk ? bytes : 0};
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Deliver(b);
}

void RedisBackendImpl::ResolveExists(Batch* b, uint32_t item, Presence p) {
  b->presence[item] = p;
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Deliver(b);
}

void RedisBackendImpl::ResolveFailed(Batch* b, uint32_t item, ObjectStatus status) {
  if (b->kind != OpKind::kExists) return Resolve(b, item, status, 0);
  ResolveExists(
      b, item,
      status == ObjectStatus::kRetry ? Presence::kUnknownTransient : Presence::kUnknownError);
}

// Every object in `items` failed transiently; `timeout` marks the batch as past its deadline.
void RedisBackendImpl::FailItems(Batch* b, absl::Span<const uint32_t> items, bool timeout) {
  if (timeout) b->deadline_exceeded.store(true, std::memory_order_relaxed);
  for (uint32_t i : items) ResolveFailed(b, i, ObjectStatus::kRetry);
}

// Drops the submission's own reference; if that was the last, every item was settled without a
// worker (all rejected, no route, empty batch) and a backend thread must deliver.
void RedisBackendImpl::ReleaseSubmitRef(Batch* b) {
  if (b->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    absl::MutexLock lock(&mu_);
    deferred_.push_back(b);
  }
}

void RedisBackendImpl::CallbackLoop() {
  for (;;) {
    Batch* b;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &RedisBackendImpl::CallbackWake));
      if (deferred_.empty()) return;
      b = deferred_.front();
      deferred_.pop_front();
    }
    Deliver(b);
  }
}

void RedisBackendImpl::Deliver(Batch* b) {
  b->BatchState::Deliver(stats_);
  delete b;
  in_flight_.Remove();
}

// ---- Cluster topology -------------------------------------------------------------------------

void RedisBackendImpl::RequestRefresh() {
  if (!options_.cluster) return;
  absl::MutexLock lock(&mu_);
  refresh_requested_ = true;
}

bool RedisBackendImpl::RefreshNow() {
  // Seeds first (ids 0..), then every node learned since.
  const size_t n = slots_.node_count();
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<RedisAddress> a = ParseRedisAddress(slots_.Address(static_cast<int>(i)));
    if (!a.ok()) continue;
    absl::StatusOr<std::vector<SlotRange>> ranges =
        FetchClusterSlots(*a, options_.connect_timeout, options_.password);
    if (!ranges.ok()) continue;
    slots_.Replace(*ranges);
    stats_.topology_refreshes.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

void RedisBackendImpl::RefreshFromWorker() {
  absl::MutexLock lock(&worker_refresh_mu_);
  const absl::Time now = absl::Now();
  if (now < last_worker_refresh_ + options_.refresh_interval) return;
  last_worker_refresh_ = now;
  RefreshNow();
}

void RedisBackendImpl::RefreshLoop() {
  absl::Time last = absl::InfinitePast();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      // While a failed node's replica may be promoted, refresh every interval even when no
      // request fails: a daemon idle through a failover must not meet the dead primary first.
      const absl::Time watch_until =
          absl::FromUnixNanos(watch_until_ns_.load(std::memory_order_relaxed));
      if (absl::Now() < watch_until) {
        mu_.AwaitWithTimeout(absl::Condition(this, &RedisBackendImpl::RefreshWake),
                             options_.refresh_interval);
      } else {
        mu_.Await(absl::Condition(this, &RedisBackendImpl::RefreshWake));
      }
      if (stopping_) return;
      // Rate limit: requests arriving meanwhile fold into the next refresh.
      const absl::Time next = last + options_.refresh_interval;
      if (absl::Now() < next) {
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), next - absl::Now());
        if (stopping_) return;
      }
      refresh_requested_ = false;
    }
    last = absl::Now();
    RefreshNow();
  }
}

}  // namespace

// ---- RedisBackend -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<RedisBackend>> RedisBackend::Create(
    const RedisBackendOptions& options) {
  auto impl = std::make_unique<RedisBackendImpl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<RedisBackend>(std::move(impl));
}

}  // namespace kvcellar::storage
