#include "tessel/comm/store.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>

#include <filesystem>
#include <thread>

#include "tessel/comm/abort_signal.h"
#include "tessel/comm/control_rendezvous.h"
#include "tessel/comm/etcd_store.h"
#include "tessel/comm/signed_store.h"
#include "tessel/core/check.h"

namespace tessel::comm {
namespace {

std::string names(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : " ") + k;
  return out;
}

// Gloo's FileStore with waits bounded by our timeout, to the millisecond. Gloo's own wait rounds
// elapsed time down to whole seconds (a 10 ms timeout fires after 1 s) and some of its callers
// pass its 30 s default instead of ours, so the timeout argument is ignored in favour of the one
// this store was built with. The wait polls, so it also looks at the abort signal (if any) at
// every poll.
class TimedFileStore : public gloo::rendezvous::FileStore {
 public:
  TimedFileStore(const std::string& path, std::chrono::milliseconds timeout,
                 std::shared_ptr<AbortSignal> abort_signal)
      : FileStore(path), timeout_(timeout), abort_signal_(std::move(abort_signal)) {}

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    // Poll quickly at first (peers usually arrive within milliseconds), then back off.
    auto pause = std::chrono::microseconds(500);
    while (!check(keys)) {
      if (abort_signal_ && abort_signal_->aborted()) {
        throw gloo::IoException("rendezvous aborted while waiting for store key(s): " +
                                names(keys) + ": " + abort_signal_->reason());
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        throw gloo::IoException("Wait timeout after " + std::to_string(timeout_.count()) +
                                " ms for store key(s): " + names(keys));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
    }
  }

 private:
  std::chrono::milliseconds timeout_;
  std::shared_ptr<AbortSignal> abort_signal_;  // null: no abort
};

}  // namespace

void validate(const StoreOptions& options) {
  TESSEL_CHECK(!options.path.empty() || !options.control_endpoint.empty(), ConfigError,
               "rendezvous store path is empty; set it to a directory every worker can reach, or "
               "set the control endpoint to rendezvous through the control store");
  TESSEL_CHECK(options.control_endpoint.empty() || is_etcd_endpoint(options.control_endpoint),
               ConfigError,
               "rendezvous control endpoint '{}' must look like http://host:port or "
               "https://host:port",
               options.control_endpoint);
  TESSEL_CHECK(!options.job_id.empty(), ConfigError,
               "rendezvous job id is empty; give every job a unique id");
  TESSEL_CHECK(options.job_id.find('/') == std::string::npos, ConfigError,
               "rendezvous job id '{}' contains '/'; ids are path-free names", options.job_id);
  TESSEL_CHECK(options.generation >= 0, ConfigError,
               "rendezvous generation {} is negative; generations count up from 0",
               options.generation);
  TESSEL_CHECK(options.timeout.count() > 0, ConfigError,
               "rendezvous timeout {} ms must be positive", options.timeout.count());
}

void validate_group_name(const std::string& group_name) {
  TESSEL_CHECK(!group_name.empty(), ConfigError, "communicator group name is empty");
  TESSEL_CHECK(group_name.find('/') == std::string::npos, ConfigError,
               "communicator group name '{}' contains '/'", group_name);
}

std::string store_prefix(const StoreOptions& options, const std::string& group_name) {
  validate(options);
  validate_group_name(group_name);
  const std::string generation = std::to_string(options.generation);
  if (!options.control_endpoint.empty()) {
    // The control store holds the whole job's state; rendezvous keys keep to their own subtree.
    return "/tessel/" + options.job_id + "/rendezvous/" + generation + "/" + group_name;
  }
  return options.job_id + "/" + generation + "/" + group_name;
}

GroupStore::GroupStore(const StoreOptions& options, const std::string& group_name)
    : prefix_(store_prefix(options, group_name)), timeout_(options.timeout) {
  if (options.control_endpoint.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.path, ec);
    TESSEL_CHECK(!ec && std::filesystem::is_directory(options.path), IoError,
                 "cannot create rendezvous store directory '{}': {}", options.path,
                 ec ? ec.message() : "not a directory");
    location_ = options.path;
    base_store_ =
        std::make_unique<TimedFileStore>(options.path, options.timeout, options.abort_signal);
  } else {
    location_ = options.control_endpoint;
    auto etcd = std::make_unique<EtcdStore>(options.control_endpoint);
    if (options.secret.empty()) {
      control_ = std::move(etcd);
    } else {
      // Every rendezvous entry proves its writer holds the job's secret.
      control_ =
          std::make_unique<SignedStore>(std::move(etcd), options.secret, "job " + options.job_id);
    }
    base_store_ =
        std::make_unique<ControlRendezvousStore>(*control_, options.timeout, options.abort_signal);
  }
  prefix_store_ = std::make_unique<gloo::rendezvous::PrefixStore>(prefix_, *base_store_);
}

GroupStore::~GroupStore() = default;

gloo::rendezvous::Store& GroupStore::store() {
  return *prefix_store_;
}

}  // namespace tessel::comm
