#include "platform/bus_fault_guard.h"

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <mutex>

namespace kvcellar::platform {
namespace {

// The jump target of the guarded call running on this thread, or null. Set and cleared by that
// thread only; read by the handler, which runs on the faulting thread.
thread_local sigjmp_buf* tl_guard = nullptr;
struct sigaction g_previous;
std::atomic<bool> g_installed{false};

struct WordAccess {
  uint64_t* word;
  uint64_t value;
};

void StoreWord(void* p) {
  auto* a = static_cast<WordAccess*>(p);
  std::atomic_ref<uint64_t>(*a->word).store(a->value, std::memory_order_release);
}

void LoadWord(void* p) {
  auto* a = static_cast<WordAccess*>(p);
  a->value = std::atomic_ref<uint64_t>(*a->word).load(std::memory_order_acquire);
}

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
    g_installed.store(true, std::memory_order_release);
  });
}

bool BusFaultHandlerInstalled() { return g_installed.load(std::memory_order_acquire); }

bool StoreSharedWord(uint64_t* word, uint64_t value) {
  WordAccess a{word, value};
  if (!BusFaultHandlerInstalled()) {
    StoreWord(&a);
    return true;
  }
  return RunCatchingBusFaults(&StoreWord, &a);
}

bool LoadSharedWord(const uint64_t* word, uint64_t* value) {
  WordAccess a{const_cast<uint64_t*>(word), 0};
  const bool ok = BusFaultHandlerInstalled() ? RunCatchingBusFaults(&LoadWord, &a)
                                             : (LoadWord(&a), true);
  *value = ok ? a.value : 0;
  return ok;
}

bool RunCatchingBusFaults(void (*fn)(void*), void* arg) {
  sigjmp_buf guard;
  if (sigsetjmp(guard, /*savemask=*/0) != 0) return false;  // tl_guard was cleared.
  tl_guard = &guard;
  fn(arg);
  tl_guard = nullptr;
  return true;
}

}  // namespace kvcellar::platform
