#include "tessel/comm/bucketed_all_reduce.h"

#include "tessel/core/check.h"

namespace tessel::comm {

BucketedAllReduce::BucketedAllReduce(comm::Communicator& comm, int64_t bucket_elems)
    : comm_(comm), bucket_elems_(bucket_elems) {
  TESSEL_CHECK(bucket_elems >= 1, InvalidArgumentError, "bucket size {} must be >= 1 element",
               bucket_elems);
  worker_ = std::thread([this] { run(); });
}

BucketedAllReduce::~BucketedAllReduce() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

int BucketedAllReduce::add_buffer(float* data, int64_t n) {
  TESSEL_CHECK(n >= 0, InvalidArgumentError, "buffer of {} elements", n);
  buffers_.push_back({data, n, n});
  return int(buffers_.size()) - 1;
}

// Bucket boundaries are n - k * bucket_elems (k = 1, 2, ...) and 0: fixed per buffer, so every
// rank cuts the same buckets whatever offsets its backward reports.
void BucketedAllReduce::enqueue(Buffer& b, int64_t from) {
  std::unique_lock lock(mu_);
  while (b.pending_from > 0) {
    const int64_t lo = std::max<int64_t>(0, b.pending_from - bucket_elems_);
    if (lo < from) break;
    jobs_.push_back({b.data + lo, b.pending_from - lo});
    ++in_flight_;
    b.pending_from = lo;
  }
  lock.unlock();
  cv_.notify_all();
}

void BucketedAllReduce::ready_from(int id, int64_t from) {
  TESSEL_CHECK(id >= 0 && id < int(buffers_.size()), InvalidArgumentError, "no buffer {}", id);
  enqueue(buffers_[size_t(id)], std::max<int64_t>(from, 0));
}

void BucketedAllReduce::finish() {
  for (auto& b : buffers_) enqueue(b, 0);
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return in_flight_ == 0; });
  for (auto& b : buffers_) b.pending_from = b.n;
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void BucketedAllReduce::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_ and nothing left
    Job job = jobs_.front();
    jobs_.pop_front();
    const bool failed = error_ != nullptr;
    lock.unlock();
    // After a failure the communicator is broken: skip the rest (finish() rethrows).
    if (!failed) {
      try {
        comm_.all_reduce_sum(job.data, size_t(job.n));
      } catch (...) {
        lock.lock();
        if (!error_) error_ = std::current_exception();
        lock.unlock();
      }
    }
    lock.lock();
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace tessel::comm
