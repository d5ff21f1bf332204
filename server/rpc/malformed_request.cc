#include "server/rpc/malformed_request.h"

#include <cstdlib>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "platform/log.h"
#include "google/protobuf/stubs/logging.h"
#include "server/rpc/grpc_status.h"

namespace kvcellar::server {
namespace {

namespace pb = ::google::protobuf;
using grpc::experimental::InterceptionHookPoints;

// protobuf 3.21 (wire_format_lite.cc, PrintUTF8ErrorLog): "String field '<full name>' contains
// invalid UTF-8 data when parsing a protocol buffer. ..."
constexpr absl::string_view kUtf8Prefix = "String field '";
constexpr absl::string_view kUtf8Parsing = "contains invalid UTF-8 data when parsing";

// The string field with invalid UTF-8 that the last failed parse on this thread reported; read
// and cleared by the interceptor of the call that parse belonged to.
thread_local std::string bad_utf8_field;

void ProtobufLogHandler(pb::LogLevel level, const char* filename, int line,
                        const std::string& message) {
  if (absl::StartsWith(message, kUtf8Prefix) && absl::StrContains(message, kUtf8Parsing)) {
    // A client's request: the interceptor logs it with the call's method and peer.
    absl::string_view rest = absl::string_view(message).substr(kUtf8Prefix.size());
    bad_utf8_field = std::string(rest.substr(0, rest.find('\'')));
    return;
  }
  const std::string source = absl::StrCat(filename, ":", line);
  switch (level) {
    case pb::LOGLEVEL_INFO:
      KVLOG(Info, "protobuf", {{"source", source}, {"message", message}});
      break;
    case pb::LOGLEVEL_WARNING:
      KVLOG(Warn, "protobuf", {{"source", source}, {"message", message}});
      break;
    default:
      KVLOG(Error, "protobuf", {{"source", source}, {"message", message}});
      break;
  }
}

// The request type of "/kvcellar.v1.CacheService/Match", or nullptr for a method protobuf does not
// know (health and reflection are generated too, so they are found).
const pb::Descriptor* RequestType(absl::string_view grpc_method) {
  absl::string_view m = grpc_method;
  if (absl::StartsWith(m, "/")) m.remove_prefix(1);
  const pb::MethodDescriptor* method =
      pb::DescriptorPool::generated_pool()->FindMethodByName(absl::StrReplaceAll(m, {{"/", "."}}));
  return method == nullptr ? nullptr : method->input_type();
}

class MalformedRequestInterceptor : public grpc::experimental::Interceptor {
 public:
  MalformedRequestInterceptor(grpc::experimental::ServerRpcInfo* info, MalformedRequestLog* log)
      : info_(info), log_(log), method_(info->method()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      std::string field = std::exchange(bad_utf8_field, std::string());
      if (methods->GetRecvMessage() == nullptr) {
        if (!field.empty()) {
          Reject(field);  // Bytes arrived: protobuf named the field they broke.
        } else if (grpc_call_failed_before_recv_message(ServerContext()->c_call())) {
          abandoned_ = true;  // The stream failed (the client's process died, the call was reset).
        } else {
          no_message_ = true;  // Bytes that do not parse, or a call cancelled in passing.
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      // A client that cancels (or whose deadline passes) before its request is read leaves a
      // null message and no failed read. Such a call is no malformed request: it is answered (to
      // nobody) CANCELLED, when the cancellation is known by now; its log line waits for the
      // close, when it is known for certain.
      if (no_message_ && ServerContext()->IsCancelled()) {
        abandoned_ = true;
      } else if (no_message_) {
        Reject("", /*log=*/false);
      }
      if (abandoned_) {
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::CANCELLED, "the call ended before its request arrived"));
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_CLOSE) &&
        no_message_ && !abandoned_ && !ServerContext()->IsCancelled()) {
      Log();
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !message_.empty()) {
      methods->ModifySendStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message_));
      std::multimap<std::string, std::string>* trailers = methods->GetSendTrailingMetadata();
      trailers->emplace(kErrorReasonMetadataKey,
                        v1::ErrorReason_Name(v1::ERROR_REASON_INVALID_FIELD));
      if (!field_.empty()) trailers->emplace(kErrorFieldMetadataKey, field_);
    }
    methods->Proceed();
  }

 private:
  grpc::ServerContextBase* ServerContext() const { return info_->server_context(); }

  // The request did not parse; `utf8_field` is the string field protobuf named, if any. Logs it
  // unless `log` is false (then Log() does, once the call is known not to be cancelled).
  void Reject(absl::string_view utf8_field, bool log = true) {
    const pb::Descriptor* type = RequestType(method_);
    const std::string type_name = type == nullptr ? "request" : type->name();
    if (!utf8_field.empty()) {
      field_ = type == nullptr ? "" : FieldPath(type, utf8_field);
      message_ = absl::StrCat(field_.empty() ? std::string(utf8_field) : field_,
                              ": not valid UTF-8; string fields must be UTF-8 text (the ",
                              type_name, " was not parsed)");
    } else {
      message_ = absl::StrCat("the request is not a valid ", type_name, " message");
    }
    log_field_ = field_.empty() ? std::string(utf8_field) : field_;
    if (log) Log();
  }

  void Log() const { log_->Record(method_, log_field_, message_); }

  grpc::experimental::ServerRpcInfo* info_;  // The call's; outlives its interceptors.
  MalformedRequestLog* const log_;
  // The request never arrived: the client cancelled the call, its deadline passed or its process
  // died. Gets CANCELLED; nothing is logged.
  bool abandoned_ = false;
  bool no_message_ = false;  // Null message, no UTF-8 error, no failed read: decided at send.
  std::string method_;
  std::string field_;      // Request path of the field at fault, or "".
  std::string log_field_;  // That path, else the field's name as protobuf gave it, for the log.
  std::string message_;    // Non-empty once the request was found malformed.
};

// kvcellar_rpc_malformed_requests_total in `registry`, or null without one.
Counter* RejectedCounter(MetricsRegistry* registry) {
  if (registry == nullptr) return nullptr;
  absl::StatusOr<CounterFamily*> family =
      registry->RegisterCounter("kvcellar_rpc_malformed_requests_total",
                                "gRPC requests that did not parse, answered INVALID_ARGUMENT "
                                "(logged at most once a minute).");
  if (!family.ok()) {
    // The name is fixed here; a failure is a programming error found by every test.
    KVLOG(Error, "metric registration failed", {{"error", std::string(family.status().message())}});
    std::abort();
  }
  return &(*family)->WithLabels({});
}

}  // namespace

MalformedRequestLog::MalformedRequestLog(MetricsRegistry* registry, absl::Duration interval)
    : interval_(interval), counter_(RejectedCounter(registry)) {}

void MalformedRequestLog::Record(absl::string_view method, absl::string_view field,
                                 absl::string_view error) {
  const uint64_t rejected = rejected_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (counter_ != nullptr) counter_->Increment();
  uint64_t unlogged = 0;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_logged_ < interval_) {
      ++unlogged_;
      return;
    }
    last_logged_ = now;
    unlogged = std::exchange(unlogged_, 0);
  }
  KVLOG(Warn, "request rejected: does not parse",
        {{"method", method},
         {"field", field},
         {"error", error},
         {"unlogged_since_last", unlogged},
         {"rejected_total", rejected}});
}

void InstallProtobufLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] { pb::SetLogHandler(&ProtobufLogHandler); });
}

std::string FieldPath(const pb::Descriptor* root, absl::string_view full_name) {
  // Breadth first, so the shortest path wins; each message type is expanded once (recursive
  // types end).
  std::deque<std::pair<const pb::Descriptor*, std::string>> queue = {{root, ""}};
  std::vector<const pb::Descriptor*> seen = {root};
  while (!queue.empty()) {
    auto [type, prefix] = std::move(queue.front());
    queue.pop_front();
    for (int i = 0; i < type->field_count(); ++i) {
      const pb::FieldDescriptor* f = type->field(i);
      std::string path = absl::StrCat(prefix, prefix.empty() ? "" : ".", f->name());
      if (f->full_name() == full_name) return path;
      const pb::Descriptor* sub = f->message_type();
      if (sub == nullptr || std::find(seen.begin(), seen.end(), sub) != seen.end()) continue;
      seen.push_back(sub);
      queue.emplace_back(sub, f->is_repeated() ? absl::StrCat(path, "[]") : path);
    }
  }
  return "";
}

grpc::experimental::Interceptor* MalformedRequestInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  // Unary calls only: there a request that never arrives parsed is a malformed one. On a stream
  // (gRPC reflection, health Watch) the last receive comes back empty when the client half-closes.
  if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY) return nullptr;
  return new MalformedRequestInterceptor(info, log_);
}

}  // namespace kvcellar::server
