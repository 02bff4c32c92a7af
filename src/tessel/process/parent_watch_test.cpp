// The watch runs in a grandchild of the test: the test forks a "launcher", which forks the watched
// process and then waits to be killed, as `tessel train` is by the OOM killer or kill -9.
#include "tessel/process/parent_watch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/process/fork_children.h"
#include "tessel/process/supervisor.h"
#include "tessel/testing/testing.h"

namespace tessel::process {
namespace {

using std::chrono::milliseconds;
using tessel::testing::TempDir;
namespace fs = std::filesystem;

void touch(const fs::path& p) {
  std::ofstream(p) << "x";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Bounded: a hang fails the test instead of blocking the suite.
bool wait_for(const std::function<bool()>& done, milliseconds bound = milliseconds(20000)) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

// A process that is not ours any more has ended when it is gone or a zombie of its new parent.
bool ended(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
}

struct Family {
  pid_t launcher = -1, watched = -1;
};

// Forks a launcher that forks `watched` (run with the launcher's pid, then _exit(0)) and waits
// to be killed. (The pid is passed: the launcher may be gone before `watched` starts.)
Family start_family(const std::function<void(pid_t)>& watched) {
  int p[2];
  EXPECT_EQ(::pipe(p), 0);
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    ::close(p[0]);
    const pid_t self = ::getpid();
    const pid_t w = ::fork();
    if (w == 0) {
      ::close(p[1]);
      watched(self);
      ::_exit(0);
    }
    if (::write(p[1], &w, sizeof w) != ssize_t(sizeof w)) ::_exit(1);
    ::close(p[1]);
    for (int i = 0; i < 600; ++i) ::usleep(100000);  // at most a minute
    ::_exit(0);
  }
  ::close(p[1]);
  Family f;
  f.launcher = launcher;
  if (::read(p[0], &f.watched, sizeof f.watched) != ssize_t(sizeof f.watched)) f.watched = -1;
  ::close(p[0]);
  return f;
}

void kill_launcher(const Family& f) {
  ::kill(f.launcher, SIGKILL);
  int status = 0;
  ::waitpid(f.launcher, &status, 0);
}

// The launcher SIGKILLed: its death signal (armed as the launcher arms it) does not end the
// watched process, which notices, has its output pointed at the console, and is ended by its
// watchdog `grace` later.
TEST(ParentWatch, NoticesTheLaunchersDeathRedirectsOutputAndFiresTheWatchdog) {
  TempDir dir;
  const fs::path console = dir / "console.txt";
  const Family f = start_family([&](pid_t launcher) {
    ::prctl(PR_SET_PDEATHSIG, SIGHUP);
    if (::getppid() != launcher) ::_exit(1);  // gone before the signal was armed: cannot be
    const int console_fd = ::open(console.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ParentWatchOptions o;
    o.parent = launcher;
    o.death_signal = SIGHUP;
    o.console_fd = console_fd;
    o.grace = milliseconds(300);
    o.on_gone = [&] {
      const char line[] = "the last line\n";
      if (::write(STDOUT_FILENO, line, sizeof line - 1) < 0) ::_exit(5);
      touch(dir / "gone");
    };
    o.on_overdue = [&] {
      touch(dir / "overdue");
      ::_exit(3);
    };
    ParentWatch watch(o);
    touch(dir / "armed");
    for (int i = 0; i < 600; ++i) ::usleep(100000);
    touch(dir / "outlived");
  });
  ASSERT_GT(f.watched, 0);
  ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "armed"); }));
  kill_launcher(f);
  EXPECT_TRUE(wait_for([&] { return fs::exists(dir / "gone"); }));
  EXPECT_TRUE(wait_for([&] { return fs::exists(dir / "overdue"); }));
  EXPECT_TRUE(wait_for([&] { return ended(f.watched); }));
  EXPECT_FALSE(fs::exists(dir / "outlived"));
  EXPECT_EQ(read_file(console), "the last line\n");
  if (!ended(f.watched)) ::kill(f.watched, SIGKILL);
}

// A launcher already gone when the watch starts is noticed at once; a watch destroyed before
// its grace ran out never fires the watchdog.
TEST(ParentWatch, ALauncherGoneBeforeTheWatchIsNoticedAndDestroyingItCancelsTheWatchdog) {
  TempDir dir;
  const Family f = start_family([&](pid_t launcher) {
    for (int i = 0; i < 2000 && ::getppid() == launcher; ++i) ::usleep(10000);
    {
      ParentWatchOptions o;
      o.parent = launcher;
      o.grace = milliseconds(200);
      o.on_gone = [&] { touch(dir / "gone"); };
      o.on_overdue = [&] { touch(dir / "overdue"); };
      ParentWatch watch(o);
      for (int i = 0; i < 2000 && !watch.gone(); ++i) ::usleep(10000);
    }
    touch(dir / "destroyed");
    ::usleep(400000);  // longer than the grace: a watchdog still armed would fire now
    touch(dir / "done");
  });
  ASSERT_GT(f.watched, 0);
  kill_launcher(f);
  EXPECT_TRUE(wait_for([&] { return fs::exists(dir / "done"); }));
  EXPECT_TRUE(fs::exists(dir / "gone"));
  EXPECT_TRUE(fs::exists(dir / "destroyed"));
  EXPECT_FALSE(fs::exists(dir / "overdue"));
  EXPECT_TRUE(wait_for([&] { return ended(f.watched); }));
}

TEST(ParentWatch, RejectsBadOptions) {
  ParentWatchOptions o;
  EXPECT_THROW(ParentWatch{o}, ConfigError);  // no parent
  o.parent = ::getppid();
  o.death_signal = SIGKILL;
  EXPECT_THROW(ParentWatch{o}, ConfigError);  // cannot be blocked
  o.death_signal = 0;
  o.grace = milliseconds(-1);
  EXPECT_THROW(ParentWatch{o}, ConfigError);
}

// The supervisor's death reaches its workers as SIGKILL by default, and as the signal asked for
// otherwise (here one the worker handles: it writes a file and exits).
TEST(Supervisor, ParentDeathSignalIsSigkillUnlessAnotherIsAsked) {
  for (const int sig : {0, SIGHUP}) {
    SCOPED_TRACE(sig);
    TempDir dir;
    const auto outcomes = run_forked(
        1,
        [&](int) -> int {
          SupervisorOptions o;
          o.console_fd = -1;
          if (sig != 0) o.parent_death_signal = sig;
          Supervisor sup(o);
          WorkerSpec w;
          w.command = {"/bin/sh", "-c",
                       "trap 'echo hup > \"$DIR/hup\"; exit 0' HUP; echo $$ > \"$DIR/pid.tmp\"; "
                       "mv \"$DIR/pid.tmp\" \"$DIR/pid\"; i=0; while [ $i -lt 1200 ]; do sleep "
                       "0.05; i=$((i + 1)); done"};
          w.env = {{"DIR", dir.path().string()}};
          sup.spawn(w);
          for (int i = 0; i < 2000 && !fs::exists(dir / "pid"); ++i) sup.poll(milliseconds(10));
          ::_exit(fs::exists(dir / "pid") ? 0 : 1);  // dies without stopping its worker
        },
        ForkOptions{});
    ASSERT_EQ(outcomes.size(), 1u);
    ASSERT_TRUE(outcomes[0].ok()) << outcomes[0].describe();
    const pid_t worker = std::stoi(read_file(dir / "pid"));
    EXPECT_TRUE(wait_for([&] { return ended(worker); }));
    EXPECT_EQ(fs::exists(dir / "hup"), sig == SIGHUP);
    if (!ended(worker)) ::kill(worker, SIGKILL);
  }
}

}  // namespace
}  // namespace tessel::process
