#include "tests/bench/datapath/noop_server.h"

#include <signal.h>

#include <cstdio>
#include <memory>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"

namespace kvcellar::bench {
namespace {

// kvcellard's server.max_message_bytes default (config/kvcellard.yaml).
constexpr int kMaxMessageBytes = 64 << 20;

// One call: read the request, answer an empty message, finish OK.
class NoopReactor final : public grpc::ServerGenericBidiReactor {
 public:
  NoopReactor() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    grpc::Slice empty("", 0);
    reply_ = grpc::ByteBuffer(&empty, 1);
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
};

class NoopService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new NoopReactor();
  }
};

}  // namespace

int RunNoopServer(const std::string& socket_path) {
  // Block the stop signals before gRPC starts its threads, so that sigwait below receives them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  NoopService service;
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "noop server: cannot listen on unix:%s\n", socket_path.c_str());
    return 1;
  }
  std::fprintf(stderr, "%s socket=%s\n", kNoopServerReady, socket_path.c_str());
  std::fflush(stderr);
  int sig = 0;
  sigwait(&stop, &sig);
  server->Shutdown();
  return 0;
}

}  // namespace kvcellar::bench
