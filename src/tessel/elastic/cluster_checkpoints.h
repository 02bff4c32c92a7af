// Checkpoints of a cluster job on its hosts' own disks, each rank file on two hosts.
//
// A save (the store's format, store/checkpoint_store.h, "Many hosts"):
//  1. every rank writes its rank file into the staging directory on its own host's disk (the
//     job's checkpoint directory there: the agent's --checkpoint-dir, else the config's
//     checkpoint.dir on that host), and announces it: saves/<save_id>/files/<rank> holds the
//     file's entry (what the index needs of it), its host, and the host that keeps the second
//     copy -- the previous host, by id and around, of those serving the job (one host: none);
//  2. the agent of that host (CheckpointKeeper) downloads the file from the writer's host
//     (store::download_rank_file: verified against the entry before it is kept) into its own
//     staging directory and says so (saves/<save_id>/copies/<rank>);
//  3. rank 0, once every file and every copy is announced, commits: it writes the entries and
//     then the commit record under the cluster's checkpoint keys -- the commit point; a save
//     that is not complete within the communication timeout is abandoned, its keys removed;
//  4. every agent publishes the committed checkpoint on its host (store::commit_checkpoint from
//     the entries: the same index and manifest everywhere, over the rank files the host holds,
//     or none), points `latest` at it and keeps checkpoint.keep of them.
// Losing any one host loses no rank file. A reader opens the step directory on its own host
// (publishing it first if the agent has not yet) and reads the pieces of files it does not hold
// box by box from a host that holds them (store::http_piece_fetcher), through that host's
// agent's CheckpointRootServer.
//
// Keys. The job's (removed with it): /tessel/<job>/stores/<host> (StoreRecord, on the agent's
// lease), /tessel/<job>/saves/<save_id>/{files,copies}/<rank>. The cluster's (kept across
// submissions, so the same command resumes): /tessel/clusters/<c>/checkpoints/<id>/commits/<step-N>
// (CheckpointCommit) and .../<id>/entries/<step-N>/<rank> (apart, so that listing the commits,
// which agents do often, does not read the entries), where <id> names the config's
// checkpoint.dir (a hash of the text), so the jobs that write one directory share its history.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::store {
class CheckpointRootServer;
}

namespace tessel::elastic {

// Where a host serves the job's checkpoints.
struct StoreRecord {
  int host = -1;
  std::string url;        // http://address:port of its CheckpointRootServer
  std::string dir;        // the job's checkpoint directory on that host
  std::string published;  // the newest step directory published there ("" none yet)

  nlohmann::json to_json() const;
  static StoreRecord from_json(const nlohmann::json& doc, const std::string& what);
};

// A committed checkpoint: which save, which step, and which hosts hold each rank file.
struct CheckpointCommit {
  std::string name;  // step-N
  std::string save_id;
  int64_t step = 0;
  int num_ranks = 0;
  nlohmann::json meta;                              // the manifest's meta
  std::map<std::string, std::vector<int>> holders;  // rank file -> hosts

  nlohmann::json to_json() const;
  static CheckpointCommit from_json(const nlohmann::json& doc, const std::string& what);
};

std::string stores_prefix(const std::string& job);
std::string store_key(const std::string& job, int host);
std::string save_prefix(const std::string& job, const std::string& save_id);
std::string saves_prefix(const std::string& job);
// The cluster's checkpoints of checkpoint directory `checkpoint_dir` (as the config writes it).
std::string checkpoints_prefix(const std::string& cluster, const std::string& checkpoint_dir);

// What a cluster job's processes need to find its checkpoints.
struct ClusterCheckpointsConfig {
  std::string cluster, job;
  std::string checkpoint_dir;  // as the config writes it: names the history
  std::string root;            // this host's directory of it
  int keep = 1;
  int copies = 2;
  std::string secret;  // the cluster's: the bearer token of the hosts' servers
  std::chrono::milliseconds timeout{60000};
};

// The job's committed checkpoints, oldest first.
std::vector<CheckpointCommit> list_commits(comm::ControlStore& store,
                                           const ClusterCheckpointsConfig& c);

// Publishes `commit` in c.root on this host unless it is there already, and points latest at
// the newest published; returns the local directory. Serialized with the agent's publishing by
// an flock (root/.publish.lock).
std::string publish_locally(comm::ControlStore& store, const ClusterCheckpointsConfig& c,
                            const CheckpointCommit& commit);

// A worker's side.
class ClusterSaves {
 public:
  ClusterSaves(std::shared_ptr<comm::ControlStore> store, ClusterCheckpointsConfig config,
               int host);

  // After write_rank_file(): announces this rank's file of step directory `name` (step-N) and
  // who copies it.
  void announce(const std::string& save_id, const std::string& name, int rank,
                const nlohmann::json& entry);
  // On rank 0: waits until every rank's file and copy is announced (or `cancelled`), then
  // commits step `step` (directory name `name`) and forgets commits older than the newest
  // c.keep. Throws TimeoutError naming the ranks still missing; the save's keys are removed on
  // any failure.
  void commit(const std::string& save_id, const std::string& name, int64_t step, int num_ranks,
              const nlohmann::json& meta, const std::atomic<bool>& cancelled);
  // The newest committed step, or -1.
  int64_t newest_step();

  // Checkpoint step directory `name`, opened on this host (published first when needed), and
  // the fetcher of the pieces it does not hold. Throws CorruptDataError when no commit of that
  // name exists.
  struct Opened {
    std::unique_ptr<store::CheckpointReader> reader;
    store::PieceFetcher fetch;
    std::vector<std::string> remote_files;  // read from other hosts
  };
  Opened open(const std::string& name);

  const ClusterCheckpointsConfig& config() const { return c_; }

 private:
  std::shared_ptr<comm::ControlStore> store_;
  ClusterCheckpointsConfig c_;
  int host_;
};

// The agent's side, for one job: serves the job's checkpoint directory on this host, keeps the
// second copies it is asked to, and publishes what is committed. A thread of its own: a copy of
// a large file must not delay the agent's lease renewals.
class CheckpointKeeper {
 public:
  // Serves c.root at `address` (any free port; the cluster's token file guards it), announced
  // under the job's stores key on `lease`.
  CheckpointKeeper(std::shared_ptr<comm::ControlStore> store, ClusterCheckpointsConfig config,
                   int host, const std::string& address, const std::string& token_file,
                   comm::LeaseId lease);
  ~CheckpointKeeper();
  CheckpointKeeper(const CheckpointKeeper&) = delete;
  CheckpointKeeper& operator=(const CheckpointKeeper&) = delete;

  // The newest committed checkpoint whose every rank file is still on a host serving the job,
  // published on this host (the coordinator's resume and rollback point): its local directory
  // and step.
  std::optional<std::pair<std::string, int64_t>> newest();

 private:
  void run();
  void copy_what_is_asked();
  void publish_what_is_committed();

  std::shared_ptr<comm::ControlStore> store_;
  ClusterCheckpointsConfig c_;
  int host_;
  std::unique_ptr<store::CheckpointRootServer> server_;
  StoreRecord record_;
  comm::LeaseId lease_ = 0;
  std::set<std::string> copied_;  // "<save_id>/files/<rank>" copied (or given up on)
  std::string published_;         // the newest step directory published here
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tessel::elastic
