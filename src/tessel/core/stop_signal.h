// A request to stop, delivered as a signal: SIGTERM is how schedulers and clouds announce a
// preemption (and SIGINT how a user interrupts). A worker must not die of it at once -- it would
// lose the steps since its last checkpoint -- but finish its step and leave or save (the runtime
// decides which, runtime/parallel_trainer.h). StopSignals turns the first such signal into a flag
// the training loop reads at step boundaries; the second one ends the process the default way, so
// a worker that cannot stop in time can still be stopped.
#pragma once

namespace tessel {

// While one lives, SIGTERM and SIGINT of this process set the flag stop_requested() reads
// (async-signal-safe: an atomic store) instead of ending it; a second one restores the default
// action and re-raises. The previous handlers come back at destruction. One at a time per
// process (a second one throws InvalidArgumentError).
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
};

// The first stop signal received while the current (or last) StopSignals lived (0: none), e.g.
// SIGTERM.
int stop_requested();

// Forgets a received signal (for a process that handled it and goes on, and for tests).
void clear_stop_request();

}  // namespace tessel
