#include "server/rpc/event_stream.h"

namespace kvcellar::server {
namespace {

namespace v1 = ::kvcellar::v1;

v1::KvEvent::Kind KindOf(KvEvent::Kind kind) {
  switch (kind) {
    case KvEvent::Kind::kBlockStored:
      return v1::KvEvent::BLOCK_STORED;
    case KvEvent::Kind::kBlockRemoved:
      return v1::KvEvent::BLOCK_REMOVED;
    case KvEvent::Kind::kAllBlocksCleared:
      return v1::KvEvent::ALL_BLOCKS_CLEARED;
  }
  return v1::KvEvent::KIND_UNSPECIFIED;
}

void ToProto(const KvEventBatch& b, uint64_t missed, v1::WatchEventsResponse* out) {
  out->Clear();
  out->set_seq(b.seq);
  out->set_ts(b.ts);
  out->set_topic(b.topic);
  out->set_tenant(b.tenant);
  out->set_model_id(b.model_id);
  out->set_missed(missed);
  out->set_payload(b.payload);
  for (const KvEvent& e : b.events) {
    v1::KvEvent* pe = out->add_events();
    pe->set_kind(KindOf(e.kind));
    pe->set_medium(e.medium);
    pe->set_locality(e.locality);
    for (const core::PageKey& k : e.keys) pe->add_block_hashes(k.bytes.data(), k.bytes.size());
    if (e.parent.has_value()) {
      pe->set_parent_block_hash(e.parent->bytes.data(), e.parent->bytes.size());
    }
    pe->set_block_size(e.block_size);
    for (uint64_t h : e.hashes) pe->add_block_hash_ints(h);
    if (e.parent.has_value()) pe->set_parent_block_hash_int(e.parent_hash);
    pe->mutable_token_ids()->Add(e.token_ids.begin(), e.token_ids.end());
  }
}

}  // namespace

EventStream::EventStream(EventHub* hub, const v1::WatchEventsRequest& request)
    : hub_(hub), tenant_(request.tenant()), model_id_(request.model_id()) {
  std::optional<uint64_t> from;
  if (request.replay()) from = request.from_seq();
  hub_->Watch(this, from);
}

void EventStream::Offer(const std::shared_ptr<const KvEventBatch>& batch) {
  if ((!tenant_.empty() && batch->tenant != tenant_) ||
      (!model_id_.empty() && batch->model_id != model_id_)) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  if (queue_.size() >= kMaxQueued) {
    ++missed_;
    return;
  }
  queue_.push_back(batch);
  WriteNextLocked();
}

void EventStream::WriteNextLocked() {
  if (writing_ || finished_ || queue_.empty()) return;
  ToProto(*queue_.front(), missed_, &response_);
  queue_.pop_front();
  missed_ = 0;
  writing_ = true;
  StartWrite(&response_);
}

void EventStream::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  writing_ = false;
  if (!ok) {
    // The reader is gone; OnCancel (or the server's shutdown) finishes the call.
    finished_ = true;
    return;
  }
  WriteNextLocked();
}

void EventStream::OnCancel() {
  StopWatching();
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  Finish(grpc::Status::CANCELLED);
}

void EventStream::OnDone() {
  StopWatching();
  delete this;
}

void EventStream::StopWatching() {
  std::call_once(unwatched_, [this] { hub_->Unwatch(this); });
}

}  // namespace kvcellar::server
