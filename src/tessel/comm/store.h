// Rendezvous store for forming communicators.
//
// Processes find each other through Gloo's FileStore: a directory every process can reach (one
// host, or a shared file system). Every key a group writes lives under the prefix
// "<job_id>/<generation>/<group_name>/", so
//   - two groups of one world (tp.0, dp.1, ...) never see each other's keys, and
//   - a later generation of the same job (an elastic restart with a new world) forms fresh
//     groups in the same directory without tripping over the keys of the dead generation.
// Gloo's FileStore refuses to overwrite a key; re-using a (job, generation, group, rank) that is
// already in the directory is reported as a ConfigError telling the caller to bump the generation.
//
// Every wait on the store is bounded by StoreOptions::timeout (Gloo's own FileStore measures
// timeouts in whole seconds and defaults to 30 s; this layer enforces ours to the millisecond).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace gloo::rendezvous {
class Store;
}

namespace tessel::comm {

struct StoreOptions {
  std::string path;                          // directory for Gloo's FileStore; created if missing
  std::string job_id;                        // non-empty, no '/'
  int64_t generation = 0;                    // >= 0; bump it whenever a new world forms
  std::chrono::milliseconds timeout{60000};  // bound on every rendezvous wait (> 0)
};

// Throws ConfigError when the options cannot form a valid prefix (empty path or job id, '/' in
// the job id, negative generation, non-positive timeout).
void validate(const StoreOptions& options);

// Throws ConfigError unless `group_name` is non-empty and contains no '/'.
void validate_group_name(const std::string& group_name);

// "<job_id>/<generation>/<group_name>", the key prefix of one group of one generation.
std::string store_prefix(const StoreOptions& options, const std::string& group_name);

// The rendezvous store of one group: a FileStore on options.path, wrapped so every wait honours
// options.timeout, under a gloo::rendezvous::PrefixStore with store_prefix(options, group).
// Owns all three layers; store() stays valid while this object lives.
class GroupStore {
 public:
  // Creates options.path if needed. Throws ConfigError for invalid options and IoError when the
  // directory cannot be created.
  GroupStore(const StoreOptions& options, const std::string& group_name);
  ~GroupStore();
  GroupStore(const GroupStore&) = delete;
  GroupStore& operator=(const GroupStore&) = delete;

  // The prefixed store to hand to gloo::rendezvous::Context::connectFullMesh. Gloo exceptions
  // from it propagate unchanged (the Communicator maps them).
  gloo::rendezvous::Store& store();
  const std::string& prefix() const { return prefix_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<gloo::rendezvous::Store> file_store_;    // timed FileStore
  std::unique_ptr<gloo::rendezvous::Store> prefix_store_;  // refers to *file_store_
};

}  // namespace tessel::comm
