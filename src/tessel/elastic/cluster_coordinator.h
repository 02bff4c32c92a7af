// The coordinator of a job on a cluster of hosts (cluster.h): the decider (decider.h) run by the
// agent that holds the job's election, which starts, fences and hears of processes on every host
// through the store instead of a local launcher:
//  * hosts: the registry's hosts (their slots) are the decider's; a host whose lease expired is
//    lost with its processes (one recovery), a new one is a scale request to the worker count
//    the slots then hold (elastic.grow_to_slots);
//  * starts: a placement key per process, which the process's host's agent carries out;
//  * fences: a fence key, which the agent carries out (SIGKILL); a process on a lost host needs
//    none -- its host's agent fences everything of it when it finds its own lease expired;
//  * exits: the agents' exit reports;
//  * the first world: once the hosts hold the config's plan (elastic.min_workers lowers that),
//    decisions/start and its placements;
//  * the end: once every process has ended, decisions/done with the job's exit code.
//  * a take-over: an agent elected after the coordinator's host was lost rebuilds the decisions
//    from the store (Decider's History constructor) and goes on; processes of lost hosts are
//    deaths, recovered from as usual.
// Only one agent runs it at a time (the election in agent.h; a second decider would be refused by
// the decisions' compare-and-set anyway).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/comm/control_store.h"
#include "tessel/config/train_config.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/decider.h"

namespace tessel::elastic {

class ClusterCoordinator {
 public:
  // The newest committed checkpoint of the job, published on this host: its directory and
  // step (cluster_checkpoints.h's CheckpointKeeper::newest).
  using CheckpointFinder = std::function<std::optional<std::pair<std::string, int64_t>>()>;

  // Without `newest_checkpoint` (no checkpoint.dir), the job never resumes nor rolls back.
  ClusterCoordinator(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store,
                     std::string cluster, std::string job, CheckpointFinder newest_checkpoint = {});

  // One round: reads the hosts, the exits, a stop request and the workers' reports, makes the
  // decisions due and writes their placements and fences. Returns the job's end once it is over
  // (also written to decisions/done); errors that end the job (no recovery possible, a worker's
  // error exit) become that end rather than an exception.
  std::optional<JobEnd> tick();

  const std::string& job() const { return job_; }

 private:
  bool start_first_world(const std::vector<Host>& hosts);
  std::optional<checkpoint::ResumePoint> resume_point();
  void use_cluster_checkpoints();
  void take_over(const StartRecord& start, const std::vector<Host>& hosts);
  void place(const std::vector<Decider::Start>& starts);
  std::optional<JobEnd> finish(JobEnd end);

  config::TrainConfig cfg_;
  std::shared_ptr<comm::ControlStore> store_;
  std::string cluster_, job_;
  CheckpointFinder newest_checkpoint_;
  std::unique_ptr<Decider> decider_;
  std::set<int> exits_seen_;
  std::set<int> fenced_;
  std::string failure_;  // why the job cannot go on (a worker's error exit); it stops
  bool waiting_logged_ = false;
};

}  // namespace tessel::elastic
