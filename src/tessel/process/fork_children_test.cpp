#include "tessel/process/fork_children.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>

namespace tessel::process {
namespace {

using namespace std::chrono_literals;

TEST(RunForked, EachChildExitsWithWhatItsFunctionReturned) {
  ForkOptions o;
  o.deadline = 30s;
  const auto out = run_forked(
      3, [](int i) { return i * 10; }, o);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[0].ok());
  EXPECT_EQ(out[1].exit_code, 10);
  EXPECT_EQ(out[2].exit_code, 20);
  EXPECT_EQ(out[2].describe(), "exit 20");
}

TEST(RunForked, AThrowingChildExitsWithkChildThrewAndAKilledOneNamesItsSignal) {
  ForkOptions o;
  o.deadline = 30s;
  const auto out = run_forked(
      2,
      [](int i) -> int {
        if (i == 0) throw std::runtime_error("boom");
        raise(SIGTERM);  // not SIGSEGV: a sanitizer catches that and exits
        return 0;
      },
      o);
  EXPECT_EQ(out[0].exit_code, kChildThrew);
  EXPECT_EQ(out[1].signal, SIGTERM);
  EXPECT_EQ(out[1].describe(), "killed by signal " + std::to_string(SIGTERM));
}

TEST(RunForked, AHungChildIsKilledAtTheDeadlineAfterBeforeKill) {
  ForkOptions o;
  o.deadline = 300ms;
  pid_t seen = 0;
  o.before_kill = [&](pid_t pid) { seen = pid; };
  const auto out = run_forked(
      2,
      [](int i) {
        if (i == 1) pause();
        return 0;
      },
      o);
  EXPECT_TRUE(out[0].ok());
  EXPECT_TRUE(out[1].killed_at_deadline);
  EXPECT_FALSE(out[1].ok());
  EXPECT_NE(seen, 0);
}

// With stop_on_failure, one failing child ends the others at once instead of at the deadline.
TEST(RunForked, StopOnFailureKillsTheOthers) {
  ForkOptions o;
  o.deadline = std::chrono::hours(1);
  o.stop_on_failure = true;
  const auto out = run_forked(
      3,
      [](int i) {
        if (i == 2) return 7;
        pause();
        return 0;
      },
      o);
  EXPECT_EQ(out[2].exit_code, 7);
  EXPECT_TRUE(out[0].killed_after_failure);
  EXPECT_TRUE(out[1].killed_after_failure);
  EXPECT_FALSE(out[0].killed_at_deadline);
}

}  // namespace
}  // namespace tessel::process
