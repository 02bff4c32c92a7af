// The profiler's harness (profile_harness.h): scratch directory, shared barrier, forked children.
#include "tessel/planner/profile_harness.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tessel/core/check.h"
#include "tessel/process/fork_children.h"

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
  auto child = [&](int i) {
    try {
      write_text(dir / fmt::format("child-{}.out", i), body(i));
      return 0;
    } catch (const std::exception& e) {
      write_text(dir / fmt::format("child-{}.err", i), e.what());
    } catch (...) {
      write_text(dir / fmt::format("child-{}.err", i), "unknown exception");
    }
    return 1;
  };
  process::ForkOptions how;
  how.deadline = timeout;
  how.stop_on_failure = true;  // the others would wait for the failed one at a barrier
  std::vector<process::ChildOutcome> outcomes;
  try {
    outcomes = process::run_forked(n, child, how);
  } catch (const IoError& e) {
    TESSEL_THROW(IoError, "profile: {}: {}", what, e.what());
  }
  for (int i = 0; i < n; ++i) {
    const auto& o = outcomes[size_t(i)];
    if (o.ok() || o.killed_after_failure || o.killed_at_deadline) continue;
    const fs::path err = dir / fmt::format("child-{}.err", i);
    TESSEL_THROW(Error, "profile: {} failed in process {} of {}: {}", what, i, n,
                 fs::exists(err) ? read_text(err) : o.describe());
  }
  TESSEL_CHECK(std::none_of(outcomes.begin(), outcomes.end(),
                            [](const auto& o) { return o.killed_at_deadline; }),
               TimeoutError,
               "profile: {} did not finish within {:.0f} s (the machine may be overloaded, or the "
               "sizes too large); the processes were killed",
               what, std::chrono::duration<double>(timeout).count());
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(read_text(dir / fmt::format("child-{}.out", i)));
  return out;
}

}  // namespace tessel::planner::detail
