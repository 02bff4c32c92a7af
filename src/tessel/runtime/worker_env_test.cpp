#include "tessel/runtime/worker_env.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "tessel/core/error.h"

namespace tessel::runtime {
namespace {

// Sets the launcher's variables for one test and removes them after it.
struct LauncherEnv {
  LauncherEnv() {
    setenv("TESSEL_RANK", "1", 1);
    setenv("TESSEL_WORLD_SIZE", "2", 1);
    setenv("TESSEL_STORE_DIR", "/tmp/store", 1);
    setenv("TESSEL_JOB_ID", "job", 1);
  }
  ~LauncherEnv() {
    for (const char* v : {"TESSEL_RANK", "TESSEL_WORLD_SIZE", "TESSEL_STORE_DIR", "TESSEL_JOB_ID",
                          "TESSEL_RESUME_FROM", "TESSEL_GENERATION"})
      unsetenv(v);
  }
};

TEST(WorkerEnv, ReadsTheLaunchersVariables) {
  LauncherEnv launcher;
  setenv("TESSEL_GENERATION", "3", 1);
  const auto env = WorkerEnv::from_environment();
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.store_dir, "/tmp/store");
  EXPECT_EQ(env.job_id, "job");
  EXPECT_EQ(env.generation, 3);
  const auto store = env.store(env.generation + 2, 1.5);
  EXPECT_EQ(store.generation, 5);
  EXPECT_EQ(store.timeout.count(), 1500);
}

// Unset: no launcher chose, the worker looks for the checkpoint itself; empty: a fresh start the
// launcher chose; a path: that checkpoint.
TEST(WorkerEnv, ResumeFromIsUnsetEmptyOrAPath) {
  LauncherEnv launcher;
  EXPECT_FALSE(WorkerEnv::from_environment().resume_from.has_value());
  setenv("TESSEL_RESUME_FROM", "", 1);
  EXPECT_EQ(WorkerEnv::from_environment().resume_from, std::string());
  setenv("TESSEL_RESUME_FROM", "/ck/step-00000004", 1);
  EXPECT_EQ(WorkerEnv::from_environment().resume_from, "/ck/step-00000004");
}

TEST(WorkerEnv, ARankBeyondTheWorldIsAConfigError) {
  LauncherEnv launcher;
  setenv("TESSEL_RANK", "2", 1);
  EXPECT_THROW(WorkerEnv::from_environment(), ConfigError);
}

}  // namespace
}  // namespace tessel::runtime
