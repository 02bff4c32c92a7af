// Rendezvous store for forming communicators.
//
// Processes find each other through one of two stores, chosen by StoreOptions::control_endpoint:
//   - empty: Gloo's FileStore on StoreOptions::path, a directory every process can reach (one
//     host, or a shared file system); a group's keys live under "<job_id>/<generation>/<group>/";
//   - "http://host:port": the job's control store (control_store.h) through an EtcdStore client
//     of that endpoint -- etcd, or the embedded store a single-host job serves (store_server.h);
//     a group's keys live under "/tessel/<job_id>/rendezvous/<generation>/<group>/".
// Either way
//   - two groups of one world (tp.0, dp.1, ...) never see each other's keys, and
//   - a later generation of the same job (an elastic restart with a new world) forms fresh
//     groups in the same store without tripping over the keys of the dead generation.
// Both stores refuse to overwrite a key; re-using a (job, generation, group, rank) that is already
// in the store is reported as a ConfigError telling the caller to bump the generation.
//
// Every wait on the store is bounded by StoreOptions::timeout (Gloo's own FileStore measures
// timeouts in whole seconds and defaults to 30 s; this layer enforces ours to the millisecond).
// With StoreOptions::abort_signal set, every wait also ends soon after the signal fires (the
// FileStore's polls look at it each time, the control store is waited on in slices, see
// control_rendezvous.h), throwing gloo::IoException "rendezvous aborted ...: <reason>".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace gloo::rendezvous {
class Store;
}

namespace tessel::comm {

class AbortSignal;
class ControlStore;

// Where and under which names one generation's process groups meet.
struct StoreOptions {
  std::string path;                          // directory for Gloo's FileStore; created if missing
  std::string job_id;                        // non-empty, no '/'
  int64_t generation = 0;                    // >= 0; bump it whenever a new world forms
  std::chrono::milliseconds timeout{60000};  // bound on every rendezvous wait (> 0)
  // The control store's "http://host:port"; when set, rendezvous goes through it and `path` is
  // not used (it may be empty). Initialized so that StoreOptions{path, job, generation, timeout}
  // stays warning-free.
  std::string control_endpoint = {};
  // When set, firing it aborts every rendezvous made with these options (Communicator::connect,
  // connect_process_groups, the store's waits) within a fraction of a second, and every
  // communicator they made (see communicator.h). A signal belongs to one generation: once fired,
  // every later connect with it fails at once, so a new generation needs a new signal.
  std::shared_ptr<AbortSignal> abort_signal = {};
  // The job's shared secret (bytes: the token file's content, net::read_token_file); empty: no
  // membership proof (the behaviour before it existed). When set, only processes holding it take
  // part: the control store's values are signed and verified (SignedStore, signed_store.h, scope
  // "job <job_id>"), and every Gloo pair runs the pair handshake (pair_handshake.h) right after
  // the mesh connects, with either store. A process without it fails with MembershipError. This
  // is membership, not confidentiality: etcd's TLS client certificates protect the channel.
  std::string secret = {};
};

// Throws ConfigError when the options cannot form a valid prefix (no store: empty path and
// control endpoint; a control endpoint that is not http://; empty job id or '/' in it; negative
// generation; non-positive timeout).
void validate(const StoreOptions& options);

// Throws ConfigError unless `group_name` is non-empty and contains no '/'.
void validate_group_name(const std::string& group_name);

// The key prefix of one group of one generation: "<job_id>/<generation>/<group_name>" in a
// FileStore, "/tessel/<job_id>/rendezvous/<generation>/<group_name>" in the control store.
std::string store_prefix(const StoreOptions& options, const std::string& group_name);

// The rendezvous store of one group: a FileStore on options.path, or a ControlRendezvousStore
// (control_rendezvous.h) over an EtcdStore client of options.control_endpoint (inside a
// SignedStore when options.secret is set: a peer's entry made without it throws MembershipError
// naming its key), wrapped so every wait honours options.timeout and options.abort_signal, under
// a gloo::rendezvous::PrefixStore with store_prefix(options, group). Owns every layer; store()
// stays valid while this object lives.
class GroupStore {
 public:
  // Creates options.path if needed (FileStore only; the control store is reached lazily, at the
  // first call). Throws ConfigError for invalid options and IoError when the directory cannot be
  // created.
  GroupStore(const StoreOptions& options, const std::string& group_name);
  ~GroupStore();
  GroupStore(const GroupStore&) = delete;
  GroupStore& operator=(const GroupStore&) = delete;

  // The prefixed store the Communicator's rendezvous (full_mesh.h) runs on. Gloo exceptions from
  // it propagate unchanged (the Communicator maps them); a wait ended by the abort signal throws
  // gloo::IoException naming the keys and the signal's reason.
  gloo::rendezvous::Store& store();
  const std::string& prefix() const { return prefix_; }
  // Where the keys are, for messages: the FileStore's directory or the control store's endpoint.
  const std::string& location() const { return location_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::string prefix_;
  std::string location_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<ControlStore> control_;                  // the control store's client, if used
  std::unique_ptr<gloo::rendezvous::Store> base_store_;    // timed FileStore, or over *control_
  std::unique_ptr<gloo::rendezvous::Store> prefix_store_;  // refers to *base_store_
};

}  // namespace tessel::comm
