#include "tessel/elastic/heartbeat.h"

#include "tessel/core/error.h"
#include "tessel/core/log.h"

namespace tessel::elastic {

Heartbeat::Heartbeat(std::shared_ptr<comm::ControlStore> store, std::string key,
                     std::chrono::milliseconds ttl, const std::string& value)
    : store_(std::move(store)), key_(std::move(key)), ttl_(ttl) {
  lease_ = store_->grant_lease(ttl_);
  store_->set(key_, value, lease_);
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeat::run() {
  // The store counts the lease's time from the last renewal it received; a renewal sent is no
  // better than one lost, so this side counts from the last one that came back.
  auto renewed = std::chrono::steady_clock::now();
  std::unique_lock lock(mu_);
  while (!lost_) {
    if (cv_.wait_for(lock, ttl_ / 4, [this] { return stop_; })) return;
    lock.unlock();
    try {
      store_->keep_alive(lease_);
      renewed = std::chrono::steady_clock::now();
    } catch (const std::exception& e) {
      if (std::chrono::steady_clock::now() - renewed >= ttl_) {
        lost_ = true;
        spdlog::error("{}: heartbeat lost ({}); this process was taken for stalled and is fenced",
                      key_, e.what());
      } else {
        // The store did not answer this time: the next renewal may, within the lease.
        spdlog::warn("{}: heartbeat not renewed: {}", key_, e.what());
      }
    }
    lock.lock();
  }
}

}  // namespace tessel::elastic
