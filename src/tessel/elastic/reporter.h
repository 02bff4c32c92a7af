// Writes a worker's newest report to one control-store key from a background thread, so the
// training thread never waits for the store (an etcd write is an fsync away). Reports coalesce:
// only the newest value posted is written, which is all the store's readers look at.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tessel/comm/control_store.h"

namespace tessel::elastic {

class Reporter {
 public:
  Reporter(std::shared_ptr<comm::ControlStore> store, std::string key);
  // Writes what is still posted (bounded by the store's own timeout), then stops.
  ~Reporter();
  Reporter(const Reporter&) = delete;
  Reporter& operator=(const Reporter&) = delete;

  void post(std::string value);

 private:
  void run();

  std::shared_ptr<comm::ControlStore> store_;
  const std::string key_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<std::string> next_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tessel::elastic
