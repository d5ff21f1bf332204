// kvcellard: the per-node KV-cache daemon.
//
//   kvcellard [--config FILE] [--set key=value]... [--check-config | --print-config]
//
// Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT) or a valid --check-config; 1 for an
// invalid configuration or a startup failure; 2 for bad command-line usage.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "platform/log.h"
#include "server/build_info.h"
#include "server/config/config.h"
#include "server/daemon.h"
#include "server/sd_notify.h"

namespace {

constexpr char kUsage[] =
    "usage: kvcellard [--config FILE] [--set key=value]... [--check-config] [--print-config]\n"
    "\n"
    "  --config FILE     YAML configuration (config/kvcellard.yaml documents every key)\n"
    "  --set key=value   override one key, e.g. --set pool.capacity=8GiB (repeatable, in order)\n"
    "  --check-config    validate the configuration and exit: 0 if valid, 1 with the reason\n"
    "  --print-config    print the effective configuration (secrets redacted) and exit\n"
    "  --version         print the version and exit\n";

struct Args {
  std::optional<std::string> config_file;
  std::vector<std::string> overrides;
  bool check_config = false;
  bool print_config = false;
  bool version = false;
};

// Accepts `--flag value` and `--flag=value`. Returns an error message for bad usage.
std::optional<std::string> ParseArgs(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value_of = [&](absl::string_view flag, std::string* out) -> std::optional<bool> {
      if (arg == flag) {
        if (i + 1 >= argc) return std::nullopt;
        *out = argv[++i];
        return true;
      }
      if (absl::StartsWith(arg, absl::StrCat(flag, "="))) {
        *out = arg.substr(flag.size() + 1);
        return true;
      }
      return false;
    };
    std::string value;
    std::optional<bool> got;
    if ((got = value_of("--config", &value)).value_or(true)) {
      if (!got.has_value()) return "--config needs a file";
      args->config_file = value;
    } else if ((got = value_of("--set", &value)).value_or(true)) {
      if (!got.has_value()) return "--set needs key=value";
      args->overrides.push_back(value);
    } else if (arg == "--check-config") {
      args->check_config = true;
    } else if (arg == "--print-config") {
      args->print_config = true;
    } else if (arg == "--version") {
      args->version = true;
    } else if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      return absl::StrCat("unknown argument '", arg, "'");
    }
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  using kvcellar::server::Config;
  Args args;
  if (std::optional<std::string> err = ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr, "kvcellard: %s\n%s", err->c_str(), kUsage);
    return 2;
  }
  if (args.version) {
    std::printf("kvcellard %s (commit %s, %s, cuda %s)\n", kvcellar::server::kVersion,
                kvcellar::server::kGitCommit, kvcellar::server::kBuildType,
                kvcellar::server::kCudaEnabled ? "on" : "off");
    return 0;
  }

  absl::StatusOr<Config> config = kvcellar::server::LoadConfig(args.config_file, args.overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "kvcellard: invalid configuration: %s\n",
                 std::string(config.status().message()).c_str());
    return 1;
  }
  if (args.check_config) {
    std::printf("configuration ok (digest %s)\n",
                kvcellar::server::ConfigDigest(*config).c_str());
    return 0;
  }
  if (args.print_config) {
    std::fputs(kvcellar::server::ConfigToYaml(*config, /*redact_secrets=*/true).c_str(), stdout);
    return 0;
  }
  kvcellar::platform::SetLogLevel(config->log.level);
  // Debian's Abseil is built with deadlock detection on, which costs ~70 ns per absl::Mutex
  // lock on every RPC; lock order is checked in the tests instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Signals are taken by one thread with sigwait: block them before any other thread exists so
  // every thread inherits the mask. A peer that goes away must not kill the daemon with SIGPIPE.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = kvcellar::server::Daemon::Start(*config, args.config_file.value_or(""));
  if (!daemon.ok()) {
    KVLOG(Error, "startup failed", {{"error", std::string(daemon.status().message())}});
    return 1;
  }
  if (absl::Status s = kvcellar::server::SdNotify(
          absl::StrCat("READY=1\nSTATUS=serving\nMAINPID=", ::getpid()));
      !s.ok()) {
    KVLOG(Warn, "sd_notify failed", {{"error", std::string(s.message())}});
  }
  std::thread signal_thread([&stop_signals, d = daemon->get()] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    KVLOG(Info, "signal received, draining", {{"signal", strsignal(sig)}});
    (void)kvcellar::server::SdNotify("STOPPING=1\nSTATUS=draining");
    d->Shutdown();
  });
  (*daemon)->Wait();
  // Shutdown may have come from elsewhere (never today); wake the signal thread so it can join.
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  daemon->reset();
  KVLOG(Info, "stopped");
  return 0;
}
