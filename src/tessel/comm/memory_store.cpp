#include "tessel/comm/memory_store.h"

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::comm {

MemoryStore::MemoryStore(size_t history) : history_limit_(std::max<size_t>(history, 1)) {}

void MemoryStore::expire_leases() {
  const auto now = Clock::now();
  std::vector<LeaseId> expired;
  for (const auto& [id, lease] : leases_)
    if (lease.deadline <= now) expired.push_back(id);
  for (LeaseId id : expired) end_lease(id);
}

void MemoryStore::end_lease(LeaseId id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return;
  const auto keys = std::move(it->second.keys);
  leases_.erase(it);
  for (const auto& key : keys) erase_locked(key);
}

void MemoryStore::record(WatchEvent event) {
  history_.push_back(std::move(event));
  while (history_.size() > history_limit_) {
    compacted_ = history_.front().kv.revision;
    history_.pop_front();
  }
  cv_.notify_all();
}

int64_t MemoryStore::put_locked(const std::string& key, const std::string& value, LeaseId lease) {
  TESSEL_CHECK(!key.empty(), InvalidArgumentError, "control store: a key may not be empty");
  if (lease != 0) {
    auto it = leases_.find(lease);
    TESSEL_CHECK(it != leases_.end(), PeerLostError,
                 "control store: lease {} has expired or was revoked; key '{}' not set", lease,
                 key);
    it->second.keys.insert(key);
  }
  auto& kv = keys_[key];
  // A key moved to another lease (or none) no longer dies with the old one.
  if (kv.lease != 0 && kv.lease != lease) {
    if (auto old = leases_.find(kv.lease); old != leases_.end()) old->second.keys.erase(key);
  }
  kv = {key, value, ++revision_, lease};
  record({WatchEvent::Kind::put, kv});
  return revision_;
}

bool MemoryStore::erase_locked(const std::string& key) {
  auto it = keys_.find(key);
  if (it == keys_.end()) return false;
  if (it->second.lease != 0) {
    if (auto l = leases_.find(it->second.lease); l != leases_.end()) l->second.keys.erase(key);
  }
  keys_.erase(it);
  record({WatchEvent::Kind::erase, {key, "", ++revision_, 0}});
  return true;
}

void MemoryStore::wait_locked(std::unique_lock<std::mutex>& lock, Clock::time_point until) {
  for (const auto& [id, lease] : leases_) until = std::min(until, lease.deadline);
  cv_.wait_until(lock, until);
  expire_leases();
}

int64_t MemoryStore::set(const std::string& key, const std::string& value, LeaseId lease) {
  std::lock_guard lock(mu_);
  expire_leases();
  return put_locked(key, value, lease);
}

std::optional<KeyValue> MemoryStore::get(const std::string& key) {
  std::lock_guard lock(mu_);
  expire_leases();
  auto it = keys_.find(key);
  if (it == keys_.end()) return std::nullopt;
  return it->second;
}

std::optional<int64_t> MemoryStore::compare_and_set(const std::string& key,
                                                    int64_t expected_revision,
                                                    const std::string& value, LeaseId lease) {
  std::lock_guard lock(mu_);
  expire_leases();
  auto it = keys_.find(key);
  const int64_t current = it == keys_.end() ? 0 : it->second.revision;
  if (current != expected_revision) return std::nullopt;
  return put_locked(key, value, lease);
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  std::lock_guard lock(mu_);
  expire_leases();
  int64_t value = 0;
  LeaseId lease = 0;
  if (auto it = keys_.find(key); it != keys_.end()) {
    value = parse_counter(key, it->second.value);
    lease = it->second.lease;
  }
  value += delta;
  put_locked(key, std::to_string(value), lease);
  return value;
}

bool MemoryStore::erase(const std::string& key) {
  std::lock_guard lock(mu_);
  expire_leases();
  return erase_locked(key);
}

std::vector<KeyValue> MemoryStore::list(const std::string& prefix) {
  std::lock_guard lock(mu_);
  expire_leases();
  std::vector<KeyValue> out;
  for (auto it = keys_.lower_bound(prefix); it != keys_.end() && it->first.starts_with(prefix);
       ++it)
    out.push_back(it->second);
  return out;
}

int64_t MemoryStore::revision() {
  std::lock_guard lock(mu_);
  expire_leases();
  return revision_;
}

void MemoryStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::unique_lock lock(mu_);
  expire_leases();
  for (;;) {
    std::string missing;
    for (const auto& k : keys)
      if (!keys_.count(k)) missing += (missing.empty() ? "'" : ", '") + k + "'";
    if (missing.empty()) return;
    TESSEL_CHECK(Clock::now() < deadline, TimeoutError,
                 "control store: waited {} ms for {}, which never appeared", timeout.count(),
                 missing);
    wait_locked(lock, deadline);
  }
}

WatchResult MemoryStore::watch(const std::string& prefix, int64_t after,
                               std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::unique_lock lock(mu_);
  expire_leases();
  for (;;) {
    TESSEL_CHECK(after >= compacted_, CorruptDataError,
                 "control store: the changes after revision {} are no longer kept (history "
                 "starts after {}); read the current keys with list() and watch from there",
                 after, compacted_);
    WatchResult r;
    r.revision = after;
    for (const auto& e : history_) {
      if (e.kv.revision <= after || !e.kv.key.starts_with(prefix)) continue;
      r.events.push_back(e);
      r.revision = e.kv.revision;
    }
    if (!r.events.empty()) return r;
    if (Clock::now() >= deadline) {
      r.revision = std::max(after, revision_);
      return r;
    }
    wait_locked(lock, deadline);
  }
}

LeaseId MemoryStore::grant_lease(std::chrono::milliseconds ttl) {
  TESSEL_CHECK(ttl.count() > 0, InvalidArgumentError,
               "control store: a lease needs a positive time to live, got {} ms", ttl.count());
  std::lock_guard lock(mu_);
  expire_leases();
  const LeaseId id = next_lease_++;
  leases_[id] = {ttl, Clock::now() + ttl, {}};
  return id;
}

void MemoryStore::keep_alive(LeaseId lease) {
  std::lock_guard lock(mu_);
  expire_leases();
  auto it = leases_.find(lease);
  TESSEL_CHECK(it != leases_.end(), PeerLostError,
               "control store: lease {} has expired (not renewed within its time to live) or "
               "was revoked; its keys are gone",
               lease);
  it->second.deadline = Clock::now() + it->second.ttl;
}

void MemoryStore::revoke(LeaseId lease) {
  std::lock_guard lock(mu_);
  end_lease(lease);
}

std::optional<std::chrono::milliseconds> MemoryStore::lease_ttl(LeaseId lease) {
  std::lock_guard lock(mu_);
  expire_leases();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return std::nullopt;
  return it->second.ttl;
}

int64_t MemoryStore::compacted_revision() {
  std::lock_guard lock(mu_);
  return compacted_;
}

}  // namespace tessel::comm
