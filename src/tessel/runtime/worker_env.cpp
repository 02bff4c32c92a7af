#include "tessel/runtime/worker_env.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>

#include "tessel/comm/etcd_store.h"
#include "tessel/core/check.h"
#include "tessel/core/parse_number.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/submission.h"

namespace tessel::runtime {

namespace {

std::string env_string(const char* name, bool required) {
  const char* v = std::getenv(name);
  TESSEL_CHECK(v != nullptr || !required, ConfigError,
               "environment variable {} is not set: start workers with `tessel train CONFIG "
               "--nproc N` (or `tessel launch`), which sets it",
               name);
  return v != nullptr ? std::string(v) : std::string();
}

int64_t env_int(const char* name, bool required) {
  std::string s = env_string(name, required);
  if (s.empty()) return 0;
  return parse_integer(s, fmt::format("environment variable {}", name), 0, INT32_MAX);
}

}  // namespace

WorkerEnv WorkerEnv::from_environment() {
  WorkerEnv e;
  e.rank = int(env_int("TESSEL_RANK", true));
  e.world_size = int(env_int("TESSEL_WORLD_SIZE", true));
  e.control_store = env_string("TESSEL_CONTROL_STORE", false);
  e.store_dir = env_string("TESSEL_STORE_DIR", e.control_store.empty());
  e.job_id = env_string("TESSEL_JOB_ID", true);
  e.generation = env_int("TESSEL_GENERATION", false);
  e.join_generation = env_int("TESSEL_JOIN_GENERATION", false);
  e.elastic = env_int("TESSEL_ELASTIC", false) == 1;
  if (const char* resume = std::getenv("TESSEL_RESUME_FROM")) e.resume_from = resume;
  e.pipeline_delay = env_string("TESSEL_PIPELINE_DELAY", false);
  e.cluster = env_string("TESSEL_CLUSTER", false);
  e.host_address = env_string("TESSEL_HOST_ADDRESS", false);
  if (!e.cluster.empty()) {
    e.host_id = int(env_int("TESSEL_HOST_ID", false));
    e.checkpoint_root = env_string("TESSEL_CHECKPOINT_DIR", false);
    e.secret = elastic::read_cluster_secret(env_string(elastic::kClusterTokenEnv, false),
                                            "a worker of a cluster job");
  }
  if (const int64_t launcher = env_int("TESSEL_LAUNCHER_PID", false); launcher > 0)
    e.launcher = std::make_shared<LauncherLoss>(launcher);
  if (std::getenv("TESSEL_CONSOLE_FD") != nullptr)
    e.console_fd = int(env_int("TESSEL_CONSOLE_FD", false));
  // A worker started for a switch may take a rank beyond the world the job started with: its
  // place comes from the switch.
  TESSEL_CHECK(!e.elastic || !e.control_store.empty(), ConfigError,
               "TESSEL_ELASTIC=1 needs TESSEL_CONTROL_STORE (the job's control store): start "
               "elastic jobs with `tessel train`");
  TESSEL_CHECK(e.world_size >= 1 && (e.rank < e.world_size || e.join_generation > 0), ConfigError,
               "TESSEL_RANK {} is not below TESSEL_WORLD_SIZE {}", e.rank, e.world_size);
  return e;
}

void LauncherLoss::notice() noexcept {
  std::lock_guard lock(mu_);
  if (gone_) return;
  if (callback_) callback_();
  gone_ = true;
}

void LauncherLoss::on_notice(std::function<void()> f) {
  std::lock_guard lock(mu_);
  callback_ = std::move(f);
  if (gone_ && callback_) callback_();
}

comm::StoreOptions WorkerEnv::store(int64_t store_generation, double timeout_s) const {
  comm::StoreOptions options;
  options.path = store_dir;
  options.control_endpoint = control_store;
  options.job_id = job_id;
  options.generation = store_generation;
  options.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000));
  if (signals) options.abort_signal = signals->of(store_generation);
  options.secret = secret;
  return options;
}

std::shared_ptr<comm::ControlStore> WorkerEnv::open_control_store(
    std::chrono::milliseconds timeout) const {
  if (secret.empty()) return std::make_shared<comm::EtcdStore>(control_store, timeout);
  return elastic::open_cluster_store(control_store, timeout, secret, cluster);
}

comm::TransportOptions WorkerEnv::transport() const {
  comm::TransportOptions t;
  if (!host_address.empty()) t.hostname = host_address;
  return t;
}

config::TrainConfig WorkerEnv::cluster_config() const {
  TESSEL_CHECK(!cluster.empty() && !control_store.empty(), ConfigError,
               "`tessel worker` needs a config file, or TESSEL_CLUSTER and TESSEL_CONTROL_STORE "
               "(set by `tessel agent`)");
  return elastic::submitted_config(*open_control_store(std::chrono::seconds(10)), cluster);
}

}  // namespace tessel::runtime
