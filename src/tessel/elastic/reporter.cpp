#include "tessel/elastic/reporter.h"

#include "tessel/core/log.h"

namespace tessel::elastic {

Reporter::Reporter(std::shared_ptr<comm::ControlStore> store, std::string key)
    : store_(std::move(store)), key_(std::move(key)), thread_([this] { run(); }) {}

Reporter::~Reporter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Reporter::post(std::string value) {
  {
    std::lock_guard lock(mu_);
    next_ = std::move(value);
  }
  cv_.notify_one();
}

void Reporter::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || next_.has_value(); });
    if (!next_) return;  // stopping, nothing left to write
    std::string value = std::move(*next_);
    next_.reset();
    lock.unlock();
    try {
      store_->set(key_, value);
    } catch (const std::exception& e) {
      // The reader (the coordinator) is gone or the store is: the worker finds out on its own.
      spdlog::debug("could not write {}: {}", key_, e.what());
    }
    lock.lock();
  }
}

}  // namespace tessel::elastic
