#include "tessel/elastic/agent.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "tessel/comm/etcd_store.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/log.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/cluster_checkpoints.h"
#include "tessel/elastic/cluster_coordinator.h"
#include "tessel/elastic/heartbeat.h"
#include "tessel/elastic/reconfiguration.h"
#include "tessel/process/launcher.h"
#include "tessel/process/supervisor.h"

namespace tessel::elastic {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string interface_address(const std::string& iface) {
  ifaddrs* all = nullptr;
  TESSEL_CHECK(::getifaddrs(&all) == 0, IoError, "cannot list network interfaces: {}",
               std::strerror(errno));
  std::string found;
  for (ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || iface != a->ifa_name)
      continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) found = text;
  }
  ::freeifaddrs(all);
  TESSEL_CHECK(!found.empty(), ConfigError,
               "--iface {}: no IPv4 address on that interface (see `ip -4 addr`), or give "
               "--address",
               iface);
  return found;
}

namespace {

std::string machine_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : "host";
}

// Wakes the agent's loop on every change under /tessel/ (one long watch; the loop reads what it
// needs itself, so a missed or coalesced wakeup loses nothing).
class StoreWatch {
 public:
  explicit StoreWatch(std::string endpoint) : store_(std::move(endpoint)) {
    fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    TESSEL_CHECK(fd_ >= 0, IoError, "cannot create an eventfd: {}", std::strerror(errno));
    thread_ = std::thread([this] { run(); });
  }
  ~StoreWatch() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  int fd() const { return fd_; }
  void drain() {
    uint64_t n = 0;
    if (::read(fd_, &n, sizeof n) < 0) {
      // EAGAIN: nothing pending.
    }
  }

 private:
  void run() {
    int64_t after = 0;
    while (!stop_) {
      bool changed = false;
      try {
        if (after == 0) after = store_.revision();
        auto got = store_.watch("/tessel/", after, std::chrono::milliseconds(250));
        after = got.revision;
        changed = !got.events.empty();
      } catch (const CorruptDataError&) {
        after = 0;  // compacted: the loop re-reads everything anyway
        changed = true;
      } catch (const std::exception&) {
        // etcd unreachable: the loop notices through its own calls and its lease.
        std::this_thread::sleep_for(std::chrono::milliseconds(250));
      }
      const uint64_t one = 1;
      if (changed && ::write(fd_, &one, sizeof one) < 0) {
        // The counter is full: a wakeup is pending anyway.
      }
    }
  }

  comm::EtcdStore store_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class Agent {
 public:
  explicit Agent(AgentOptions o)
      : o_(std::move(o)),
        // Calls that end well within a lease: a loop blocked on a cut link must still notice
        // that its lease is gone and fence its workers.
        secret_(read_cluster_secret(o_.token_file, "tessel agent")),
        store_(open_cluster_store(o_.store, o_.lease_ttl, secret_, o_.cluster)),
        beat_store_(open_cluster_store(o_.store, o_.lease_ttl / 2, secret_, o_.cluster)),
        watch_(o_.store),
        supervisor_(supervisor_options(o_)) {
    if (o_.name.empty()) o_.name = machine_name();
    if (o_.address.empty())
      o_.address = o_.iface.empty() ? "127.0.0.1" : interface_address(o_.iface);
    if (o_.tessel_binary.empty()) o_.tessel_binary = fs::read_symlink("/proc/self/exe").string();
    try {
      store_->revision();
    } catch (const Error& e) {
      TESSEL_THROW(PeerLostError,
                   "tessel agent: no etcd answers at {}: {} (start etcd there, or pass --store "
                   "with its client URL)",
                   o_.store, e.what());
    }
    // Refused before it registers: a host record nobody believes would only be skipped.
    check_cluster_secret(*store_, o_.cluster, /*create=*/true);
    join();
  }

  int run() {
    const auto grace = std::chrono::seconds(30);
    std::optional<Clock::time_point> leave_by;
    for (;;) {
      watch_.drain();
      if (supervisor_.interrupted() && !leave_by) {
        spdlog::info("agent: stopping: its workers leave the job (SIGTERM), then it deregisters");
        leave_by = Clock::now() + grace;
        for (auto& [id, w] : workers_) supervisor_.terminate(id);
      }
      step();
      for (const auto& e : supervisor_.poll(std::chrono::milliseconds(500), {watch_.fd()}))
        exited(e);
      report_exits();
      if (leave_by && (workers_.empty() || Clock::now() >= *leave_by)) break;
    }
    supervisor_.stop_all();
    resign();
    return 0;
  }

 private:
  struct Worker {
    std::string job;
    int process = 0;
  };
  struct Job {
    JobSubmission sub;
    std::optional<config::TrainConfig> cfg;
    std::set<int> started;  // processes this agent started (or found ended) for it
    // This host's share of the job's checkpoints (none without checkpoint.dir); declared before
    // the coordinator, which asks it, so it outlives it.
    std::unique_ptr<CheckpointKeeper> keeper;
    std::string checkpoint_root;  // the job's checkpoint directory on this host
    std::unique_ptr<ClusterCoordinator> coordinator;
    bool done = false;
  };

  static process::SupervisorOptions supervisor_options(const AgentOptions& o) {
    process::SupervisorOptions s;
    s.log_dir = o.work_dir;
    s.name = "agent";
    s.forward_interrupts = false;  // SIGTERM to the agent: its workers leave the job
    s.stop_timeout = std::chrono::seconds(10);
    return s;
  }

  // Registers this host under a new id and lease.
  void join() {
    host_ = take_host_id(*store_, o_.cluster);
    HostRecord h;
    h.id = host_;
    h.name = o_.name;
    h.address = o_.address;
    h.slots = o_.slots;
    h.iface = o_.iface;
    h.agent_pid = ::getpid();
    h.started = unix_seconds();
    beat_ = std::make_unique<Heartbeat>(beat_store_, host_key(o_.cluster, host_), o_.lease_ttl,
                                        h.to_json().dump());
    spdlog::info("agent: host {} ({}, {}) joined cluster '{}' at {} with {} slot(s)", host_,
                 o_.name, o_.address, o_.cluster, o_.store, o_.slots);
  }

  // Gives up this host's place: the coordinator role first (another agent takes it at once),
  // then the lease (the host is gone from the cluster).
  void resign() {
    if (!beat_) return;  // not registered (cut off): nothing of it is left in the cluster
    try {
      if (job_ && job_->coordinator) {
        if (auto kv = store_->get(coordinator_key(job_->sub.job));
            kv && kv->lease == beat_->lease())
          store_->erase(kv->key);
      }
      store_->revoke(beat_->lease());
    } catch (const std::exception& e) {
      spdlog::warn("agent: could not deregister: {} (the lease expires by itself)", e.what());
    }
  }

  // Every worker of this host belongs to generations the job has replaced once the host's
  // lease expired: they are killed before anything else, and the host joins again as new.
  void fence_self() {
    spdlog::error(
        "agent: host {} counts as lost in the cluster (cut off, or its record removed); killing "
        "its {} worker(s) (their generations are replaced) and joining again",
        host_, workers_.size());
    // Revoked, not left to expire: a record removed by hand leaves the lease alive.
    try {
      store_->revoke(beat_->lease());
    } catch (const std::exception&) {
    }
    for (auto& [id, w] : workers_) supervisor_.kill(id);
    for (const auto& e : supervisor_.stop_all()) {
      if (auto it = workers_.find(e.id); it != workers_.end())
        spdlog::info("agent: process {} of job {} {} (fenced)", it->second.process, it->second.job,
                     e.describe());
    }
    workers_.clear();
    unreported_.clear();  // their exits were counted with the host's loss
    job_.reset();
    beat_.reset();
  }

  void step() {
    if (beat_ && beat_->lost()) fence_self();
    if (!beat_) {
      try {
        join();
      } catch (const std::exception& e) {
        spdlog::warn("agent: cannot join the cluster again yet: {}", e.what());
        return;
      }
    }
    try {
      follow_job();
    } catch (const PeerLostError& e) {
      spdlog::warn("agent: etcd did not answer: {}", e.what());
    }
  }

  void follow_job() {
    // A host record removed by hand (or by a tool cleaning up) makes the coordinator count this
    // host lost even though its lease lives: the same as being cut off.
    if (!store_->get(host_key(o_.cluster, host_))) {
      spdlog::error("agent: {} was removed from etcd while its lease lived",
                    host_key(o_.cluster, host_));
      fence_self();
      return;
    }
    auto kv = store_->get(submission_key(o_.cluster));
    std::optional<JobSubmission> sub;
    if (kv) {
      try {
        sub = JobSubmission::from_json(nlohmann::json::parse(kv->value), kv->key);
      } catch (const std::exception& e) {
        spdlog::warn("agent: ignoring {}: {}", kv->key, e.what());
      }
    }
    if (job_ && (!sub || sub->job != job_->sub.job)) end_job();
    if (!sub) return;
    if (!job_) {
      job_ = std::make_unique<Job>();
      job_->sub = *sub;
      try {
        auto cfg = config::TrainConfig::parse(sub->config_yaml, sub->config_path);
        if (sub->steps > 0) cfg.training.steps = sub->steps;
        job_->cfg = std::move(cfg);
      } catch (const Error& e) {
        spdlog::error("agent: job {}: its config does not load here: {}", sub->job, e.what());
      }
      if (job_->cfg && !job_->cfg->checkpoint.dir.empty()) keep_checkpoints(*job_);
      spdlog::info("agent: job {} ({})", sub->job, sub->config_path);
    }
    auto& job = *job_;
    if (job.done) return;
    if (auto done = store_->get(done_key(job.sub.job))) {
      job.done = true;
      for (auto& [id, w] : workers_) supervisor_.terminate(id);
      return;
    }
    elect(job);
    if (job.coordinator) {
      if (auto end = job.coordinator->tick()) {
        job.done = true;
        store_->erase(submission_key(o_.cluster));
        return;
      }
    }
    start_placed(job);
    kill_fenced(job);
  }

  // Serves the job's checkpoint directory on this host, keeps the copies asked of it and
  // publishes what is committed (cluster_checkpoints.h). A failure here is the job's: its saves
  // cannot complete without this host, so it is said at once.
  void keep_checkpoints(Job& job) {
    ClusterCheckpointsConfig c;
    c.cluster = o_.cluster;
    c.job = job.sub.job;
    c.checkpoint_dir = job.cfg->checkpoint.dir;
    c.root = o_.checkpoint_dir.empty() ? job.cfg->checkpoint.dir
                                       : fs::absolute(o_.checkpoint_dir).string();
    c.keep = job.cfg->checkpoint.keep;
    c.copies = job.cfg->checkpoint.copies;
    c.secret = secret_;
    c.timeout = std::chrono::milliseconds(int64_t(job.cfg->comm_timeout_s * 1000));
    job.checkpoint_root = c.root;
    try {
      job.keeper = std::make_unique<CheckpointKeeper>(
          open_cluster_store(o_.store, std::chrono::seconds(10), secret_, o_.cluster), c, host_,
          o_.address, fs::absolute(o_.token_file).string(), beat_->lease());
    } catch (const Error& e) {
      spdlog::error("agent: job {}: cannot keep its checkpoints in {}: {}", job.sub.job, c.root,
                    e.what());
    }
  }

  void end_job() {
    for (auto& [id, w] : workers_)
      if (w.job == job_->sub.job) supervisor_.kill(id);
    job_.reset();
  }

  // The coordinator election: the job's coordinator key, created on this host's lease by the
  // first agent to try. Lost with the lease: another agent then takes over.
  void elect(Job& job) {
    const std::string key = coordinator_key(job.sub.job);
    auto kv = store_->get(key);
    if (job.coordinator && (!kv || kv->lease != beat_->lease())) {
      spdlog::warn("agent: no longer the coordinator of job {}", job.sub.job);
      job.coordinator.reset();
    }
    if (job.coordinator || kv || !job.cfg) return;
    if (!store_->compare_and_set(key, 0, std::to_string(host_), beat_->lease())) return;
    spdlog::info("agent: host {} coordinates job {}", host_, job.sub.job);
    ClusterCoordinator::CheckpointFinder newest;
    if (job.keeper) newest = [keeper = job.keeper.get()] { return keeper->newest(); };
    job.coordinator = std::make_unique<ClusterCoordinator>(*job.cfg, store_, o_.cluster,
                                                           job.sub.job, std::move(newest));
  }

  void start_placed(Job& job) {
    if (supervisor_.interrupted()) return;
    std::optional<StartRecord> start;
    for (const auto& kv : store_->list(placement_prefix(job.sub.job))) {
      Placement p;
      try {
        p = Placement::from_json(nlohmann::json::parse(kv.value), kv.key);
      } catch (const std::exception& e) {
        spdlog::warn("agent: ignoring {}: {}", kv.key, e.what());
        continue;
      }
      if (p.host != host_ || job.started.contains(p.process)) continue;
      if (!start) {
        auto s = store_->get(start_key(job.sub.job));
        TESSEL_CHECK(s.has_value(), CorruptDataError, "job {} places process {} but has no {}",
                     job.sub.job, p.process, start_key(job.sub.job));
        start = StartRecord::from_json(nlohmann::json::parse(s->value), s->key);
      }
      job.started.insert(p.process);
      spawn(job, p, *start);
    }
  }

  void spawn(const Job& job, const Placement& p, const StartRecord& start) {
    process::WorkerSpec w;
    w.id = next_worker_++;
    // Below the agent's and etcd's priority: workers keep every core busy, and a starved lease
    // renewal would make the cluster count a healthy host lost.
    w.command = {"nice", "-n", "5", o_.tessel_binary, "--log-level", o_.log_level, "worker"};
    w.log_name = fmt::format("{}-process{}.log", job.sub.job, p.process);
    w.console_prefix = fmt::format("[process {}] ", p.process);
    w.env = {{"TESSEL_RANK", std::to_string(p.process)},
             {"TESSEL_WORLD_SIZE", std::to_string(start.plan.world())},
             {"TESSEL_JOB_ID", job.sub.job},
             {"TESSEL_CONTROL_STORE", o_.store},
             {"TESSEL_CLUSTER", o_.cluster},
             {"TESSEL_ELASTIC", "1"},
             {"TESSEL_GENERATION", "0"},
             {"TESSEL_RESUME_FROM", start.resume_from},
             {"TESSEL_HOST_ADDRESS", o_.address},
             {kClusterTokenEnv, fs::absolute(o_.token_file).string()},
             {"TESSEL_HOST_ID", std::to_string(host_)},
             {"TESSEL_CHECKPOINT_DIR", job.checkpoint_root}};
    // The host's cores shared by its slots, unless the agent's environment says otherwise.
    if (std::getenv("OMP_NUM_THREADS") == nullptr)
      w.env["OMP_NUM_THREADS"] = std::to_string(process::default_omp_threads(o_.slots));
    if (p.generation > 0) w.env["TESSEL_JOIN_GENERATION"] = std::to_string(p.generation);
    pid_t pid = -1;
    try {
      pid = supervisor_.spawn(w);
    } catch (const Error& e) {
      // Reported like an exit that is not a lost machine: the job ends with the reason.
      spdlog::error("agent: cannot start process {} of job {}: {}", p.process, job.sub.job,
                    e.what());
      unreported_.emplace_back(job.sub.job,
                               ExitReport{p.process, host_, false, false,
                                          fmt::format("could not be started: {}", e.what())});
      return;
    }
    workers_[w.id] = {job.sub.job, p.process};
    spdlog::info("agent: started process {} of job {} (pid {}{})", p.process, job.sub.job, pid,
                 p.generation > 0 ? fmt::format(", for generation {}", p.generation) : "");
  }

  void kill_fenced(const Job& job) {
    for (const auto& kv : store_->list(fence_prefix(job.sub.job))) {
      const int process = key_number(fence_prefix(job.sub.job), kv.key);
      for (auto& [id, w] : workers_)
        if (w.job == job.sub.job && w.process == process && supervisor_.kill(id))
          spdlog::warn("agent: fenced process {} of job {} (SIGKILL)", process, job.sub.job);
    }
  }

  void exited(const process::WorkerExit& e) {
    auto it = workers_.find(e.id);
    if (it == workers_.end()) return;
    ExitReport r{it->second.process, host_, e.ok(), e.signaled, e.describe(), e.crashed()};
    spdlog::info("agent: process {} of job {} {}", r.process, it->second.job, r.how);
    unreported_.emplace_back(it->second.job, r);
    workers_.erase(it);
  }

  // Exit reports wait here while etcd cannot be reached.
  void report_exits() {
    while (!unreported_.empty()) {
      const auto& [job, r] = unreported_.front();
      try {
        store_->set(exit_key(job, r.process), r.to_json().dump());
      } catch (const std::exception& e) {
        spdlog::warn("agent: cannot report process {}'s exit yet: {}", r.process, e.what());
        return;
      }
      unreported_.erase(unreported_.begin());
    }
  }

  AgentOptions o_;
  std::string secret_;  // the cluster's (cluster.h): every value this agent writes is signed
  std::shared_ptr<comm::ControlStore> store_;
  std::shared_ptr<comm::ControlStore> beat_store_;
  StoreWatch watch_;
  process::Supervisor supervisor_;
  int host_ = -1;
  std::unique_ptr<Heartbeat> beat_;
  std::unique_ptr<Job> job_;
  std::map<int, Worker> workers_;  // by supervisor id
  int next_worker_ = 0;
  std::vector<std::pair<std::string, ExitReport>> unreported_;
};

}  // namespace

int run_agent(const AgentOptions& options) {
  TESSEL_CHECK(options.slots >= 1, ConfigError,
               "tessel agent: --slots {} must be at least 1 (the worker processes this host runs)",
               options.slots);
  TESSEL_CHECK(comm::is_etcd_endpoint(options.store), ConfigError,
               "tessel agent: --store '{}' is not etcd's client URL (http://host:port, or "
               "https://host:port with TESSEL_ETCD_CA/CERT/KEY)",
               options.store);
  check_key_segment(options.cluster, "tessel agent: --cluster");
  Agent agent(options);
  return agent.run();
}

}  // namespace tessel::elastic
