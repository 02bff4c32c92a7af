#include "tessel/core/stop_signal.h"

#include <signal.h>

#include <atomic>

#include "tessel/core/check.h"

namespace tessel {
namespace {

std::atomic<int> received{0};
std::atomic<bool> installed{false};
struct sigaction previous_term {
}, previous_int{};

void on_stop_signal(int sig) {
  int none = 0;
  if (received.compare_exchange_strong(none, sig)) return;
  // The second request: the process could not stop in time; end it as the signal would have.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

}  // namespace

StopSignals::StopSignals() {
  bool expected = false;
  TESSEL_CHECK(installed.compare_exchange_strong(expected, true), InvalidArgumentError,
               "StopSignals: one is installed already in this process");
  received = 0;  // a request belongs to the installation that received it
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a blocking read or write goes on; the loop looks at the flag
  sigaction(SIGTERM, &sa, &previous_term);
  sigaction(SIGINT, &sa, &previous_int);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &previous_term, nullptr);
  sigaction(SIGINT, &previous_int, nullptr);
  installed = false;
}

int stop_requested() {
  return received.load();
}

void clear_stop_request() {
  received = 0;
}

}  // namespace tessel
