#include "tessel/process/fork_children.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <thread>

#include "tessel/core/check.h"

namespace tessel::process {

std::string ChildOutcome::describe() const {
  if (killed_at_deadline) return "hung (killed at the deadline)";
  if (killed_after_failure) return "killed after another process failed";
  if (signal != 0) return "killed by signal " + std::to_string(signal);
  return "exit " + std::to_string(exit_code);
}

namespace {

[[noreturn]] void run_child(int i, const std::function<int(int)>& body) {
  int code = kChildThrew;
  try {
    code = body(i);
  } catch (const tessel::Error& e) {
    std::fprintf(stderr, "[child %d] uncaught %s: %s\n", i, e.kind(), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[child %d] uncaught exception: %s\n", i, e.what());
  } catch (...) {
    std::fprintf(stderr, "[child %d] uncaught unknown exception\n", i);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

void kill_and_reap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace

std::vector<ChildOutcome> run_forked(int n, const std::function<int(int)>& body,
                                     const ForkOptions& options) {
  // Buffered output would be written once by the parent and again by every child.
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid == 0) run_child(i, body);
    if (pid < 0) {
      for (pid_t p : pids) kill_and_reap(p);
      TESSEL_THROW(IoError, "fork failed for process {} of {}", i, n);
    }
    pids.push_back(pid);
  }
  std::vector<ChildOutcome> outcomes(static_cast<size_t>(n));
  std::vector<bool> running(static_cast<size_t>(n), true);
  const auto end = std::chrono::steady_clock::now() + options.deadline;
  int left = n;
  bool failed = false;
  while (left > 0 && !failed && std::chrono::steady_clock::now() < end) {
    for (size_t i = 0; i < size_t(n); ++i) {
      int status = 0;
      if (!running[i] || waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
      running[i] = false;
      --left;
      if (WIFEXITED(status)) outcomes[i].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) outcomes[i].signal = WTERMSIG(status);
      failed = failed || (options.stop_on_failure && !outcomes[i].ok());
    }
    if (left > 0 && !failed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (size_t i = 0; i < size_t(n); ++i) {
    if (!running[i]) continue;
    if (!failed && options.before_kill) options.before_kill(pids[i]);
    kill_and_reap(pids[i]);
    outcomes[i].signal = SIGKILL;
    (failed ? outcomes[i].killed_after_failure : outcomes[i].killed_at_deadline) = true;
  }
  return outcomes;
}

}  // namespace tessel::process
