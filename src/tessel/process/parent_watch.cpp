#include "tessel/process/parent_watch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

#include "tessel/core/check.h"

namespace tessel::process {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Without pidfds (Linux < 5.3), getppid() is compared this often.
constexpr milliseconds kPpidPoll{100};

#ifndef SYS_pidfd_open
constexpr long kPidfdOpen = 434;  // the same number on every architecture
#else
constexpr long kPidfdOpen = SYS_pidfd_open;
#endif

// A pidfd of `pid`, readable once it has exited; -1 when the kernel has none (or `pid` is gone:
// the getppid() check says so).
int open_pidfd(pid_t pid) {
  const long fd = ::syscall(kPidfdOpen, pid, 0);
  if (fd < 0) return -1;
  ::fcntl(int(fd), F_SETFD, FD_CLOEXEC);
  return int(fd);
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

struct ParentWatch::Impl {
  ParentWatchOptions o;
  int stop_fd = -1;    // eventfd: the destructor's wakeup
  int signal_fd = -1;  // the death signal, blocked and read here (-1: none)
  int pid_fd = -1;     // the launcher (-1: compare getppid() instead)
  sigset_t old_mask{};
  struct sigaction old_pipe {};
  std::atomic<bool> gone{false};
  std::thread thread;

  explicit Impl(ParentWatchOptions options) : o(std::move(options)) {
    TESSEL_CHECK(o.parent > 0, ConfigError,
                 "parent watch: the parent's pid must be positive, got {}", o.parent);
    TESSEL_CHECK(o.death_signal >= 0 && o.death_signal < NSIG && o.death_signal != SIGKILL &&
                     o.death_signal != SIGSTOP,
                 ConfigError, "parent watch: {} is not a signal that can be watched",
                 o.death_signal);
    TESSEL_CHECK(o.grace.count() >= 0, ConfigError,
                 "parent watch: the grace ({} ms) must not be negative", o.grace.count());
    stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    TESSEL_CHECK(stop_fd >= 0, IoError, "parent watch: cannot create an eventfd: {}",
                 std::strerror(errno));
    // From here on a write to a pipe the launcher no longer reads fails with EPIPE instead of
    // ending the process before it could save.
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, &old_pipe);
    sigset_t none;
    sigemptyset(&none);
    ::pthread_sigmask(SIG_BLOCK, &none, &old_mask);
    if (o.death_signal != 0) {
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, o.death_signal);
      ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
      signal_fd = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
      if (signal_fd < 0) {
        const int err = errno;
        restore();
        close_all();
        TESSEL_THROW(IoError, "parent watch: cannot create a signalfd: {}", std::strerror(err));
      }
    }
    // The pidfd is the launcher's only if it is still this process's parent after opening it: a
    // parent changes once (to the reaper) and never back.
    pid_fd = open_pidfd(o.parent);
    try {
      thread = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      restore();
      close_all();
      TESSEL_THROW(IoError, "parent watch: cannot start its thread: {}", e.what());
    }
  }

  ~Impl() {
    const uint64_t one = 1;
    if (::write(stop_fd, &one, sizeof one) < 0) {
      // An eventfd write fails only on overflow: a wakeup is pending anyway.
    }
    thread.join();
    if (!gone) restore();
    close_all();
  }

  // The caller's signal mask and SIGPIPE action.
  void restore() {
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    ::sigaction(SIGPIPE, &old_pipe, nullptr);
  }

  void close_all() {
    close_fd(stop_fd);
    close_fd(signal_fd);
    close_fd(pid_fd);
  }

  // Waits for `fds` (the first one the stop eventfd) up to `timeout_ms` (-1: no bound); returns
  // false when the watch is being destroyed.
  bool wait(pollfd* fds, nfds_t n, int timeout_ms) {
    for (nfds_t i = 0; i < n; ++i) fds[i].revents = 0;
    const int r = ::poll(fds, n, timeout_ms);
    if (r < 0 && errno != EINTR) {
      // Cannot happen with valid fds; wait as the fallback would rather than spin.
      std::this_thread::sleep_for(kPpidPoll);
    }
    return !(fds[0].revents & POLLIN);
  }

  void run() {
    // Until the launcher is gone: its pidfd turns readable when it exits; the death signal and,
    // without a pidfd, the clock are wakeups to look at getppid() again.
    pollfd fds[3] = {{stop_fd, POLLIN, 0}, {signal_fd, POLLIN, 0}, {pid_fd, POLLIN, 0}};
    for (;;) {
      if (::getppid() != o.parent) break;
      if (!wait(fds, 3, pid_fd >= 0 ? -1 : int(kPpidPoll.count()))) return;
      if (fds[2].revents != 0) break;  // the launcher exited (POLLIN), or the fd broke (POLLERR)
      if (fds[1].revents & POLLIN) {
        signalfd_siginfo info;
        while (::read(signal_fd, &info, sizeof info) > 0) {
        }
      }
    }
    gone = true;
    const int target = o.console_fd >= 0 ? o.console_fd : ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (target >= 0) {
      ::dup2(target, STDOUT_FILENO);
      ::dup2(target, STDERR_FILENO);
      if (target != o.console_fd) ::close(target);
    }
    try {
      if (o.on_gone) o.on_gone();
    } catch (...) {
      // Documented: callbacks do not throw; one that does must not end the watch's thread.
    }
    const auto deadline = Clock::now() + o.grace;
    for (;;) {
      const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      if (!wait(fds, 1, int(left.count()))) return;
    }
    try {
      if (o.on_overdue) o.on_overdue();
    } catch (...) {
    }
  }
};

ParentWatch::ParentWatch(ParentWatchOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

ParentWatch::~ParentWatch() = default;

bool ParentWatch::gone() const {
  return impl_->gone;
}

}  // namespace tessel::process
