#include "gpu/bus_fault_guard.h"

#include <csetjmp>
#include <csignal>
#include <mutex>

namespace kvcellar::gpu {
namespace {

// The jump target of the guarded call running on this thread, or null. Set and cleared by that
// thread only; read by the handler, which runs on the faulting thread.
thread_local sigjmp_buf* tl_guard = nullptr;
struct sigaction g_previous;

void OnBusFault(int sig, siginfo_t* info, void* context) {
  if (sigjmp_buf* guard = tl_guard) {
    tl_guard = nullptr;
    siglongjmp(*guard, 1);
  }
  // Not a guarded copy: what happened before this handler was installed.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action: returning re-executes the faulting access, which now kills the process
  // (with a core) exactly as without this handler.
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

void InstallBusFaultHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnBusFault;
    // SA_NODEFER: the handler leaves by siglongjmp without restoring the signal mask, so SIGBUS
    // must not be blocked while it runs (sigsetjmp then need not save the mask: no syscall per
    // guarded call).
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

bool RunCatchingBusFaults(void (*fn)(void*), void* arg) {
  sigjmp_buf guard;
  if (sigsetjmp(guard, /*savemask=*/0) != 0) return false;  // tl_guard was cleared.
  tl_guard = &guard;
  fn(arg);
  tl_guard = nullptr;
  return true;
}

}  // namespace kvcellar::gpu
