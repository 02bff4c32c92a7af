// Test helper: runs one function per rank in forked child processes.
//
// Gloo devices and contexts own threads and sockets, so they must be created only in the
// children, after fork() (process/fork_children.h). Each child runs body(rank) and leaves with
// _exit(code) (never returning into GoogleTest); the parent waits with a deadline and SIGKILLs
// stragglers, so a test can never hang. Children report failures on stderr and through their exit
// code. Set TESSEL_COMM_DEBUG_HANG=1 to print the stacks of hung children (with gdb) before they
// are killed.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessel/comm/store.h"
#include "tessel/core/error.h"
#include "tessel/process/fork_children.h"
#include "tessel/testing/testing.h"

namespace tessel::comm::testing {

using RankOutcome = process::ChildOutcome;

inline std::string describe(const std::vector<RankOutcome>& outcomes) {
  std::string s;
  for (size_t r = 0; r < outcomes.size(); ++r)
    s += "rank " + std::to_string(r) + ": " + outcomes[r].describe() + "\n";
  return s;
}

// Exit codes a child body uses.
inline constexpr int kChildOk = 0;
inline constexpr int kChildCheckFailed = 1;
inline constexpr int kChildThrew = process::kChildThrew;

// Forks `n` children, child r runs body(r) and exits with its return value (an escaping
// exception exits with kChildThrew after printing it). Waits at most `deadline` for all of them.
inline std::vector<RankOutcome> run_ranks(int n, std::chrono::milliseconds deadline,
                                          const std::function<int(int)>& body) {
  process::ForkOptions options;
  options.deadline = deadline;
  if (std::getenv("TESSEL_COMM_DEBUG_HANG") != nullptr) {
    // Debugging aid: the stacks of a hung child, before it is killed.
    options.before_kill = [](pid_t pid) {
      const std::string cmd = "gdb -batch -ex 'thread apply all bt' -p " + std::to_string(pid) +
                              " 2>&1 | grep -E '^#|^Thread' >&2";
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "gdb failed\n");
    };
  }
  return process::run_forked(n, body, options);
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

// A file store in `dir` for job `job_id`: the rendezvous of the tests' communicators.
inline StoreOptions file_store(const tessel::testing::TempDir& dir, const std::string& job_id,
                               int64_t generation = 0,
                               std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  StoreOptions o;
  o.path = (dir.path() / "rendezvous").string();
  o.job_id = job_id;
  o.generation = generation;
  o.timeout = timeout;
  return o;
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Children signal each other through files in the test's directory.
inline void touch(const tessel::testing::TempDir& dir, const std::string& name) {
  std::ofstream(dir.path() / name).put('x');
}

// Waits for a file another child creates; the parent's deadline bounds the wait.
inline void wait_for_file(const tessel::testing::TempDir& dir, const std::string& name) {
  while (!std::filesystem::exists(dir.path() / name))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
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
