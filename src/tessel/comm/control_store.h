// The control store: the key-value store the elastic control plane runs on (the coordinator's
// decisions, the workers' reports, the rendezvous of every process group), in the shape of
// etcd's v3 API and Gloo's rendezvous store.
//
// Every key has a revision: the store-wide counter at its last change (etcd's mod_revision).
// Compare-and-set compares it, so a writer that read a key can replace it only if nobody wrote
// in between. Watching is by revision: watch(prefix, after) returns the changes after revision
// `after`, in order, so a watcher that missed events (a lost connection, a slow reader) asks again
// from the last revision it saw and gets each change exactly once, never out of order. A key may
// be attached to a lease: it disappears when the lease expires (its holder stopped renewing it),
// which is how the store notices a dead process.
//
// Implementations: MemoryStore (memory_store.h; in one process, and what the embedded store
// serves) and the etcd client. Every call is bounded: the blocking ones take a timeout and throw
// TimeoutError naming what they waited for; a store that cannot be reached throws PeerLostError.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessel::comm {

using LeaseId = int64_t;  // 0: no lease

struct KeyValue {
  std::string key, value;
  int64_t revision = 0;  // the store's revision when the key last changed
  LeaseId lease = 0;
};

struct WatchEvent {
  enum class Kind { put, erase };
  Kind kind = Kind::put;
  KeyValue kv;  // for an erase: the key and the revision of the erase (value empty)
};

// What watch() returns: the events after the revision asked for, and the revision to ask from
// next: the newest event's, or when none came a revision from which asking again misses nothing
// (at least the one asked for; MemoryStore gives its current revision, etcd the one asked for,
// as a watch that started in the past may still deliver older events).
struct WatchResult {
  std::vector<WatchEvent> events;
  int64_t revision = 0;
};

// The value add() finds at `key`: the decimal integer in `value`. Throws CorruptDataError naming
// the key when it holds anything else (every store's add() reads counters this way).
int64_t parse_counter(const std::string& key, const std::string& value);

class ControlStore {
 public:
  virtual ~ControlStore() = default;

  // Sets `key` (attached to `lease` when non-zero; the lease must be alive) and returns the new
  // revision.
  virtual int64_t set(const std::string& key, const std::string& value, LeaseId lease = 0) = 0;
  virtual std::optional<KeyValue> get(const std::string& key) = 0;
  // Sets `key` only if its revision is `expected_revision` (0: only if the key does not exist).
  // Returns the new revision, or nothing when the key had another revision.
  virtual std::optional<int64_t> compare_and_set(const std::string& key, int64_t expected_revision,
                                                 const std::string& value, LeaseId lease = 0) = 0;
  // Adds `delta` to the decimal integer stored at `key` (absent: 0) and returns the result.
  // Throws CorruptDataError when the key holds something else.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Removes `key`; returns whether it existed.
  virtual bool erase(const std::string& key) = 0;
  // Every key starting with `prefix`, in key order.
  virtual std::vector<KeyValue> list(const std::string& prefix) = 0;
  // The store's current revision (every change increments it).
  virtual int64_t revision() = 0;

  // Waits until every key in `keys` exists. Throws TimeoutError naming the ones still missing.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // The changes to keys under `prefix` after revision `after`, waiting up to `timeout` for the
  // first one (an empty result when none came: not an error). Throws CorruptDataError when the
  // store no longer holds the history after `after` (it was compacted): re-read with list().
  virtual WatchResult watch(const std::string& prefix, int64_t after,
                            std::chrono::milliseconds timeout) = 0;

  // A lease that expires `ttl` after its last renewal; its keys are erased then.
  virtual LeaseId grant_lease(std::chrono::milliseconds ttl) = 0;
  // Renews the lease; throws PeerLostError when it has already expired (its keys are gone).
  virtual void keep_alive(LeaseId lease) = 0;
  // Ends the lease now and erases its keys (no error when it already expired).
  virtual void revoke(LeaseId lease) = 0;
};

}  // namespace tessel::comm
