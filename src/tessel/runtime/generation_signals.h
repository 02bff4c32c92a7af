// The abort signals of a worker's generations (comm/abort_signal.h). Every rendezvous and
// communicator of store generation g is made with of(g) (WorkerEnv::store). When the coordinator
// announces a failure this process has not met yet (RecordFeed::on_failure, on the feed's
// thread), announce() fires every signal: a process blocked in a collective or a rendezvous with
// a peer on a lost host -- a machine that is gone sends no reset -- fails within milliseconds
// instead of at its communication timeout, and reports like any process that met the failure.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "tessel/comm/abort_signal.h"

namespace tessel::runtime {

class GenerationSignals {
 public:
  // The signal of store generation `generation`; already fired when a failure this process has
  // not acknowledged was announced (its world is being abandoned before it forms).
  std::shared_ptr<comm::AbortSignal> of(int64_t generation);
  // The coordinator recovers from failure `failure`: fires every signal unless this process
  // acknowledged it already. Thread-safe, does not block on the training thread.
  void announce(int64_t failure);
  // The training thread knows of `failures` failures (it reported them, or applied their
  // recovery): announcements up to that number fire nothing.
  void acknowledge(int64_t failures);

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<comm::AbortSignal>> signals_;
  int64_t announced_ = 0, known_ = 0;
};

}  // namespace tessel::runtime
