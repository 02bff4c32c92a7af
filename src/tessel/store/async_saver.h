// Asynchronous checkpoint saves: snapshot now, write while training continues.
//
// save() copies every piece of the writer into host memory on the caller's thread (so the
// caller may update its parameters as soon as save() returns), then a background thread writes
// the rank file and runs the optional `then` step (e.g. on one rank: wait for every rank's file,
// then commit()). A write that fails leaves the rank's failure marker (mark_failed) so that the
// committing rank need not wait for a file that will never come; `then` still runs, with the
// write's error, and decides what to throw (on the committing rank: wait for the others, then
// clean up the staging directory). Without `then` the write's error is the save's.
// One save runs at a time: save() first waits for the previous one. Errors of the background
// write are rethrown by the next wait() or save(); the destructor waits and logs an error nobody
// collected (destructors must not throw).
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "tessel/store/checkpoint_store.h"

namespace tessel::store {

class AsyncSaver {
 public:
  AsyncSaver() = default;
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // `write_error` is null when the rank file was written.
  using Then = std::function<void(CheckpointWriter&, std::exception_ptr write_error)>;
  // Waits for the previous save (rethrowing its error), snapshots `writer`, and starts writing.
  void save(CheckpointWriter writer, Then then = {});
  // Blocks until the running save (if any) ends; rethrows its error once.
  void wait();
  // True while a background write runs (it may have just finished).
  bool busy() const;

 private:
  std::thread thread_;
  mutable std::mutex mutex_;
  bool running_ = false;
  std::exception_ptr error_;
};

}  // namespace tessel::store
