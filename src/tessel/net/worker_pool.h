// Threads started as work needs them, up to a bound: an idle server holds a few threads, a busy
// one never more than the bound, and work beyond it waits for a thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tessel::net {

class WorkerPool {
 public:
  explicit WorkerPool(size_t max_threads);
  ~WorkerPool();  // shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs `job` on a pool thread. An exception escaping it is dropped (it would end the process).
  void enqueue(std::function<void()> job);
  // Runs what is queued, then joins every thread; enqueue() afterwards runs nothing. Jobs must
  // end by themselves (every blocking call in them has a timeout). Safe to call twice.
  void shutdown();

 private:
  void run();

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace tessel::net
