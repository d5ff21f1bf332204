// BusFaultGuard: runs a copy over another process's shared memory so that a SIGBUS it takes
// (the owner truncated or shrank the object under our mapping) fails the copy instead of killing
// the process.
//
// The sim device maps engine memory that engines create (shm objects, memfds): an engine that
// ftruncates its object makes every later access to the missing pages raise SIGBUS, and without
// this the daemon's copy thread would take the whole daemon, and every other engine's cache, down
// with it. A process-wide SIGBUS handler, installed once, jumps back to the guarded call when the
// fault happened on a thread inside one; any other SIGBUS goes to the handler installed before it
// (or the default action: the process dies with a core, as before).
//
// The guarded function must not own anything with a destructor in the frames a fault skips, nor
// hold locks: a fault abandons them mid-way (plain loops of memcpy over raw pointers qualify).
#ifndef KVCELLAR_PLATFORM_BUS_FAULT_GUARD_H_
#define KVCELLAR_PLATFORM_BUS_FAULT_GUARD_H_

#include <cstdint>

namespace kvcellar::platform {

// Installs the handler (idempotent, thread-safe). Call before the first guarded copy.
void InstallBusFaultHandler();

// Runs fn(arg); false when it took a SIGBUS (fn stopped at the fault). InstallBusFaultHandler
// must have run. Guarded calls do not nest on one thread.
bool RunCatchingBusFaults(void (*fn)(void*), void* arg);

// Whether this process installed the handler (the daemon does, through its sim device; engine
// processes never do: the client library leaves their signal handlers alone).
bool BusFaultHandlerInstalled();

// Release store / acquire load of a 64-bit word in shared memory another process may truncate
// (signal words): with the handler installed, a fault drops the store or reads 0, and the
// functions return false; without it they are plain atomic accesses.
bool StoreSharedWord(uint64_t* word, uint64_t value);
bool LoadSharedWord(const uint64_t* word, uint64_t* value);

}  // namespace kvcellar::platform

#endif  // KVCELLAR_PLATFORM_BUS_FAULT_GUARD_H_
