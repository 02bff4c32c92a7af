// Internal to the profiler (profiler.h): the harness its measurements run in -- forked child
// processes with a deadline, a process-shared barrier that lines them up, a scratch directory for
// their results and rendezvous files, and the clock and median every measurement uses.
#pragma once

#include <pthread.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "tessel/core/clock.h"  // seconds_since

namespace tessel::planner::detail {

using Clock = std::chrono::steady_clock;

// The median of `v`; throws InvalidArgumentError when it is empty.
double median(std::vector<double> v);

// A fresh directory under the system's temporary directory, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir();  // throws IoError when it cannot be created
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A barrier for forked children: a process-shared pthread barrier in anonymous shared memory,
// created by the parent before it forks.
class SharedBarrier {
 public:
  explicit SharedBarrier(int n);  // throws IoError when it cannot be created
  ~SharedBarrier();
  SharedBarrier(const SharedBarrier&) = delete;
  SharedBarrier& operator=(const SharedBarrier&) = delete;
  void wait() { pthread_barrier_wait(barrier_); }

 private:
  pthread_barrier_t* barrier_ = nullptr;
};

// Runs body(i) for i in [0, n) in forked children and returns what each returned. A child writes
// its result (or its error) to a file in `dir` and leaves with _exit, never returning into the
// caller. The parent waits at most `timeout`; a child that fails or hangs gets every child killed
// and an exception thrown here (the parent never exits): Error carrying the child's message, or
// TimeoutError. `what` names the measurement in those messages.
std::vector<std::string> run_children(int n, std::chrono::milliseconds timeout,
                                      const std::string& what, const std::filesystem::path& dir,
                                      const std::function<std::string(int)>& body);

}  // namespace tessel::planner::detail
