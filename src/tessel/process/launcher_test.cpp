#include "tessel/process/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::process {
namespace {

using std::chrono::milliseconds;
using tessel::testing::TempDir;

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

int count_open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Runs a launch whose console goes to a file in `dir`; returns the result and the console text.
struct Run {
  LaunchResult result;
  std::string console;
};

Run run_with_console(LaunchOptions o, const TempDir& dir) {
  std::string path = (dir / "console.txt").string();
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0);
  o.console_fd = fd;
  Run r;
  r.result = launch(o);
  close(fd);
  r.console = read_file(path);
  return r;
}

LaunchOptions sh(int nproc, const std::string& script, const TempDir& dir) {
  LaunchOptions o;
  o.nproc = nproc;
  o.command = {"/bin/sh", "-c", script};
  o.log_dir = (dir / "logs").string();
  o.console_fd = -1;  // tests that look at the console use run_with_console
  return o;
}

TEST(Launcher, AllSucceedLogsPerRankAndPrefixedConsole) {
  TempDir dir;
  auto o = sh(3, "echo hello $RANK $WORLD_SIZE; echo oops $RANK >&2", dir);
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.failure, "");
  EXPECT_EQ(r.failed_rank, -1);
  ASSERT_EQ(r.workers.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    const auto& w = r.workers[static_cast<size_t>(rank)];
    EXPECT_EQ(w.rank, rank);
    EXPECT_GT(w.pid, 0);
    EXPECT_TRUE(w.ok());
    EXPECT_FALSE(w.stopped_by_launcher);
    std::string log = read_file(dir / "logs" / ("rank" + std::to_string(rank) + ".log"));
    std::multiset<std::string> got;
    for (auto& l : lines_of(log)) got.insert(l);
    std::multiset<std::string> want = {"hello " + std::to_string(rank) + " 3",
                                       "oops " + std::to_string(rank)};
    EXPECT_EQ(got, want) << log;
    EXPECT_TRUE(contains(
        console, "[rank " + std::to_string(rank) + "] hello " + std::to_string(rank) + " 3\n"))
        << console;
    EXPECT_TRUE(contains(console,
                         "[rank " + std::to_string(rank) + "] oops " + std::to_string(rank) + "\n"))
        << console;
  }
  EXPECT_EQ(lines_of(console).size(), 6u) << console;
}

TEST(Launcher, ConsoleWithoutPrefix) {
  TempDir dir;
  auto o = sh(1, "echo plain", dir);
  o.prefix_console = false;
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(console, "plain\n");
}

TEST(Launcher, SetsRankEnvironment) {
  TempDir dir;
  auto o = sh(2,
              "echo \"R=$RANK W=$WORLD_SIZE LR=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE TR=$TESSEL_RANK "
              "TW=$TESSEL_WORLD_SIZE G=$TESSEL_GENERATION FOO=$FOO\"; echo \"JOB=$TESSEL_JOB_ID\"; "
              "echo \"STORE=$TESSEL_STORE_DIR\"; test -d \"$TESSEL_STORE_DIR\" && echo store-ok; "
              "echo \"OMP=$OMP_NUM_THREADS\"",
              dir);
  o.extra_env = {{"FOO", "bar baz"}, {"RANK", "overridden-by-launcher"}};
  auto r = launch(o);
  ASSERT_EQ(r.exit_code, 0) << r.failure;
  EXPECT_FALSE(r.job_id.empty());
  const char* omp = std::getenv("OMP_NUM_THREADS");
  std::string want_omp = omp ? omp : std::to_string(default_omp_threads(2));
  for (int rank = 0; rank < 2; ++rank) {
    std::string R = std::to_string(rank);
    auto lines = lines_of(read_file(dir / "logs" / ("rank" + R + ".log")));
    ASSERT_EQ(lines.size(), 5u);
    EXPECT_EQ(lines[0], "R=" + R + " W=2 LR=" + R + " LW=2 TR=" + R + " TW=2 G=0 FOO=bar baz");
    EXPECT_EQ(lines[1], "JOB=" + r.job_id);
    EXPECT_EQ(lines[2], "STORE=" + r.store_dir);
    EXPECT_EQ(lines[3], "store-ok");
    EXPECT_EQ(lines[4], "OMP=" + want_omp);
  }
  EXPECT_TRUE(std::filesystem::path(r.store_dir).is_absolute());
  EXPECT_FALSE(std::filesystem::exists(r.store_dir)) << "default store dir must be removed";
}

TEST(Launcher, GivenJobIdStoreDirAndOmpAreKept) {
  TempDir dir;
  auto o = sh(1, "echo $TESSEL_JOB_ID $OMP_NUM_THREADS; touch \"$TESSEL_STORE_DIR/x\"", dir);
  o.job_id = "job42";
  o.store_dir = (dir / "store").string();
  o.extra_env = {{"OMP_NUM_THREADS", "3"}};
  auto r = launch(o);
  ASSERT_EQ(r.exit_code, 0) << r.failure;
  EXPECT_EQ(read_file(dir / "logs" / "rank0.log"), "job42 3\n");
  EXPECT_TRUE(std::filesystem::exists(dir / "store" / "x"));
}

// A launcher killed before it removed its default store dir leaves it behind: the next launch
// that makes one in the same place removes it (its launcher's pid, in the name, is gone), and
// keeps those of launchers still running.
TEST(Launcher, StoreDirsOfLaunchersThatAreGoneAreRemoved) {
  TempDir dir;
  const pid_t gone = fork();
  ASSERT_GE(gone, 0);
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const auto leftover = dir / "logs" / fmt::format("tessel-store-{}-oldjob-abc123", gone);
  const auto running = dir / "logs" / fmt::format("tessel-store-{}-otherjob-def456", getpid());
  std::filesystem::create_directories(leftover / "sub");
  std::filesystem::create_directories(running);
  auto r = launch(sh(1, "true", dir));
  ASSERT_EQ(r.exit_code, 0) << r.failure;
  EXPECT_FALSE(std::filesystem::exists(leftover));
  EXPECT_TRUE(std::filesystem::exists(running));
}

// Workers that meet through a control store get no store dir at all.
TEST(Launcher, NoFileStoreMeansNoStoreDir) {
  TempDir dir;
  auto o = sh(1, "echo \"STORE=${TESSEL_STORE_DIR-unset}\"", dir);
  o.file_store = false;
  auto r = launch(o);
  ASSERT_EQ(r.exit_code, 0) << r.failure;
  EXPECT_EQ(read_file(dir / "logs" / "rank0.log"), "STORE=unset\n");
  EXPECT_TRUE(r.store_dir.empty());
  for (const auto& e : std::filesystem::directory_iterator(dir / "logs"))
    EXPECT_EQ(e.path().filename().string().rfind("tessel-store-", 0), std::string::npos);
}

TEST(Launcher, DefaultOmpThreadsSplitsCores) {
  int all = default_omp_threads(1);
  EXPECT_GE(all, 1);
  EXPECT_EQ(default_omp_threads(all), 1);
  EXPECT_EQ(default_omp_threads(all * 4), 1);
  if (all >= 2) {
    EXPECT_EQ(default_omp_threads(2), all / 2);
  }
}

TEST(Launcher, PartialAndLongLinesAndNoMixingWithinALine) {
  TempDir dir;
  // Each rank writes 200 lines in pieces (printf without newline, then the rest), a 100000-byte
  // line and a last line without a newline.
  auto o = sh(3,
              "i=0; while [ $i -lt 200 ]; do printf 'rank %s ' $RANK; printf 'line %s\\n' $i; "
              "i=$((i+1)); done; head -c 100000 /dev/zero | tr '\\0' x; echo; printf 'tail'",
              dir);
  auto [r, console] = run_with_console(o, dir);
  ASSERT_EQ(r.exit_code, 0) << r.failure;
  std::map<int, int> next_line;
  std::map<int, size_t> xs;
  std::map<int, int> tails;
  for (const auto& line : lines_of(console)) {
    ASSERT_EQ(line.rfind("[rank ", 0), 0u) << line.substr(0, 80);
    int rank = line[6] - '0';
    std::string body = line.substr(9);
    if (body == "tail") {
      ++tails[rank];
    } else if (!body.empty() && body.find_first_not_of('x') == std::string::npos) {
      xs[rank] += body.size();
    } else {
      // A line from rank R carries R's text only, in order.
      EXPECT_EQ(body, "rank " + std::to_string(rank) + " line " + std::to_string(next_line[rank]));
      ++next_line[rank];
    }
  }
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(next_line[rank], 200);
    EXPECT_EQ(xs[rank], 100000u);
    EXPECT_EQ(tails[rank], 1);
    std::string log = read_file(dir / "logs" / ("rank" + std::to_string(rank) + ".log"));
    EXPECT_TRUE(contains(log, "rank " + std::to_string(rank) + " line 199\n"));
    EXPECT_EQ(log.substr(log.size() - 5), "tail\n");
  }
}

TEST(Launcher, KilledWorkerStopsTheOthersAndIsNamed) {
  TempDir dir;
  auto o = sh(3, "if [ $RANK = 1 ]; then sleep 0.2; kill -9 $$; fi; sleep 100", dir);
  o.stop_timeout = milliseconds(5000);
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.failure, "rank 1 (pid " + std::to_string(r.workers[1].pid) +
                           ") was killed by signal 9 (SIGKILL)");
  EXPECT_TRUE(r.workers[1].signaled);
  EXPECT_EQ(r.workers[1].signal, SIGKILL);
  EXPECT_FALSE(r.workers[1].stopped_by_launcher);
  for (int rank : {0, 2}) {
    const auto& w = r.workers[static_cast<size_t>(rank)];
    EXPECT_TRUE(w.stopped_by_launcher);
    // Ended by the launcher's SIGTERM (not the later SIGKILL, not by finishing `sleep 100`).
    EXPECT_TRUE(w.signaled);
    EXPECT_EQ(w.signal, SIGTERM);
    EXPECT_LT(w.wall, milliseconds(50000));
  }
  EXPECT_TRUE(contains(console, "[launcher] " + r.failure)) << console;
}

TEST(Launcher, WorkerIgnoringSigtermIsKilledAfterStopTimeout) {
  TempDir dir;
  // Rank 0 fails only once rank 1 ignores SIGTERM (the marker file), whatever the machine load.
  auto o =
      sh(2,
         "if [ $RANK = 0 ]; then while [ ! -e \"$TESSEL_STORE_DIR/ignoring\" ]; do sleep 0.01; "
         "done; exit 3; fi; trap '' TERM; touch \"$TESSEL_STORE_DIR/ignoring\"; sleep 100",
         dir);
  o.stop_timeout = milliseconds(300);
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.failure, "rank 0 (pid " + std::to_string(r.workers[0].pid) + ") exited with code 3");
  const auto& w = r.workers[1];
  EXPECT_TRUE(w.stopped_by_launcher);
  EXPECT_TRUE(w.signaled);
  EXPECT_EQ(w.signal, SIGKILL);
  EXPECT_TRUE(contains(console, "sending SIGKILL to rank(s) 1")) << console;
}

TEST(Launcher, PeerGraceLetsSurvivorsEndOnTheirOwn) {
  TempDir dir;
  // Rank 1 publishes its pid and exits 2. Rank 0 stands in for a worker that gets PeerLostError:
  // it notices rank 1 is gone (reaped by the launcher) and exits 4 by itself. With a grace
  // period the launcher must not SIGTERM it meanwhile (that would make it exit 99).
  auto o = sh(2,
              "if [ $RANK = 1 ]; then echo $$ > \"$TESSEL_STORE_DIR/p.tmp\"; "
              "mv \"$TESSEL_STORE_DIR/p.tmp\" \"$TESSEL_STORE_DIR/pid1\"; exit 2; fi; "
              "trap 'exit 99' TERM; "
              "while [ ! -s \"$TESSEL_STORE_DIR/pid1\" ]; do sleep 0.01; done; "
              "p=$(cat \"$TESSEL_STORE_DIR/pid1\"); "
              "while kill -0 $p 2>/dev/null; do sleep 0.01; done; echo peer lost; exit 4",
              dir);
  o.peer_grace = milliseconds(20000);
  o.stop_timeout = milliseconds(5000);
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(r.workers[0].stopped_by_launcher);
  EXPECT_FALSE(r.workers[0].signaled);
  EXPECT_EQ(r.workers[0].code, 4);
  EXPECT_EQ(read_file(dir / "logs" / "rank0.log"), "peer lost\n");
}

TEST(Launcher, CommandNotFound) {
  TempDir dir;
  LaunchOptions o;
  o.nproc = 2;
  o.command = {"tessel-no-such-command-xyz", "--flag"};
  o.log_dir = (dir / "logs").string();
  auto [r, console] = run_with_console(o, dir);
  EXPECT_EQ(r.exit_code, 127);
  ASSERT_GE(r.failed_rank, 0);
  EXPECT_TRUE(contains(r.failure, "could not run 'tessel-no-such-command-xyz'")) << r.failure;
  EXPECT_TRUE(contains(r.failure, "No such file or directory")) << r.failure;
  EXPECT_EQ(r.workers[static_cast<size_t>(r.failed_rank)].code, 127);
  for (const auto& w : r.workers) {
    EXPECT_TRUE(w.could_not_run);
    // The other rank may be stopped (SIGTERM) between its failed exec and its exit.
    if (w.rank != r.failed_rank && w.signaled) {
      EXPECT_TRUE(w.stopped_by_launcher);
    }
  }
}

TEST(Launcher, ForwardsSigintToWorkers) {
  TempDir dir;
  std::filesystem::create_directories(dir / "ready");
  auto o = sh(3,
              "trap 'echo caught INT; exit 7' INT; touch \"$READY/r$RANK\"; "
              "while true; do sleep 0.05; done",
              dir);
  o.extra_env = {{"READY", (dir / "ready").string()}};
  o.stop_timeout = milliseconds(5000);
  // Send SIGINT to this process only once every worker runs (launch() has its handler in place
  // by then; before that the default action would end the test binary).
  std::thread sender([&] {
    for (int i = 0; i < 2000; ++i) {
      int ready = 0;
      for (int rank = 0; rank < 3; ++rank) {
        ready += std::filesystem::exists(dir / "ready" / ("r" + std::to_string(rank)));
      }
      if (ready == 3) {
        kill(getpid(), SIGINT);
        return;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
  });
  auto [r, console] = run_with_console(o, dir);
  sender.join();
  EXPECT_EQ(r.exit_code, 128 + SIGINT);
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_EQ(r.failure, "the launcher received SIGINT and forwarded it to all workers");
  for (int rank = 0; rank < 3; ++rank) {
    const auto& w = r.workers[static_cast<size_t>(rank)];
    EXPECT_TRUE(w.stopped_by_launcher);
    EXPECT_FALSE(w.signaled);
    EXPECT_EQ(w.code, 7);
    EXPECT_EQ(read_file(dir / "logs" / ("rank" + std::to_string(rank) + ".log")), "caught INT\n");
  }
  // The caller's SIGINT disposition is back (gtest leaves it at the default).
  struct sigaction now {};
  sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

TEST(Launcher, LeavesNoZombiesOrFds) {
  TempDir dir;
  int fds_before = count_open_fds();
  // Includes a grandchild left running in the background: it must not outlive the launch.
  auto o = sh(2, "(sleep 100 &) ; if [ $RANK = 0 ]; then exit 1; fi; sleep 100", dir);
  o.stop_timeout = milliseconds(300);
  auto r = launch(o);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(count_open_fds(), fds_before);
  int status;
  errno = 0;
  EXPECT_EQ(waitpid(-1, &status, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  // The orphaned grandchild got SIGKILL; its group disappears once init has reaped it.
  for (const auto& w : r.workers) {
    bool gone = false;
    for (int i = 0; i < 1000 && !gone; ++i) {
      gone = kill(-w.pid, 0) == -1 && errno == ESRCH;
      if (!gone) std::this_thread::sleep_for(milliseconds(10));
    }
    EXPECT_TRUE(gone) << "process group of rank " << w.rank << " outlived the launch";
  }
}

TEST(Launcher, RejectsBadOptions) {
  LaunchOptions o;
  o.command = {"/bin/true"};
  o.nproc = 0;
  EXPECT_THROW(launch(o), ConfigError);
  o.nproc = 1;
  o.command.clear();
  EXPECT_THROW(launch(o), ConfigError);
  o.command = {""};
  EXPECT_THROW(launch(o), ConfigError);
  o.command = {"/bin/true"};
  o.stop_timeout = milliseconds(-1);
  EXPECT_THROW(launch(o), ConfigError);
  o.stop_timeout = milliseconds(100);
  o.extra_env = {{"A=B", "x"}};
  EXPECT_THROW(launch(o), ConfigError);
}

TEST(Launcher, SignalNames) {
  EXPECT_EQ(signal_name(SIGKILL), "SIGKILL");
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
  WorkerExit e;
  e.signaled = true;
  e.signal = SIGSEGV;
  EXPECT_EQ(e.describe(), "was killed by signal 11 (SIGSEGV)");
}

}  // namespace
}  // namespace tessel::process
