// The profiler's harness (profile_harness.h): scratch directory, shared barrier, forked children.
#include "tessel/planner/profile_harness.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "tessel/core/check.h"

namespace tessel::planner::detail {

namespace fs = std::filesystem;

double median(std::vector<double> v) {
  TESSEL_CHECK(!v.empty(), InvalidArgumentError, "median of no values");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

ScratchDir::ScratchDir() {
  std::string pattern = (fs::temp_directory_path() / "tessel-profile-XXXXXX").string();
  TESSEL_CHECK(mkdtemp(pattern.data()) != nullptr, IoError,
               "profile: cannot create a temporary directory under {} (set TMPDIR to a "
               "writable directory)",
               fs::temp_directory_path().string());
  path_ = pattern;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

SharedBarrier::SharedBarrier(int n) {
  void* mem = mmap(nullptr, sizeof(pthread_barrier_t), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  TESSEL_CHECK(mem != MAP_FAILED, IoError, "profile: cannot map shared memory for a barrier");
  barrier_ = static_cast<pthread_barrier_t*>(mem);
  pthread_barrierattr_t attr;
  pthread_barrierattr_init(&attr);
  pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  const int rc = pthread_barrier_init(barrier_, &attr, unsigned(n));
  pthread_barrierattr_destroy(&attr);
  if (rc != 0) {
    munmap(barrier_, sizeof(pthread_barrier_t));
    TESSEL_THROW(IoError, "profile: cannot create a process-shared barrier (error {})", rc);
  }
}

SharedBarrier::~SharedBarrier() {
  pthread_barrier_destroy(barrier_);
  munmap(barrier_, sizeof(pthread_barrier_t));
}

namespace {

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::vector<std::string> run_children(int n, std::chrono::milliseconds timeout,
                                      const std::string& what, const fs::path& dir,
                                      const std::function<std::string(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  auto kill_all = [&pids] {
    for (pid_t p : pids) {
      if (p > 0) kill(p, SIGKILL);
    }
    for (pid_t p : pids) {
      if (p > 0) waitpid(p, nullptr, 0);
    }
  };
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        write_text(dir / fmt::format("child-{}.out", i), body(i));
      } catch (const std::exception& e) {
        write_text(dir / fmt::format("child-{}.err", i), e.what());
        code = 1;
      } catch (...) {
        write_text(dir / fmt::format("child-{}.err", i), "unknown exception");
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    if (pid < 0) {
      kill_all();
      TESSEL_THROW(IoError, "profile: fork failed for {} (process {} of {})", what, i, n);
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + timeout;
  int left = n;
  while (left > 0) {
    for (int i = 0; i < n; ++i) {
      if (pids[size_t(i)] <= 0) continue;
      int status = 0;
      if (waitpid(pids[size_t(i)], &status, WNOHANG) != pids[size_t(i)]) continue;
      pids[size_t(i)] = 0;
      --left;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      kill_all();
      const fs::path err = dir / fmt::format("child-{}.err", i);
      const std::string why = fs::exists(err) ? read_text(err)
                              : WIFSIGNALED(status)
                                  ? fmt::format("killed by signal {}", WTERMSIG(status))
                                  : fmt::format("exit status {}", WEXITSTATUS(status));
      TESSEL_THROW(Error, "profile: {} failed in process {} of {}: {}", what, i, n, why);
    }
    if (left == 0) break;
    if (Clock::now() > deadline) {
      kill_all();
      TESSEL_THROW(TimeoutError,
                   "profile: {} did not finish within {:.0f} s (the machine may be overloaded, "
                   "or the sizes too large); the processes were killed",
                   what, std::chrono::duration<double>(timeout).count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(read_text(dir / fmt::format("child-{}.out", i)));
  return out;
}

}  // namespace tessel::planner::detail
