// Runs functions in forked child processes and waits for them within a deadline: the project's one
// fork-and-wait (the profiler measures in children, the multi-process tests run their ranks in
// them; supervisor.h starts programs instead, with exec).
//
// A child runs its function and leaves with _exit, never returning into the caller: libraries
// with threads or sockets (Gloo, OpenMP) must be set up in the child after the fork, and nothing
// of the parent (GoogleTest, atexit handlers) runs twice.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tessel::process {

// How a child ended.
struct ChildOutcome {
  int exit_code = -1;                 // valid when it exited (signal == 0)
  int signal = 0;                     // the signal that ended it, 0 if it exited
  bool killed_at_deadline = false;    // still running at the deadline: killed
  bool killed_after_failure = false;  // killed because another child failed (stop_on_failure)
  bool ok() const { return signal == 0 && exit_code == 0; }
  // "exit 1", "killed by signal 11", "hung (killed at the deadline)", ...
  std::string describe() const;
};

// The exit code of a child whose function threw (the exception is printed on stderr first).
inline constexpr int kChildThrew = 2;

struct ForkOptions {
  std::chrono::milliseconds deadline{60000};  // for all children together
  // The first child that fails gets the others killed at once (they are marked
  // killed_after_failure); otherwise every child runs to its end or the deadline.
  bool stop_on_failure = false;
  // Called with a hung child's pid before it is killed (a debugging aid: print its stacks).
  std::function<void(pid_t)> before_kill;
};

// Forks `n` children; child i runs body(i) and exits with what it returned. Returns each child's
// outcome once all ended or were killed. Throws IoError when a fork fails (the children started
// so far are killed and reaped first).
std::vector<ChildOutcome> run_forked(int n, const std::function<int(int)>& body,
                                     const ForkOptions& options);

}  // namespace tessel::process
