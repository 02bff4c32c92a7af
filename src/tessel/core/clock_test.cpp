#include "tessel/core/clock.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace tessel {
namespace {

// The pipeline's dilation (runtime/pipeline_executor.h) stretches a compute by its CPU time: a
// thread that sleeps (or waits for a core) must not be credited with that time.
TEST(ThreadCpuSeconds, AdvancesWhileComputingAndNotWhileSleeping) {
  const double cpu0 = thread_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double slept = thread_cpu_seconds() - cpu0;
  // Waking and the clock calls cost microseconds, far below the 200 ms slept.
  EXPECT_LT(slept, 0.05);

  const auto t0 = std::chrono::steady_clock::now();
  const double cpu1 = thread_cpu_seconds();
  volatile double x = 0;
  while (seconds_since(t0) < 0.1) x = x + 1;
  const double spun = thread_cpu_seconds() - cpu1;
  // Spinning 100 ms of wall time uses CPU time, unless the thread was preempted nearly all of it.
  EXPECT_GT(spun, 0.005);
  EXPECT_LE(spun, seconds_since(t0) + 0.01);
}

}  // namespace
}  // namespace tessel
