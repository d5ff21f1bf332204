// Lockstep: turn-taking with another process over two pipes. kvcellar_bench_pyclient and
// client/python/bench/bench_calls.py use it to alternate their calls one by one against the same
// daemon, so that both sides' figures come from the same moments of a shared, noisy machine
// rather than from runs seconds apart.
//
// Protocol: one byte per turn. Await() blocks until the other side passes the turn (a byte on
// in_fd); Pass() writes a byte to out_fd. Closing either end (Close(), or the other process
// exiting) ends the lockstep: every later Await/Pass fails at once, so a side that stops early
// never leaves the other waiting.
//
// Threading: one thread.
#ifndef KVCELLAR_TESTS_BENCH_PYCLIENT_LOCKSTEP_H_
#define KVCELLAR_TESTS_BENCH_PYCLIENT_LOCKSTEP_H_

#include <string>

namespace kvcellar::bench {

class Lockstep {
 public:
  Lockstep() = default;  // Disabled: Await and Pass succeed at once.
  Lockstep(int in_fd, int out_fd) : in_fd_(in_fd), out_fd_(out_fd) {}
  ~Lockstep() { Close(); }
  Lockstep(const Lockstep&) = delete;
  Lockstep& operator=(const Lockstep&) = delete;

  bool enabled() const { return in_fd_ >= 0 || out_fd_ >= 0; }
  // False with *error when the other side closed its end, or did not pass within the timeout.
  bool Await(std::string* error);
  bool Pass(std::string* error);
  // Closes both ends (the other side's next Await sees end of file). Idempotent.
  void Close();

 private:
  int in_fd_ = -1;
  int out_fd_ = -1;
  bool closed_ = false;
};

}  // namespace kvcellar::bench

#endif  // KVCELLAR_TESTS_BENCH_PYCLIENT_LOCKSTEP_H_
