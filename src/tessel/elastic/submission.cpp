#include "tessel/elastic/submission.h"

#include <fmt/format.h>

#include <map>
#include <thread>

#include "tessel/comm/etcd_store.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

using Clock = std::chrono::steady_clock;

ClusterAddress parse_cluster_address(const std::string& text) {
  // "<scheme>://host:port" then an optional "/<cluster>".
  const size_t scheme = text.find("://");
  const size_t slash = scheme == std::string::npos ? std::string::npos : text.find('/', scheme + 3);
  ClusterAddress a;
  a.store = text.substr(0, slash);
  TESSEL_CHECK(comm::is_etcd_endpoint(a.store), ConfigError,
               "--cluster '{}' is not etcd's client URL: use http://host:port or "
               "http://host:port/<cluster> (https:// with TESSEL_ETCD_CA/CERT/KEY)",
               text);
  if (slash != std::string::npos && slash + 1 < text.size()) {
    a.cluster = text.substr(slash + 1);
    check_key_segment(a.cluster, "--cluster: the cluster's name");
  }
  return a;
}

void submit_job(comm::ControlStore& store, const std::string& cluster, const JobSubmission& job) {
  check_key_segment(job.job, "the job id");
  const auto hosts = list_hosts(store, cluster);
  TESSEL_CHECK(!hosts.empty(), ConfigError,
               "no agent has joined cluster '{}': start `tessel agent --store <etcd> --cluster {}` "
               "on each host (or check the cluster's name)",
               cluster, cluster);
  TESSEL_CHECK(store.list(job_prefix(job.job)).empty(), ConfigError,
               "job {} already has keys under {} (a job of that id runs, or left them behind): "
               "give this job another id, or remove them (etcdctl del --prefix {})",
               job.job, job_prefix(job.job), job_prefix(job.job));
  if (!store.compare_and_set(submission_key(cluster), 0, job.to_json().dump())) {
    std::string other = "another job";
    if (auto kv = store.get(submission_key(cluster))) {
      try {
        const auto running = JobSubmission::from_json(nlohmann::json::parse(kv->value), kv->key);
        other = fmt::format("job {} ({})", running.job, running.config_path);
      } catch (const std::exception&) {
      }
    }
    TESSEL_THROW(ConfigError,
                 "cluster '{}' runs {}: one job at a time; stop it first (SIGINT to its `tessel "
                 "train`), or use another cluster",
                 cluster, other);
  }
}

namespace {

// What the submitter has shown so far, to print only changes.
struct Shown {
  std::map<int, std::string> hosts;
  int generation = 0;
  int64_t step = -1;
  bool started = false;
};

void show_changes(comm::ControlStore& store, const std::string& cluster, const std::string& job,
                  int64_t progress_every, Shown& shown,
                  const std::function<void(const std::string&)>& print) {
  std::map<int, std::string> hosts;
  for (const auto& h : list_hosts(store, cluster))
    hosts[h.id] = fmt::format("{} ({}, {} slots)", h.name, h.address, h.slots);
  for (const auto& [id, what] : hosts)
    if (!shown.hosts.contains(id)) print(fmt::format("host {} joined: {}", id, what));
  for (const auto& [id, what] : shown.hosts)
    if (!hosts.contains(id)) print(fmt::format("host {} lost: {}", id, what));
  shown.hosts = std::move(hosts);
  if (!shown.started) {
    if (auto kv = store.get(start_key(job))) {
      const auto s = StartRecord::from_json(nlohmann::json::parse(kv->value), kv->key);
      print(fmt::format("started {} workers ({}) at step {}", s.plan.world(), s.plan.describe(),
                        s.step));
      shown.started = true;
    }
  }
  for (const auto& kv : store.list(records_prefix(job))) {
    const int g = record_generation(job, kv.key);
    if (g <= shown.generation) continue;
    try {
      const auto r = Reconfiguration::from_json(nlohmann::json::parse(kv.value), kv.key);
      print(fmt::format("generation {}: {} -> {} workers ({}): {}", g, r.from.world(), r.to.world(),
                        r.to.describe(), r.cause));
    } catch (const std::exception&) {
    }
    shown.generation = g;
  }
  if (auto kv = store.get(progress_key(job))) {
    try {
      const auto p = Progress::from_json(nlohmann::json::parse(kv->value), kv->key);
      if (p.step >= shown.step + progress_every) {
        print(fmt::format("step {}", p.step));
        shown.step = p.step;
      }
    } catch (const std::exception&) {
    }
  }
}

}  // namespace

JobEnd follow_job(comm::ControlStore& store, const std::string& cluster, const std::string& job,
                  const std::function<std::string()>& interrupted,
                  const std::function<void(const std::string&)>& print,
                  std::chrono::milliseconds patience) {
  Shown shown;
  bool stop_asked = false;
  auto answered = Clock::now();
  int64_t after = 0;
  for (;;) {
    try {
      if (!stop_asked) {
        if (const std::string why = interrupted(); !why.empty()) {
          store.set(stop_request_key(job), why);
          print(fmt::format("asked the job to save and stop ({})", why));
          stop_asked = true;
        }
      }
      show_changes(store, cluster, job, 10, shown, print);
      if (auto kv = store.get(done_key(job))) {
        const auto end = JobEnd::from_json(nlohmann::json::parse(kv->value), kv->key);
        for (const auto& k : store.list(job_prefix(job))) store.erase(k.key);
        // The coordinator withdrew it already, unless it died just then.
        if (auto sub = store.get(submission_key(cluster))) {
          try {
            if (JobSubmission::from_json(nlohmann::json::parse(sub->value), sub->key).job == job)
              store.erase(sub->key);
          } catch (const std::exception&) {
          }
        }
        return end;
      }
      if (after == 0) after = store.revision();
      after = store.watch("/tessel/", after, std::chrono::milliseconds(500)).revision;
      answered = Clock::now();
    } catch (const CorruptDataError&) {
      after = 0;
    } catch (const PeerLostError& e) {
      TESSEL_CHECK(Clock::now() - answered < patience, PeerLostError,
                   "etcd has not answered for {} s: {} (the job goes on in the cluster; run "
                   "`tessel train` again to follow it)",
                   patience.count() / 1000, e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
}

config::TrainConfig submitted_config(comm::ControlStore& store, const std::string& cluster) {
  auto kv = store.get(submission_key(cluster));
  TESSEL_CHECK(kv.has_value(), ConfigError, "cluster '{}' runs no job ({} is absent)", cluster,
               submission_key(cluster));
  const auto sub = JobSubmission::from_json(nlohmann::json::parse(kv->value), kv->key);
  auto cfg = config::TrainConfig::parse(sub.config_yaml, sub.config_path);
  if (sub.steps > 0) cfg.training.steps = sub.steps;
  return cfg;
}

}  // namespace tessel::elastic
