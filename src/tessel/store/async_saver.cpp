#include "tessel/store/async_saver.h"

#include <utility>

#include "tessel/core/error.h"
#include "tessel/core/log.h"

namespace tessel::store {

AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("asynchronous checkpoint save failed: {}", e.what());
  }
}

void AsyncSaver::save(CheckpointWriter writer, Then then) {
  wait();
  writer.snapshot();
  {
    std::lock_guard lock(mutex_);
    running_ = true;
  }
  thread_ = std::thread([this, w = std::move(writer), then = std::move(then)]() mutable {
    std::exception_ptr error;
    try {
      w.write_rank_file();
    } catch (...) {
      error = std::current_exception();
      w.mark_failed();
    }
    if (then) {
      try {
        then(w, std::exchange(error, nullptr));
      } catch (...) {
        error = std::current_exception();
      }
    }
    std::lock_guard lock(mutex_);
    error_ = error;
    running_ = false;
  });
}

void AsyncSaver::wait() {
  if (thread_.joinable()) thread_.join();
  std::exception_ptr error;
  {
    std::lock_guard lock(mutex_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

bool AsyncSaver::busy() const {
  std::lock_guard lock(mutex_);
  return running_;
}

}  // namespace tessel::store
