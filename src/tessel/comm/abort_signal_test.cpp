#include "tessel/comm/abort_signal.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

TEST(AbortSignal, RunsEveryCallbackOnceWithTheFirstReason) {
  auto signal = std::make_shared<AbortSignal>();
  EXPECT_FALSE(signal->aborted());
  EXPECT_EQ(signal->reason(), "");
  std::vector<std::string> seen;
  auto a = signal->on_abort([&](const std::string& r) { seen.push_back("a:" + r); });
  auto b = signal->on_abort([&](const std::string& r) { seen.push_back("b:" + r); });
  signal->abort("peer 3 died");
  signal->abort("a second reason");
  EXPECT_TRUE(signal->aborted());
  EXPECT_EQ(signal->reason(), "peer 3 died");
  EXPECT_EQ(seen, (std::vector<std::string>{"a:peer 3 died", "b:peer 3 died"}));
}

TEST(AbortSignal, ACallbackRegisteredAfterTheAbortRunsAtOnce) {
  auto signal = std::make_shared<AbortSignal>();
  signal->abort("");  // an empty reason still says something
  EXPECT_EQ(signal->reason(), "aborted");
  std::string seen;
  auto late = signal->on_abort([&](const std::string& r) { seen = r; });
  EXPECT_EQ(seen, "aborted");
}

TEST(AbortSignal, ADroppedRegistrationIsNotRun) {
  auto signal = std::make_shared<AbortSignal>();
  int runs = 0;
  {
    auto r = signal->on_abort([&](const std::string&) { ++runs; });
  }
  auto kept = signal->on_abort([&](const std::string&) { runs += 10; });
  AbortSignal::Registration moved = std::move(kept);
  kept.reset();  // moved-from: nothing to unregister
  signal->abort("x");
  EXPECT_EQ(runs, 10);
}

TEST(AbortSignal, AThrowingCallbackDoesNotStopTheOthers) {
  auto signal = std::make_shared<AbortSignal>();
  bool second = false;
  auto a = signal->on_abort([](const std::string&) { throw std::runtime_error("oops"); });
  auto b = signal->on_abort([&](const std::string&) { second = true; });
  signal->abort("x");
  EXPECT_TRUE(second);
}

// The registration keeps the signal alive: a communicator may outlive the caller's copy.
TEST(AbortSignal, ARegistrationKeepsItsSignalAlive) {
  auto signal = std::make_shared<AbortSignal>();
  std::weak_ptr<AbortSignal> weak = signal;
  auto r = signal->on_abort([](const std::string&) {});
  signal.reset();
  EXPECT_FALSE(weak.expired());
  r.reset();
  EXPECT_TRUE(weak.expired());
}

TEST(AbortSignal, NeedsSharedOwnershipToRegister) {
  AbortSignal on_stack;
  EXPECT_THROW((void)on_stack.on_abort([](const std::string&) {}), InvalidArgumentError);
  on_stack.abort("still works as a flag");
  EXPECT_TRUE(on_stack.aborted());
}

// Dropping a registration while abort() runs its callback on another thread waits for the
// callback, so what the callback uses may be destroyed right after.
TEST(AbortSignal, DroppingARegistrationWaitsForItsRunningCallback) {
  auto signal = std::make_shared<AbortSignal>();
  std::atomic<bool> started{false};
  auto in_use = std::make_unique<std::atomic<int>>(0);
  auto r = signal->on_abort([&, target = in_use.get()](const std::string&) {
    started = true;
    std::this_thread::sleep_for(100ms);
    target->store(1);  // use after free if the registration did not wait
  });
  std::thread aborter([&] { signal->abort("x"); });
  while (!started) std::this_thread::yield();
  r.reset();
  EXPECT_EQ(in_use->load(), 1);
  in_use.reset();
  aborter.join();
}

// A callback may drop its own registration (no deadlock), and register another (run at once).
TEST(AbortSignal, ACallbackMayDropItsOwnRegistrationAndRegisterAnother) {
  auto signal = std::make_shared<AbortSignal>();
  AbortSignal::Registration self, inner;
  bool inner_ran = false;
  self = signal->on_abort([&](const std::string&) {
    self.reset();
    inner = signal->on_abort([&](const std::string&) { inner_ran = true; });
  });
  signal->abort("x");
  EXPECT_TRUE(inner_ran);
}

// Threads register, abort and drop a registration at once: a callback whose registration lives
// until the abort is over runs exactly once (by abort(), or at once when registered after it), a
// dropped one at most once, and the first abort's reason wins.
TEST(AbortSignal, ConcurrentAbortsRegistrationsAndDropsRunEachCallbackAtMostOnce) {
  for (int round = 0; round < 200; ++round) {
    auto signal = std::make_shared<AbortSignal>();
    constexpr int kThreads = 4;
    std::vector<std::atomic<int>> runs(kThreads);
    std::vector<AbortSignal::Registration> registrations(kThreads);
    std::vector<std::thread> threads;
    std::atomic<bool> go{false};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        while (!go) std::this_thread::yield();
        registrations[t] = signal->on_abort([&runs, t](const std::string&) { runs[t]++; });
        if (t % 2 == 0) signal->abort("thread " + std::to_string(t));
        if (t == 1) registrations[t].reset();  // may race with the abort: runs 0 or 1 times
      });
    }
    go = true;
    for (auto& th : threads) th.join();
    EXPECT_TRUE(signal->aborted());
    EXPECT_TRUE(signal->reason() == "thread 0" || signal->reason() == "thread 2")
        << signal->reason();
    for (int t = 0; t < kThreads; ++t) {
      if (t == 1) {
        EXPECT_LE(runs[t].load(), 1);
      } else {
        EXPECT_EQ(runs[t].load(), 1) << "thread " << t;
      }
    }
    registrations.clear();
  }
}

}  // namespace
}  // namespace tessel::comm
