#include "tessel/elastic/record_feed.h"

#include "tessel/core/check.h"
#include "tessel/core/log.h"

namespace tessel::elastic {

namespace {

// A watch returns at least this often, so the destructor never waits longer for the thread.
constexpr std::chrono::milliseconds kWatchSlice{200};

}  // namespace

RecordFeed::RecordFeed(std::shared_ptr<comm::ControlStore> store, std::string job)
    : store_(std::move(store)), job_(std::move(job)) {
  // The revision first: a change between it and the listing is seen twice, which is harmless
  // (apply() is idempotent); one after the listing is not missed.
  revision_ = store_->revision();
  for (const auto& kv : store_->list(job_prefix(job_))) apply(kv, false);
  thread_ = std::thread([this] { follow(); });
}

RecordFeed::~RecordFeed() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  thread_.join();
}

void RecordFeed::apply(const comm::KeyValue& kv, bool erased) {
  if (erased) return;  // what was seen stays seen
  try {
    if (const int g = record_generation(job_, kv.key); g >= 0) {
      auto r = Reconfiguration::from_json(nlohmann::json::parse(kv.value), kv.key);
      TESSEL_CHECK(r.generation == g, CorruptDataError,
                   "{} holds the record of generation {}, not {}", kv.key, r.generation, g);
      std::lock_guard lock(mu_);
      view_.records.insert_or_assign(g, std::move(r));
    } else if (kv.key == failure_key(job_)) {
      const int64_t e = comm::parse_counter(kv.key, kv.value);
      bool newer = false;
      {
        std::lock_guard lock(mu_);
        newer = e > view_.failure;
        view_.failure = std::max(view_.failure, e);
      }
      std::lock_guard lock(callback_mu_);
      if (newer && on_failure_) on_failure_(e);
    } else if (kv.key == stop_key(job_)) {
      auto reason = nlohmann::json::parse(kv.value).at("reason").get<std::string>();
      std::lock_guard lock(mu_);
      view_.stop = reason.empty() ? "stopped" : std::move(reason);
    } else if (const auto report = prepared_report(job_, kv.key)) {
      const auto [g, process] = *report;
      TESSEL_CHECK(g >= 0, CorruptDataError, "{} is no prepared report", kv.key);
      std::lock_guard lock(mu_);
      view_.prepared[g].insert(process);
    } else if (kv.key == progress_key(job_)) {
      auto p = Progress::from_json(nlohmann::json::parse(kv.value), kv.key);
      std::lock_guard lock(mu_);
      view_.progress = p;
    }
  } catch (const std::exception& e) {
    // Not written by this job's coordinator or rank 0: a hand edit. Applying it could only do harm.
    spdlog::warn("ignoring control store key {}: {}", kv.key, e.what());
  }
}

void RecordFeed::follow() {
  auto pause = std::chrono::milliseconds(50);
  for (;;) {
    int64_t after = 0;
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      after = revision_;
    }
    try {
      auto got = store_->watch(job_prefix(job_), after, kWatchSlice);
      for (const auto& ev : got.events) apply(ev.kv, ev.kind == comm::WatchEvent::Kind::erase);
      std::lock_guard lock(mu_);
      revision_ = std::max(revision_, got.revision);
      view_.lost.clear();
      pause = std::chrono::milliseconds(50);
      if (!got.events.empty()) changed_.notify_all();
    } catch (const CorruptDataError&) {
      // The history was compacted past `after`: read the keys as they are now.
      try {
        const int64_t rev = store_->revision();
        for (const auto& kv : store_->list(job_prefix(job_))) apply(kv, false);
        std::lock_guard lock(mu_);
        revision_ = rev;
        changed_.notify_all();
      } catch (const std::exception& e) {
        std::lock_guard lock(mu_);
        view_.lost = e.what();
      }
    } catch (const std::exception& e) {
      // The store is gone or slow: waiters see why; try again, a little later each time.
      std::unique_lock lock(mu_);
      view_.lost = e.what();
      changed_.notify_all();
      changed_.wait_for(lock, pause, [&] { return stop_; });
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }
}

void RecordFeed::on_failure(std::function<void(int64_t)> callback) {
  std::lock_guard lock(callback_mu_);
  on_failure_ = std::move(callback);
}

RecordFeed::View RecordFeed::view() const {
  std::lock_guard lock(mu_);
  return view_;
}

std::optional<Reconfiguration> RecordFeed::record(int g) const {
  std::lock_guard lock(mu_);
  if (const auto* r = view_.record(g)) return *r;
  return std::nullopt;
}

int64_t RecordFeed::failure() const {
  std::lock_guard lock(mu_);
  return view_.failure;
}

std::string RecordFeed::stop() const {
  std::lock_guard lock(mu_);
  return view_.stop;
}

bool RecordFeed::prepared(int g, const std::vector<int>& processes) const {
  std::lock_guard lock(mu_);
  const auto it = view_.prepared.find(g);
  for (int p : processes)
    if (it == view_.prepared.end() || !it->second.contains(p)) return false;
  return true;
}

bool RecordFeed::wait_until(const std::function<bool(const View&)>& done,
                            Clock::time_point deadline) const {
  std::unique_lock lock(mu_);
  for (;;) {
    if (done(view_)) return true;
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (done(view_)) return true;
      // A store that stopped answering for a moment is retried; one that did until the deadline
      // is why nothing came.
      TESSEL_CHECK(view_.lost.empty(), PeerLostError,
                   "the job's control store stopped answering: {} (the coordinator, `tessel "
                   "train`, or etcd is gone)",
                   view_.lost);
      return false;
    }
  }
}

}  // namespace tessel::elastic
