// What the launcher tells a worker process (process/launcher.h), from its environment.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tessel/comm/store.h"

namespace tessel::runtime {

struct WorkerEnv {
  int rank = 0;  // this process's id in the job (elastic/reconfiguration.h), fixed for its lifetime
  int world_size = 1;     // workers the job started with
  std::string store_dir;  // the rendezvous directory of a fixed launch (`tessel launch`)
  // The job's control store (elastic/reconfiguration.h), an HTTP endpoint; when set, every
  // rendezvous goes through it too and store_dir is unused.
  std::string control_store;
  std::string job_id;
  int64_t generation = 0;       // the store generation the job's first world uses
  int64_t join_generation = 0;  // > 0: started for the switch to this generation
  bool elastic = false;  // the launcher takes scale requests and recovers from failed workers
  // The checkpoint the launcher chose to resume from ("" for a fresh start; unset when no
  // launcher chose: the worker looks for it itself, checkpoint::find_resume_point).
  std::optional<std::string> resume_from;

  // Reads TESSEL_RANK, TESSEL_WORLD_SIZE, TESSEL_JOB_ID (required), TESSEL_STORE_DIR or
  // TESSEL_CONTROL_STORE (one of them), TESSEL_GENERATION, TESSEL_JOIN_GENERATION and
  // TESSEL_ELASTIC (0 when unset) and TESSEL_RESUME_FROM (may be unset). Throws
  // ConfigError naming the missing or malformed variable.
  static WorkerEnv from_environment();

  // The rendezvous of the world under store generation `store_generation` (env.generation + the
  // job's switches so far), every wait bounded by `timeout_s` (training.comm_timeout_s).
  comm::StoreOptions store(int64_t store_generation, double timeout_s) const;
};

}  // namespace tessel::runtime
