// The optimizer state of a live switch still on its way between hosts while the new world trains.
//
// A switch that moves state between hosts is bound by the network (1.5 GB for a GPT-2 124M
// replica: 0.3-0.6 s between two hosts of this machine, against 0.1 s read straight from memory on
// one host). Two thirds of it are Adam moments, which nothing reads before the step's optimizer
// update. So the switch moves the parameters (and does every copy within a process) in the pause,
// and the rest of the transfer plan -- the Adam moments' messages (TransferPlan::part) -- runs on a
// background thread over the transition world while the new world's first forward and backward
// compute. The new world waits for it before its first update, and before anything else reads or
// replaces its state (RankTrainer::finish_arrival).
//
// The old world rides along: its buffers are what this process sends (or what a peer on this host
// reads directly), so it lives until the transfer is over. A failure meanwhile (a peer lost, the
// world aborted) fails the transfer with the communicator's error; a process that was to receive
// then holds incomplete state and says so in its failure report (RankTrainer::updating()), while
// one that only sent still holds all of its own.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/reshard/executor.h"
#include "tessel/reshard/transfer_plan.h"

namespace tessel::runtime {

class RankTrainer;

class ArrivingState {
 public:
  // Starts executing `part` as `process` over `world` and its `lanes` (reshard/executor.h) on a
  // background thread. `buffers` are this process's spans into `source` (the old world) and the
  // new world; both must outlive this object (the new world owns it).
  ArrivingState(reshard::TransferPlan part, int process, std::unique_ptr<comm::Communicator> world,
                std::vector<std::unique_ptr<comm::Communicator>> lanes,
                reshard::ProcessBuffers buffers, reshard::ExecuteOptions how,
                std::unique_ptr<RankTrainer> source);
  // Aborts the transfer if it still runs, and waits for the thread.
  ~ArrivingState();
  ArrivingState(const ArrivingState&) = delete;
  ArrivingState& operator=(const ArrivingState&) = delete;

  // Waits until the transfer is over; rethrows its error. Then frees the old world.
  void wait();
  // Breaks the transfer's communicators (peers fail at once); wait() then throws.
  void abort(const std::string& why) noexcept;
  // Whether this process receives anything in it (its new state is incomplete until it is over).
  bool receives() const { return receives_; }
  // How long the transfer took, once wait() returned.
  double seconds() const { return seconds_; }
  // Bytes this process received in it.
  int64_t bytes_received() const { return stats_.bytes_received + stats_.bytes_read_directly; }

 private:
  reshard::TransferPlan part_;
  std::unique_ptr<comm::Communicator> world_;
  std::vector<std::unique_ptr<comm::Communicator>> lanes_;
  reshard::ProcessBuffers buffers_;
  reshard::ExecuteOptions how_;
  std::unique_ptr<RankTrainer> source_;
  bool receives_ = false;
  double seconds_ = 0;
  reshard::ExecuteStats stats_;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace tessel::runtime
