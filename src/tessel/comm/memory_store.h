// MemoryStore: the control store (control_store.h) in one process's memory -- thread-safe, with
// revisions, a bounded history for watch(), and leases that expire on the steady clock. It is
// what the embedded store serves to the processes of a single-host job, and the store the
// protocol's tests run against without processes.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "tessel/comm/control_store.h"

namespace tessel::comm {

class MemoryStore final : public ControlStore {
 public:
  // Keeps the newest `history` changes for watch(); a watcher further behind is told to re-list.
  explicit MemoryStore(size_t history = 100000);

  int64_t set(const std::string& key, const std::string& value, LeaseId lease = 0) override;
  std::optional<KeyValue> get(const std::string& key) override;
  std::optional<int64_t> compare_and_set(const std::string& key, int64_t expected_revision,
                                         const std::string& value, LeaseId lease = 0) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool erase(const std::string& key) override;
  std::vector<KeyValue> list(const std::string& prefix) override;
  int64_t revision() override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  WatchResult watch(const std::string& prefix, int64_t after,
                    std::chrono::milliseconds timeout) override;
  LeaseId grant_lease(std::chrono::milliseconds ttl) override;
  void keep_alive(LeaseId lease) override;
  void revoke(LeaseId lease) override;

  // For the embedded store's server (store_server.h), which answers what etcd would: the time to
  // live `lease` was granted with, or nothing when it has expired or was revoked;
  std::optional<std::chrono::milliseconds> lease_ttl(LeaseId lease);
  // and the newest revision whose change is no longer kept (watch() serves the changes after it).
  int64_t compacted_revision();

 private:
  using Clock = std::chrono::steady_clock;
  struct Lease {
    std::chrono::milliseconds ttl;
    Clock::time_point deadline;
    std::set<std::string> keys;
  };

  // All with mu_ held.
  void expire_leases();
  void end_lease(LeaseId id);  // erases the lease and then its keys
  int64_t put_locked(const std::string& key, const std::string& value, LeaseId lease);
  bool erase_locked(const std::string& key);
  void record(WatchEvent event);
  // Waits on cv_ until `until` or the next lease deadline, whichever is first.
  void wait_locked(std::unique_lock<std::mutex>& lock, Clock::time_point until);

  const size_t history_limit_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t revision_ = 0;
  int64_t compacted_ = 0;  // history holds every change after this revision
  std::map<std::string, KeyValue> keys_;
  std::deque<WatchEvent> history_;
  std::map<LeaseId, Lease> leases_;
  LeaseId next_lease_ = 1;
};

}  // namespace tessel::comm
