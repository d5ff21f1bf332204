// The no-op gRPC server of the Match baseline: answers every method with an empty message.
//
// It runs in a child process of its own (the benchmark binary re-executed with
// --datapath_noop_server=SOCK), so the baseline crosses the same process boundary as a call to
// kvcellard: a Unix socket between two processes, the callback API on the server side, the same
// largest message size. A client calling CacheService.Match on it sends the real serialized
// MatchRequest and parses the empty reply as an empty MatchResponse.
//
// Threading: RunNoopServer is the child's main thread; gRPC's threads serve the calls.
#ifndef KVCELLAR_TESTS_BENCH_DATAPATH_NOOP_SERVER_H_
#define KVCELLAR_TESTS_BENCH_DATAPATH_NOOP_SERVER_H_

#include <string>

namespace kvcellar::bench {

inline constexpr char kNoopServerFlag[] = "--datapath_noop_server=";
// The line the server logs once it listens.
inline constexpr char kNoopServerReady[] = "noop server ready";

// Serves on unix:`socket_path` until SIGTERM or SIGINT; returns the process exit code.
int RunNoopServer(const std::string& socket_path);

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_DATAPATH_NOOP_SERVER_H_
