// The launcher's death as a worker sees it (worker_env.h): told by `tessel train` with the
// embedded store, reported once by the process boundary's watch, with a snapshot taken before
// anyone can read it as gone.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "tessel/core/error.h"
#include "tessel/runtime/worker_env.h"

namespace tessel::runtime {
namespace {

// Sets a worker's variables for one test and removes them after it.
struct WorkerVariables {
  WorkerVariables() {
    setenv("TESSEL_RANK", "0", 1);
    setenv("TESSEL_WORLD_SIZE", "2", 1);
    setenv("TESSEL_CONTROL_STORE", "http://127.0.0.1:1", 1);
    setenv("TESSEL_ELASTIC", "1", 1);
    setenv("TESSEL_JOB_ID", "job", 1);
  }
  ~WorkerVariables() {
    for (const char* v :
         {"TESSEL_RANK", "TESSEL_WORLD_SIZE", "TESSEL_CONTROL_STORE", "TESSEL_ELASTIC",
          "TESSEL_JOB_ID", "TESSEL_LAUNCHER_PID", "TESSEL_CONSOLE_FD"})
      unsetenv(v);
  }
};

TEST(LauncherLoss, OnlyAWorkerOfTheEmbeddedStoreIsToldItsLaunchersPidAndConsole) {
  WorkerVariables vars;
  auto env = WorkerEnv::from_environment();
  EXPECT_EQ(env.launcher, nullptr);  // etcd, or a launcher of another kind
  EXPECT_EQ(env.console_fd, -1);
  setenv("TESSEL_LAUNCHER_PID", "4321", 1);
  setenv("TESSEL_CONSOLE_FD", "7", 1);
  env = WorkerEnv::from_environment();
  ASSERT_NE(env.launcher, nullptr);
  EXPECT_EQ(env.launcher->pid(), 4321);
  EXPECT_FALSE(env.launcher->noticed());
  EXPECT_EQ(env.console_fd, 7);
  setenv("TESSEL_LAUNCHER_PID", "12ab", 1);
  EXPECT_THROW(WorkerEnv::from_environment(), ConfigError);
}

// The callback runs before the death reads as noticed (a reader that sees it noticed sees the
// snapshot too), exactly once; one registered afterwards runs at once; an empty one removes it.
TEST(LauncherLoss, TheSnapshotIsTakenBeforeTheDeathIsReadAndOnlyOnce) {
  LauncherLoss loss(99);
  int calls = 0;
  bool noticed_during_callback = true;
  loss.on_notice([&] {
    ++calls;
    noticed_during_callback = loss.noticed();
  });
  std::thread watch([&] { loss.notice(); });
  watch.join();
  loss.notice();  // a second report changes nothing
  EXPECT_TRUE(loss.noticed());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(noticed_during_callback);

  int late = 0;
  loss.on_notice([&] { ++late; });
  EXPECT_EQ(late, 1);
  loss.on_notice(nullptr);

  LauncherLoss removed(99);
  int never = 0;
  removed.on_notice([&] { ++never; });
  removed.on_notice(nullptr);
  removed.notice();
  EXPECT_EQ(never, 0);
  EXPECT_TRUE(removed.noticed());
}

}  // namespace
}  // namespace tessel::runtime
