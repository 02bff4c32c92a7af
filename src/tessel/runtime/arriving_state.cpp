#include "tessel/runtime/arriving_state.h"

#include "tessel/runtime/rank_trainer.h"

namespace tessel::runtime {

ArrivingState::ArrivingState(reshard::TransferPlan part, int process,
                             std::unique_ptr<comm::Communicator> world,
                             std::vector<std::unique_ptr<comm::Communicator>> lanes,
                             reshard::ProcessBuffers buffers, reshard::ExecuteOptions how,
                             std::unique_ptr<RankTrainer> source)
    : part_(std::move(part)),
      world_(std::move(world)),
      lanes_(std::move(lanes)),
      buffers_(std::move(buffers)),
      how_(std::move(how)),
      source_(std::move(source)) {
  for (const auto& m : part_.messages()) receives_ |= m.dst_process == process;
  how_.lanes.clear();
  for (const auto& lane : lanes_) how_.lanes.push_back(lane.get());
  thread_ = std::thread([this, process] {
    const auto start = std::chrono::steady_clock::now();
    try {
      stats_ = reshard::execute(part_, process, *world_, buffers_, how_);
    } catch (...) {
      error_ = std::current_exception();
    }
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
}

ArrivingState::~ArrivingState() {
  if (thread_.joinable()) {
    abort("the world that was receiving it is gone");
    thread_.join();
  }
}

void ArrivingState::wait() {
  if (thread_.joinable()) thread_.join();
  // The old world's buffers were the sources: nothing reads them any more.
  source_.reset();
  if (error_) std::rethrow_exception(error_);
}

void ArrivingState::abort(const std::string& why) noexcept {
  world_->abort(why);
  for (auto& lane : lanes_) lane->abort(why);
}

}  // namespace tessel::runtime
