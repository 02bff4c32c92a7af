#include "tessel/core/stop_signal.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tessel/core/error.h"

namespace tessel {
namespace {

TEST(StopSignals, TheFirstSignalIsAFlagTheSecondEndsTheProcess) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only async-signal-safe exits from here: the parent checks the status.
    StopSignals stop;
    raise(SIGTERM);
    if (stop_requested() != SIGTERM) _exit(3);
    raise(SIGINT);  // the second request ends the process by its signal
    _exit(4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit code " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGINT);
}

TEST(StopSignals, HandlersAreRestoredAndOnlyOneInstallationAtATime) {
  struct sigaction before {};
  sigaction(SIGTERM, nullptr, &before);
  {
    StopSignals stop;
    EXPECT_THROW(StopSignals(), InvalidArgumentError);
    struct sigaction during {};
    sigaction(SIGTERM, nullptr, &during);
    EXPECT_NE(during.sa_handler, before.sa_handler);
    raise(SIGTERM);
    EXPECT_EQ(stop_requested(), SIGTERM);
    clear_stop_request();
    EXPECT_EQ(stop_requested(), 0);
  }
  struct sigaction after {};
  sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  StopSignals again;  // installable again
}

}  // namespace
}  // namespace tessel
