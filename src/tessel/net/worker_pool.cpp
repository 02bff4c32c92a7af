#include "tessel/net/worker_pool.h"

#include <system_error>

namespace tessel::net {

WorkerPool::WorkerPool(size_t max_threads) : max_threads_(max_threads > 0 ? max_threads : 1) {}

WorkerPool::~WorkerPool() {
  shutdown();
}

void WorkerPool::enqueue(std::function<void()> job) {
  std::lock_guard lock(mu_);
  if (stopping_) return;
  jobs_.push_back(std::move(job));
  if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
    try {
      threads_.emplace_back([this] { run(); });
    } catch (const std::system_error&) {
      // No thread to be had (a resource limit): the job waits for a running one.
    }
  }
  cv_.notify_one();
}

void WorkerPool::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) t.join();
}

void WorkerPool::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    try {
      job();
    } catch (...) {
      // Out of memory in httplib's connection code, most likely: this job is lost, the server
      // goes on.
    }
    job = nullptr;  // its captures (a connection) are released outside the lock
    lock.lock();
  }
}

}  // namespace tessel::net
