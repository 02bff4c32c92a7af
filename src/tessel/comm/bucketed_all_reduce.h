// Data-parallel gradient all-reduce in buckets, overlapped with backward.
//
// Each registered gradient buffer is cut into buckets from its END (the parameter buffer is in
// forward order and backward produces gradients in reverse, so the tail is complete first).
// During the last backward of a step the model reports, through Transformer::GradsReady, the
// offset from which its gradients are complete; every bucket entirely inside that tail is handed
// to a background thread, which sums it over the data-parallel group on its own communicator
// while the backward goes on. finish() hands over what is left and waits for all of it.
//
// Every dp rank must register the same buffers and report the same offsets in the same order
// (they run the same program), so the buckets are reduced in the same order everywhere -- the
// communicator's collectives must match across ranks.
//
// Errors of the background all-reduce (PeerLostError, TimeoutError) are rethrown by finish().
// Not thread-safe: one caller thread (plus the internal worker).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"

namespace tessel::comm {

class BucketedAllReduce {
 public:
  // `comm` (used only by the worker thread from now on) must outlive this object.
  // bucket_elems >= 1.
  BucketedAllReduce(comm::Communicator& comm, int64_t bucket_elems);
  ~BucketedAllReduce();
  BucketedAllReduce(const BucketedAllReduce&) = delete;
  BucketedAllReduce& operator=(const BucketedAllReduce&) = delete;

  // Registers a float buffer of n elements; returns its id. Buffers are reduced in place.
  int add_buffer(float* data, int64_t n);
  // The elements [from, n) of buffer `id` are final for this step: hand over every bucket of
  // the buffer that lies entirely in that range and was not handed over yet.
  void ready_from(int id, int64_t from);
  // Hands over the rest of every buffer (in id order), waits until all buckets are reduced and
  // resets for the next step. Rethrows the first error of the worker.
  void finish();

  int64_t bucket_elems() const { return bucket_elems_; }

 private:
  struct Buffer {
    float* data = nullptr;
    int64_t n = 0;
    int64_t pending_from = 0;  // [pending_from, n) has been handed over
  };
  struct Job {
    float* data;
    int64_t n;
  };
  void enqueue(Buffer& b, int64_t from);
  void run();

  comm::Communicator& comm_;
  int64_t bucket_elems_;
  std::vector<Buffer> buffers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  int64_t in_flight_ = 0;  // jobs queued or running
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace tessel::comm
