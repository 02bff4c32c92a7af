// A process's heartbeat in its job's control store: a key on a lease that a thread of its own
// renews several times within the lease's time to live. A process that stops running -- SIGSTOP,
// a frozen VM, a host cut off -- stops renewing, the store erases the key when the lease expires,
// and the coordinator fences the process (decider.h) instead of waiting for a report that will
// never come. A busy training thread does not matter: the renewing thread is separate.
//
// On exit the lease is left to expire, not revoked: the launcher reports the exit to the
// coordinator first, so the key's disappearance is never taken for a stall.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tessel/comm/control_store.h"

namespace tessel::elastic {

class Heartbeat {
 public:
  // Grants the lease and sets `key` to `value` on it (throws as the store does), then renews it
  // every ttl / 4 on a background thread. The store's calls should be bounded well within the
  // ttl (a renewal that hangs cannot be retried in time).
  Heartbeat(std::shared_ptr<comm::ControlStore> store, std::string key,
            std::chrono::milliseconds ttl, const std::string& value = "alive");
  ~Heartbeat();  // stops renewing
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // No renewal reached the store for a whole ttl (or the store said the lease had expired):
  // this process was taken for stalled, or its host for gone, and has been fenced. It must not
  // send state or write a checkpoint again. A renewal that fails once, within the ttl, is not a
  // loss: the next one may get through.
  bool lost() const { return lost_; }
  // The lease, for other keys that live exactly as long as this one.
  comm::LeaseId lease() const { return lease_; }

 private:
  void run();

  std::shared_ptr<comm::ControlStore> store_;
  const std::string key_;
  const std::chrono::milliseconds ttl_;
  comm::LeaseId lease_ = 0;
  std::atomic<bool> lost_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tessel::elastic
