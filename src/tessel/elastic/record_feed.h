// A worker's view of its job's decisions (reconfiguration.h): a background thread watches the
// job's keys in the control store -- one long watch, no polling -- and keeps the newest records,
// the failure the coordinator is recovering from and rank 0's progress. The training thread reads
// them without a round trip at every step boundary, and waits on them with a bound.
//
// What cannot be trusted is dropped, not applied: a record that does not parse (edited by hand)
// is named in a warning and ignored; a record key that disappears is forgotten only by the
// store, not by the feed (what was seen stays seen).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

class RecordFeed {
 public:
  using Clock = std::chrono::steady_clock;

  // Reads the job's keys once (throws PeerLostError when the store cannot be reached), then
  // follows their changes on a background thread.
  RecordFeed(std::shared_ptr<comm::ControlStore> store, std::string job);
  ~RecordFeed();
  RecordFeed(const RecordFeed&) = delete;
  RecordFeed& operator=(const RecordFeed&) = delete;

  // Everything the feed knows, at one instant.
  struct View {
    std::map<int, Reconfiguration> records;  // by generation
    int64_t failure = 0;                     // the newest failure being recovered from (0: none)
    Progress progress;                       // rank 0's newest report
    std::string stop;  // why the job stops (decisions/stop; empty: it does not)
    // By generation: the processes started for its switch that have built their buffers.
    std::map<int, std::set<int>> prepared;
    std::string lost;  // why the store cannot be followed (empty: it can)

    const Reconfiguration* record(int g) const {
      auto it = records.find(g);
      return it == records.end() ? nullptr : &it->second;
    }
  };

  // A copy of what the feed holds now (every record seen: for the rare waits, not every step).
  View view() const;
  // Record g, if seen; the newest failure being recovered from (0: none). Cheap: for every step.
  std::optional<Reconfiguration> record(int g) const;
  int64_t failure() const;
  std::string stop() const;
  // Whether every one of `processes` reported its buffers for generation g built. Cheap.
  bool prepared(int g, const std::vector<int>& processes) const;

  // Waits until `done(view)` holds and returns it, or returns false at `deadline`. Throws
  // PeerLostError when the store stopped answering before that.
  bool wait_until(const std::function<bool(const View&)>& done, Clock::time_point deadline) const;

  // Called on the feed's thread, with the failure's number, whenever the failure being
  // recovered from increases. A worker blocked in a collective with a peer on a lost host (no
  // reset ever comes from a machine that is gone) hears of it here instead of at its
  // communication timeout. Replaces an earlier callback; must not block.
  void on_failure(std::function<void(int64_t)> callback);

  comm::ControlStore& store() { return *store_; }
  const std::string& job() const { return job_; }

 private:
  void apply(const comm::KeyValue& kv, bool erased);
  void follow();

  std::shared_ptr<comm::ControlStore> store_;
  const std::string job_;
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  View view_;
  int64_t revision_ = 0;  // the newest revision applied
  bool stop_ = false;
  std::mutex callback_mu_;
  std::function<void(int64_t)> on_failure_;
  std::thread thread_;
};

}  // namespace tessel::elastic
