// kvcellarctl events: the daemon's KV events (AdminService.WatchEvents, docs/events.md), one line
// per event, or one JSON object per batch with --json, until --count batches or Ctrl-C.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/tools/ctl_common.h"

namespace kvcellar::ctl {
namespace {

std::string KindName(v1::KvEvent::Kind kind) {
  switch (kind) {
    case v1::KvEvent::BLOCK_STORED: return "BlockStored";
    case v1::KvEvent::BLOCK_REMOVED: return "BlockRemoved";
    case v1::KvEvent::ALL_BLOCKS_CLEARED: return "AllBlocksCleared";
    default: return "unknown";
  }
}

// The first 16 hex digits of a key, as the daemon's logs print keys.
std::string Short(const std::string& raw) { return Hex(raw).substr(0, 16); }

void PrintBatch(const v1::WatchEventsResponse& b) {
  if (b.missed() > 0) {
    std::printf("# %llu batches missed (this reader was slow)\n",
                static_cast<unsigned long long>(b.missed()));
  }
  for (const v1::KvEvent& e : b.events()) {
    std::string line = absl::StrCat("seq ", b.seq(), "  ", b.topic(), "  ", KindName(e.kind()));
    if (e.kind() != v1::KvEvent::ALL_BLOCKS_CLEARED) {
      absl::StrAppend(&line, "  ", e.medium(), "  ", e.block_hashes_size(), " pages  ",
                      Short(e.block_hashes(0)));
      if (e.block_hashes_size() > 1) {
        absl::StrAppend(&line, "..", Short(e.block_hashes(e.block_hashes_size() - 1)));
      }
      if (e.kind() == v1::KvEvent::BLOCK_STORED) {
        absl::StrAppend(&line, "  parent ",
                        e.parent_block_hash().empty() ? "none" : Short(e.parent_block_hash()));
      }
    }
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int Events(const Options& options, v1::AdminService::Stub& stub) {
  v1::WatchEventsRequest request;
  if (options.from_seq.has_value()) {
    request.set_replay(true);
    request.set_from_seq(*options.from_seq);
  }
  if (options.tenant.has_value()) request.set_tenant(*options.tenant);
  request.set_model_id(options.model);
  // No deadline: the stream lasts until --count batches arrived or the user stops it.
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      stub.WatchEvents(&context, request);
  v1::WatchEventsResponse batch;
  uint64_t received = 0;
  while ((options.count == 0 || received < options.count) && reader->Read(&batch)) {
    ++received;
    if (options.json) {
      batch.clear_payload();  // The events are there already, decoded.
      if (int rc = PrintJson(batch); rc != 0) return rc;
      std::printf("\n");
      std::fflush(stdout);
    } else {
      PrintBatch(batch);
    }
  }
  if (options.count != 0 && received >= options.count) {
    context.TryCancel();
    return 0;
  }
  const grpc::Status status = reader->Finish();
  return status.ok() ? 0 : RpcFailed(options, context, status);
}

}  // namespace kvcellar::ctl
