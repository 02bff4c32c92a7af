#include "tessel/comm/abort_signal.h"

#include <utility>

#include "tessel/core/check.h"

namespace tessel::comm {

AbortSignal::Registration::Registration(std::shared_ptr<AbortSignal> signal, uint64_t id)
    : signal_(std::move(signal)), id_(id) {}

AbortSignal::Registration::Registration(Registration&& other) noexcept
    : signal_(std::move(other.signal_)), id_(std::exchange(other.id_, 0)) {}

AbortSignal::Registration& AbortSignal::Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    reset();
    signal_ = std::move(other.signal_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

AbortSignal::Registration::~Registration() {
  reset();
}

void AbortSignal::Registration::reset() noexcept {
  if (signal_) signal_->unregister(id_);
  signal_.reset();
  id_ = 0;
}

void AbortSignal::abort(const std::string& reason) noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_.load(std::memory_order_relaxed)) return;
  try {
    reason_ = reason.empty() ? "aborted" : reason;
  } catch (...) {
    reason_ = "aborted";  // fits the small-string buffer: cannot fail
  }
  // reason_ never changes again, so callbacks read it below without the lock.
  aborted_.store(true, std::memory_order_release);
  running_thread_ = std::this_thread::get_id();
  while (!callbacks_.empty()) {
    auto node = callbacks_.extract(callbacks_.begin());
    running_id_ = node.key();
    lock.unlock();
    try {
      node.mapped()(reason_);
    } catch (...) {
      // A callback that throws must not keep the others from running.
    }
    // The callback (and what it captured) is gone before its Registration may return.
    node = {};
    lock.lock();
    running_id_ = 0;
    callback_returned_.notify_all();
  }
}

std::string AbortSignal::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

AbortSignal::Registration AbortSignal::on_abort(Callback callback) {
  auto self = weak_from_this().lock();
  TESSEL_CHECK(self != nullptr, InvalidArgumentError,
               "AbortSignal::on_abort: the signal must be owned by a std::shared_ptr");
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_.load(std::memory_order_relaxed)) {
    lock.unlock();
    try {
      callback(reason_);
    } catch (...) {
      // As in abort(): a callback's exception is swallowed.
    }
    return {};
  }
  const uint64_t id = next_id_++;
  callbacks_.emplace(id, std::move(callback));
  return Registration(std::move(self), id);
}

void AbortSignal::unregister(uint64_t id) noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  auto node = callbacks_.extract(id);
  if (!node.empty()) {
    lock.unlock();  // destroy the callback outside the lock
    return;
  }
  // Running on another thread: wait until it has returned. Running on this thread means the
  // callback drops its own Registration: waiting would deadlock, and it returns right after.
  if (running_id_ == id && running_thread_ != std::this_thread::get_id()) {
    callback_returned_.wait(lock, [&] { return running_id_ != id; });
  }
}

}  // namespace tessel::comm
