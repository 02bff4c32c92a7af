// ParentWatch: a worker's watch on the process that started it (its launcher), for workers that
// must outlive their launcher briefly -- to save what they hold -- but never for long.
//
// `tessel train` serves the job's embedded control store and supervises the workers. When it dies
// (the OOM killer, a crash, kill -9) the workers lose their control plane: killing them with it
// (PDEATHSIG SIGKILL) loses the steps since the last checkpoint, and leaving them running makes
// orphans nobody stops. So each worker watches its launcher:
//  * Promptly, without polling: a thread of the watch's own waits on a pidfd of the launcher
//    (pidfd_open); where pidfds are unsupported, it compares getppid() every 100 ms. The
//    launcher's parent-death signal (LaunchOptions::parent_death_signal; `tessel train` gives
//    SIGHUP) is blocked on the constructing thread -- so on every thread started after it -- and
//    read by the watch (a signalfd): from then on it wakes the watch instead of ending the
//    process. Before the watch exists it still ends the process, which then holds nothing.
//  * When the launcher is gone: stdout and stderr, pipes only the launcher read, are pointed at
//    `console_fd` (the launcher's console, inherited; /dev/null when -1), so the process's last
//    lines reach the user instead of a broken pipe (SIGPIPE is ignored from construction on, so
//    no write in between can end the process); then on_gone() runs once, on the watch's thread.
//  * `grace` after that, on_overdue() runs once, on the watch's thread, unless the watch was
//    destroyed first. It is the caller's watchdog: a process boundary ends the process there (the
//    library itself never exits), so that whatever the process is blocked on -- a collective whose
//    peer is gone, a save that cannot finish -- it is gone within `grace` of its launcher.
//
// Construct the watch on the process's main thread before any other thread starts: the signal
// mask is inherited by threads started later, and one started earlier could still take the
// signal's default action. The callbacks must not throw (what they throw is dropped) nor destroy
// the watch. A process stopped by SIGSTOP runs no thread: it notices once it is continued.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

namespace tessel::process {

struct ParentWatchOptions {
  pid_t parent = 0;      // the launcher's pid, as it told this process (> 0)
  int death_signal = 0;  // the parent-death signal the launcher armed; 0: none
  int console_fd = -1;   // where stdout and stderr go once the launcher is gone; -1: /dev/null
  std::chrono::milliseconds grace{30000};  // from on_gone to on_overdue (>= 0)
  std::function<void()> on_gone;           // the launcher is gone (may be empty)
  std::function<void()> on_overdue;        // `grace` later (may be empty)
};

class ParentWatch {
 public:
  // Starts watching. When `parent` is not this process's parent (any more), it is gone at once.
  // Throws ConfigError for a bad option, IoError when the signalfd, the eventfd or the thread
  // cannot be made.
  explicit ParentWatch(ParentWatchOptions options);
  // Stops the watch (and with it a pending on_overdue); waits for a callback that is running.
  // The signal mask and SIGPIPE's action come back only if the launcher is still there: once it
  // is gone, its pending parent-death signal would end the process.
  ~ParentWatch();
  ParentWatch(const ParentWatch&) = delete;
  ParentWatch& operator=(const ParentWatch&) = delete;

  // True once the launcher is known to be gone (before on_gone runs).
  bool gone() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::process
