#include "tessel/process/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/process/launcher.h"
#include "tessel/testing/testing.h"

namespace tessel::process {
namespace {

using std::chrono::milliseconds;
using tessel::testing::TempDir;

// Workers synchronise with the test through marker files in $DIR, never through sleeps: the
// helpers below wait (bounded) for a file or for exits.
constexpr int kMaxPolls = 200;  // x 100 ms: a hang fails the test instead of blocking the suite

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::multiset<std::string> lines_of(const std::string& text) {
  std::multiset<std::string> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) out.insert(line);
  return out;
}

int count_open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A worker running `script` under /bin/sh with $DIR and $ID set.
WorkerSpec sh(int id, const std::string& script, const TempDir& dir) {
  WorkerSpec s;
  s.id = id;
  s.command = {"/bin/sh", "-c", script};
  s.env = {{"DIR", dir.path().string()}, {"ID", std::to_string(id)}};
  return s;
}

// Touches $DIR/up$ID, then runs until $DIR/leave$ID exists and says goodbye.
const char* kMember =
    "touch \"$DIR/up$ID\"; while [ ! -e \"$DIR/leave$ID\" ]; do sleep 0.01; done; echo bye $ID";

SupervisorOptions options(const TempDir& dir) {
  SupervisorOptions o;
  o.log_dir = (dir / "logs").string();
  o.console_fd = -1;
  o.stop_timeout = milliseconds(5000);
  return o;
}

// Polls (pumping output) until `file` exists; exits seen meanwhile are appended to *exits.
bool wait_for_file(Supervisor& sup, const std::filesystem::path& file,
                   std::vector<WorkerExit>* exits) {
  for (int i = 0; i < kMaxPolls * 10 && !std::filesystem::exists(file); ++i) {
    for (auto& e : sup.poll(milliseconds(10))) exits->push_back(e);
  }
  return std::filesystem::exists(file);
}

// Polls until n exits have been reported (or the bound runs out).
std::vector<WorkerExit> collect(Supervisor& sup, size_t n) {
  std::vector<WorkerExit> exits;
  for (int i = 0; i < kMaxPolls && exits.size() < n; ++i) {
    for (auto& e : sup.poll(milliseconds(100))) exits.push_back(e);
  }
  return exits;
}

bool alive(pid_t pid) {
  return ::kill(pid, 0) == 0;
}

TEST(Supervisor, SpawnWhileOthersRunAndALeaverDoesNotStopTheRest) {
  TempDir dir;
  Supervisor sup(options(dir));
  std::vector<WorkerExit> early;
  pid_t p0 = sup.spawn(sh(0, kMember, dir));
  pid_t p1 = sup.spawn(sh(1, kMember, dir));
  ASSERT_TRUE(wait_for_file(sup, dir / "up0", &early));
  ASSERT_TRUE(wait_for_file(sup, dir / "up1", &early));
  // A third joins while the first two run.
  pid_t p2 = sup.spawn(sh(2, kMember, dir));
  ASSERT_TRUE(wait_for_file(sup, dir / "up2", &early));
  EXPECT_TRUE(early.empty());
  EXPECT_EQ(sup.running(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(sup.pid(2), p2);

  // Worker 1 leaves with exit 0; it is reported, the others go on.
  std::ofstream(dir / "leave1").close();
  auto exits = collect(sup, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].id, 1);
  EXPECT_EQ(exits[0].pid, p1);
  EXPECT_TRUE(exits[0].ok());
  EXPECT_FALSE(exits[0].stopped_by_launcher);
  EXPECT_EQ(read_file(dir / "logs" / "rank1.log"), "bye 1\n");  // complete when reported
  EXPECT_EQ(sup.running(), (std::vector<int>{0, 2}));
  EXPECT_TRUE(alive(p0));
  EXPECT_TRUE(alive(p2));
  EXPECT_TRUE(sup.poll(milliseconds(0)).empty());

  // The survivors still finish by themselves.
  std::ofstream(dir / "leave0").close();
  std::ofstream(dir / "leave2").close();
  exits = collect(sup, 2);
  ASSERT_EQ(exits.size(), 2u);
  for (const auto& e : exits) {
    EXPECT_TRUE(e.ok()) << e.describe();
    EXPECT_EQ(read_file(dir / "logs" / ("rank" + std::to_string(e.id) + ".log")),
              "bye " + std::to_string(e.id) + "\n");
  }
  EXPECT_TRUE(sup.running().empty());
  EXPECT_FALSE(sup.interrupted());
}

TEST(Supervisor, KilledWorkerIsReportedWithItsSignalAndTheOthersKeepRunning) {
  TempDir dir;
  Supervisor sup(options(dir));
  std::vector<WorkerExit> early;
  for (int id = 0; id < 3; ++id) sup.spawn(sh(id, kMember, dir));
  for (int id = 0; id < 3; ++id) {
    ASSERT_TRUE(wait_for_file(sup, dir / ("up" + std::to_string(id)), &early));
  }
  // Killed from outside, as a crashed or OOM-killed worker would be.
  ASSERT_EQ(::kill(sup.pid(1), SIGKILL), 0);
  auto exits = collect(sup, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].id, 1);
  EXPECT_TRUE(exits[0].signaled);
  EXPECT_EQ(exits[0].signal, SIGKILL);
  EXPECT_FALSE(exits[0].stopped_by_launcher);
  EXPECT_EQ(exits[0].describe(), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(sup.running(), (std::vector<int>{0, 2}));

  // The survivors were not disturbed: they end normally when asked to.
  std::ofstream(dir / "leave0").close();
  std::ofstream(dir / "leave2").close();
  exits = collect(sup, 2);
  ASSERT_EQ(exits.size(), 2u);
  for (const auto& e : exits) {
    EXPECT_TRUE(e.ok()) << e.id << " " << e.describe();
    EXPECT_FALSE(e.stopped_by_launcher);
  }
}

TEST(Supervisor, OutputGoesToTheRightLogsWithPrefixes) {
  TempDir dir;
  std::string console_path = (dir / "console.txt").string();
  int fd = open(console_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  auto o = options(dir);
  o.console_fd = fd;
  o.env = {{"GREETING", "hello"}, {"WHO", "base"}};
  std::vector<WorkerExit> exits;
  {
    Supervisor sup(o);
    const char* script = "echo \"$GREETING $WHO $ID\"; echo \"err $ID\" >&2; printf 'last'";
    auto a = sh(0, script, dir);  // defaults: rank0.log, "[rank 0] "
    auto b = sh(7, script, dir);  // custom log file and console prefix; env overrides the base
    b.log_name = "worker-b.log";
    b.console_prefix = "<b> ";
    b.env["WHO"] = "spec";
    sup.spawn(a);
    sup.spawn(b);
    exits = collect(sup, 2);
    EXPECT_EQ(sup.log_path(7), (dir / "logs" / "worker-b.log").string());
  }
  close(fd);
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(lines_of(read_file(dir / "logs" / "rank0.log")),
            (std::multiset<std::string>{"hello base 0", "err 0", "last"}));
  EXPECT_EQ(lines_of(read_file(dir / "logs" / "worker-b.log")),
            (std::multiset<std::string>{"hello spec 7", "err 7", "last"}));
  EXPECT_FALSE(std::filesystem::exists(dir / "logs" / "rank7.log"));
  EXPECT_EQ(lines_of(read_file(console_path)),
            (std::multiset<std::string>{"[rank 0] hello base 0", "[rank 0] err 0", "[rank 0] last",
                                        "<b> hello spec 7", "<b> err 7", "<b> last"}));
}

TEST(Supervisor, StopAllIsBoundedForAWorkerIgnoringSigterm) {
  TempDir dir;
  std::string console_path = (dir / "console.txt").string();
  int fd = open(console_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  auto o = options(dir);
  o.console_fd = fd;
  o.name = "sup";
  o.stop_timeout = milliseconds(200);
  std::vector<WorkerExit> exits;
  {
    Supervisor sup(o);
    sup.spawn(sh(0, "trap '' TERM; touch \"$DIR/up0\"; while true; do sleep 0.05; done", dir));
    sup.spawn(sh(1, kMember, dir));
    std::vector<WorkerExit> early;
    ASSERT_TRUE(wait_for_file(sup, dir / "up0", &early));
    ASSERT_TRUE(wait_for_file(sup, dir / "up1", &early));
    exits = sup.stop_all();
    EXPECT_TRUE(sup.running().empty());
  }
  close(fd);
  ASSERT_EQ(exits.size(), 2u);
  std::map<int, WorkerExit> by_id;
  for (const auto& e : exits) by_id[e.id] = e;
  EXPECT_TRUE(by_id[0].stopped_by_launcher);
  EXPECT_TRUE(by_id[0].signaled);
  EXPECT_EQ(by_id[0].signal, SIGKILL);
  EXPECT_TRUE(by_id[1].stopped_by_launcher);
  EXPECT_TRUE(by_id[1].signaled);
  EXPECT_EQ(by_id[1].signal, SIGTERM);
  std::string console = read_file(console_path);
  EXPECT_NE(console.find("[sup] stop timeout (200 ms) passed; sending SIGKILL to rank(s) 0\n"),
            std::string::npos)
      << console;
}

TEST(Supervisor, StopOneKeepsOthersExitsForTheNextPoll) {
  TempDir dir;
  Supervisor sup(options(dir));
  std::vector<WorkerExit> early;
  pid_t b = sup.spawn(sh(1, kMember, dir));
  // On SIGTERM worker 0 lets worker 1 leave and ends only once 1 has been reaped, so 1's exit
  // arrives while stop(0) waits.
  auto a = sh(0,
              "trap 'touch \"$DIR/leave1\"; while kill -0 $BPID 2>/dev/null; do sleep 0.01; "
              "done; exit 5' TERM; touch \"$DIR/up0\"; while true; do sleep 0.01; done",
              dir);
  a.env["BPID"] = std::to_string(b);
  sup.spawn(a);
  ASSERT_TRUE(wait_for_file(sup, dir / "up0", &early));
  ASSERT_TRUE(wait_for_file(sup, dir / "up1", &early));
  WorkerExit e0 = sup.stop(0);
  EXPECT_EQ(e0.id, 0);
  EXPECT_TRUE(e0.stopped_by_launcher);
  EXPECT_FALSE(e0.signaled);
  EXPECT_EQ(e0.code, 5);
  EXPECT_EQ(sup.running(), std::vector<int>{1});  // reaped, not yet reported
  auto rest = sup.poll(milliseconds(0));
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].id, 1);
  EXPECT_TRUE(rest[0].ok());
  EXPECT_TRUE(sup.running().empty());
  EXPECT_THROW(sup.stop(0), InvalidArgumentError);  // already reported
  EXPECT_FALSE(sup.terminate(1));                   // ended: nothing sent
  EXPECT_THROW(sup.terminate(42), InvalidArgumentError);
}

TEST(Supervisor, PollTimeoutReturnsAndKillIsReported) {
  TempDir dir;
  Supervisor sup(options(dir));
  sup.spawn(sh(0, "while true; do sleep 0.05; done", dir));
  EXPECT_TRUE(sup.poll(milliseconds(0)).empty());
  EXPECT_TRUE(sup.poll(milliseconds(30)).empty());
  EXPECT_EQ(sup.running(), std::vector<int>{0});
  EXPECT_TRUE(sup.kill(0));
  auto exits = collect(sup, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_TRUE(exits[0].signaled);
  EXPECT_EQ(exits[0].signal, SIGKILL);
  EXPECT_TRUE(exits[0].stopped_by_launcher);
  EXPECT_FALSE(sup.kill(0));
}

TEST(Supervisor, RejectsDuplicateIdsAndBadSpecs) {
  TempDir dir;
  Supervisor sup(options(dir));
  sup.spawn(sh(3, "exit 0", dir));
  EXPECT_THROW(sup.spawn(sh(3, "exit 0", dir)), ConfigError);
  ASSERT_EQ(collect(sup, 1).size(), 1u);
  // Still taken after it ended and was reported: a replacement gets a new id.
  EXPECT_THROW(sup.spawn(sh(3, "exit 0", dir)), ConfigError);
  EXPECT_THROW(sup.spawn(sh(-1, "exit 0", dir)), ConfigError);
  WorkerSpec empty;
  empty.id = 4;
  EXPECT_THROW(sup.spawn(empty), ConfigError);
  auto bad_env = sh(5, "exit 0", dir);
  bad_env.env["A=B"] = "x";
  EXPECT_THROW(sup.spawn(bad_env), ConfigError);
  auto bad_log = sh(6, "exit 0", dir);
  bad_log.log_name = "../escape.log";
  EXPECT_THROW(sup.spawn(bad_log), ConfigError);
  EXPECT_TRUE(sup.running().empty());
  EXPECT_THROW(sup.pid(4), InvalidArgumentError);

  // One supervisor per process: a second one on this thread (or launch()) would wait forever.
  EXPECT_THROW(Supervisor second(options(dir)), ConfigError);
  LaunchOptions lo;
  lo.command = {"/bin/true"};
  lo.console_fd = -1;
  EXPECT_THROW(launch(lo), ConfigError);
}

TEST(Supervisor, CommandThatCannotRunIsAnExitNotAThrow) {
  TempDir dir;
  Supervisor sup(options(dir));
  WorkerSpec s;
  s.id = 0;
  s.command = {"tessel-no-such-command-xyz"};
  EXPECT_GT(sup.spawn(s), 0);
  auto exits = collect(sup, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_TRUE(exits[0].could_not_run);
  EXPECT_EQ(exits[0].code, 127);
  EXPECT_EQ(exits[0].describe("tessel-no-such-command-xyz"),
            "could not run 'tessel-no-such-command-xyz': No such file or directory (exit code "
            "127)");
}

TEST(Supervisor, ForwardsInterruptThenASecondOneKills) {
  TempDir dir;
  auto o = options(dir);
  o.stop_timeout = milliseconds(60000);  // only the second SIGINT can end worker 1 in time
  Supervisor sup(o);
  sup.spawn(sh(0, "trap 'exit 7' INT; touch \"$DIR/up0\"; while true; do sleep 0.01; done", dir));
  sup.spawn(sh(1, "trap '' INT; touch \"$DIR/up1\"; while true; do sleep 0.01; done", dir));
  std::vector<WorkerExit> early;
  ASSERT_TRUE(wait_for_file(sup, dir / "up0", &early));
  ASSERT_TRUE(wait_for_file(sup, dir / "up1", &early));
  ASSERT_TRUE(early.empty());
  EXPECT_FALSE(sup.interrupted());
  // The supervisor's handler is installed, so this only queues the signal for the next poll.
  ASSERT_EQ(::kill(getpid(), SIGINT), 0);
  auto exits = collect(sup, 1);
  EXPECT_TRUE(sup.interrupted());
  EXPECT_EQ(sup.interrupt_signal(), SIGINT);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].id, 0);
  EXPECT_EQ(exits[0].code, 7);
  EXPECT_TRUE(exits[0].stopped_by_launcher);
  EXPECT_EQ(sup.running(), std::vector<int>{1});  // ignores SIGINT, SIGKILL is 60 s away

  ASSERT_EQ(::kill(getpid(), SIGINT), 0);
  exits = collect(sup, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].id, 1);
  EXPECT_TRUE(exits[0].signaled);
  EXPECT_EQ(exits[0].signal, SIGKILL);
  EXPECT_EQ(sup.interrupt_signal(), SIGINT);
}

TEST(Supervisor, DestructorKillsAndReapsEverythingAndRestoresSignals) {
  TempDir dir;
  int fds_before = count_open_fds();
  struct sigaction int_before {};
  sigaction(SIGINT, nullptr, &int_before);
  std::vector<pid_t> pids;
  {
    Supervisor sup(options(dir));
    std::vector<WorkerExit> early;
    // Includes a worker that ignores SIGTERM and one with a background grandchild.
    pids.push_back(sup.spawn(sh(0, kMember, dir)));
    pids.push_back(sup.spawn(sh(1, "trap '' TERM; touch \"$DIR/up1\"; sleep 100", dir)));
    pids.push_back(sup.spawn(sh(2, "(sleep 100 &); touch \"$DIR/up2\"; sleep 100", dir)));
    for (int id = 0; id < 3; ++id) {
      ASSERT_TRUE(wait_for_file(sup, dir / ("up" + std::to_string(id)), &early));
    }
    struct sigaction during {};
    sigaction(SIGINT, nullptr, &during);
    EXPECT_NE(during.sa_handler, int_before.sa_handler);
  }
  int status;
  errno = 0;
  EXPECT_EQ(waitpid(-1, &status, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_EQ(count_open_fds(), fds_before);
  struct sigaction after {};
  sigaction(SIGINT, nullptr, &after);
  EXPECT_EQ(after.sa_handler, int_before.sa_handler);
  // The orphaned grandchild got SIGKILL too; its group disappears once init has reaped it.
  for (pid_t pid : pids) {
    bool gone = false;
    for (int i = 0; i < 1000 && !gone; ++i) {
      gone = ::kill(-pid, 0) == -1 && errno == ESRCH;
      if (!gone) std::this_thread::sleep_for(milliseconds(10));
    }
    EXPECT_TRUE(gone) << "process group " << pid << " outlived the supervisor";
  }
}

}  // namespace
}  // namespace tessel::process
