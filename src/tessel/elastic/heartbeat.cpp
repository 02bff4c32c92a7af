#include "tessel/elastic/heartbeat.h"

#include "tessel/core/error.h"
#include "tessel/core/log.h"

namespace tessel::elastic {

Heartbeat::Heartbeat(std::shared_ptr<comm::ControlStore> store, std::string key,
                     std::chrono::milliseconds ttl)
    : store_(std::move(store)), key_(std::move(key)), ttl_(ttl) {
  lease_ = store_->grant_lease(ttl_);
  store_->set(key_, "alive", lease_);
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
  std::unique_lock lock(mu_);
  while (!lost_) {
    if (cv_.wait_for(lock, ttl_ / 4, [this] { return stop_; })) return;
    lock.unlock();
    try {
      store_->keep_alive(lease_);
    } catch (const PeerLostError& e) {
      lost_ = true;
      spdlog::error("{}: heartbeat lost ({}); this process was taken for stalled and is fenced",
                    key_, e.what());
    } catch (const std::exception& e) {
      // The store did not answer this time: the next renewal may, well within the lease.
      spdlog::warn("{}: heartbeat not renewed: {}", key_, e.what());
    }
    lock.lock();
  }
}

}  // namespace tessel::elastic
