// Test helper: runs one function per rank in forked child processes.
//
// Gloo devices and contexts own threads and sockets, so they must be created only in the
// children, after fork(). Each child runs body(rank) and leaves with _exit(code) (never returning
// into GoogleTest); the parent waits with a deadline and SIGKILLs stragglers, so a test can never
// hang. Children report failures on stderr and through their exit code. Set
// TESSEL_COMM_DEBUG_HANG=1 to print the stacks of hung children (with gdb) before they are killed.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessel/core/error.h"

namespace tessel::comm::testing {

struct RankOutcome {
  int exit_code = -1;  // valid when the child exited normally
  int signal = 0;      // the signal that ended it, 0 if it exited
  bool killed_at_deadline = false;
  bool ok() const { return signal == 0 && exit_code == 0; }
};

inline std::string describe(const std::vector<RankOutcome>& outcomes) {
  std::string s;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const auto& o = outcomes[r];
    s += "rank " + std::to_string(r) + ": ";
    if (o.killed_at_deadline) {
      s += "HUNG (killed at the deadline)";
    } else if (o.signal != 0) {
      s += "killed by signal " + std::to_string(o.signal);
    } else {
      s += "exit " + std::to_string(o.exit_code);
    }
    s += "\n";
  }
  return s;
}

// Exit codes a child body uses.
inline constexpr int kChildOk = 0;
inline constexpr int kChildCheckFailed = 1;
inline constexpr int kChildThrew = 2;

// Forks `n` children, child r runs body(r) and exits with its return value (an escaping
// exception exits with kChildThrew after printing it). Waits at most `deadline` for all of them.
inline std::vector<RankOutcome> run_ranks(int n, std::chrono::milliseconds deadline,
                                          const std::function<int(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = kChildThrew;
      try {
        code = body(r);
      } catch (const tessel::Error& e) {
        std::fprintf(stderr, "[rank %d] uncaught %s: %s\n", r, e.kind(), e.what());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] uncaught exception: %s\n", r, e.what());
      } catch (...) {
        std::fprintf(stderr, "[rank %d] uncaught unknown exception\n", r);
      }
      std::fflush(stderr);
      _exit(code);
    }
    if (pid < 0) {
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      throw std::runtime_error("fork failed");
    }
    pids.push_back(pid);
  }

  std::vector<RankOutcome> outcomes(static_cast<size_t>(n));
  std::vector<bool> reaped(static_cast<size_t>(n), false);
  const auto end = std::chrono::steady_clock::now() + deadline;
  int left = n;
  while (left > 0 && std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < n; ++r) {
      if (reaped[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        reaped[r] = true;
        --left;
        if (WIFEXITED(status)) outcomes[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) outcomes[r].signal = WTERMSIG(status);
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int r = 0; r < n; ++r) {
    if (reaped[r]) continue;
    if (std::getenv("TESSEL_COMM_DEBUG_HANG") != nullptr) {
      // Debugging aid: the stacks of a hung child, before it is killed.
      std::string cmd = "gdb -batch -ex 'thread apply all bt' -p " + std::to_string(pids[r]) +
                        " 2>&1 | grep -E '^#|^Thread' >&2";
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "gdb failed\n");
    }
    kill(pids[r], SIGKILL);
    int status = 0;
    waitpid(pids[r], &status, 0);
    outcomes[r].killed_at_deadline = true;
    outcomes[r].signal = SIGKILL;
  }
  return outcomes;
}

// What a call threw, for children that expect a failure.
enum class Thrown { kNothing, kTimeout, kPeerLost, kOther };

inline const char* thrown_name(Thrown t) {
  switch (t) {
    case Thrown::kNothing:
      return "nothing";
    case Thrown::kTimeout:
      return "TimeoutError";
    case Thrown::kPeerLost:
      return "PeerLostError";
    default:
      return "another exception";
  }
}

// What a call threw and its message, for checks on the message.
struct Caught {
  Thrown kind = Thrown::kNothing;
  std::string what;
};

// Runs f and reports what it threw (printed to stderr with the rank, so a failing child's log
// says what it saw).
template <typename F>
Caught catch_error(int rank, F&& f) {
  Caught c;
  try {
    f();
  } catch (const tessel::TimeoutError& e) {
    c = {Thrown::kTimeout, e.what()};
  } catch (const tessel::PeerLostError& e) {
    c = {Thrown::kPeerLost, e.what()};
  } catch (const std::exception& e) {
    c = {Thrown::kOther, e.what()};
  }
  if (c.kind != Thrown::kNothing)
    std::fprintf(stderr, "[rank %d] %s: %s\n", rank, thrown_name(c.kind), c.what.c_str());
  return c;
}

template <typename F>
Thrown what_throws(int rank, F&& f) {
  return catch_error(rank, std::forward<F>(f)).kind;
}

}  // namespace tessel::comm::testing

// Inside a child body: on failure print where and what, and return kChildCheckFailed.
#define CHILD_CHECK(cond, rank, msg)                                                       \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "[rank %d] %s:%d check failed: %s (%s)\n", int(rank), __FILE__, \
                   __LINE__, #cond, std::string(msg).c_str());                             \
      return ::tessel::comm::testing::kChildCheckFailed;                                   \
    }                                                                                      \
  } while (0)
