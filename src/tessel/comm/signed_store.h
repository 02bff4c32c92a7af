// SignedStore: a control store (control_store.h) whose values prove they were written by a member
// of the job -- a process holding the job's shared secret (the token file's bytes, read with
// net::read_token_file).
//
// Why. The control store is shared: one etcd serves a cluster's agents, each job's coordinator and
// workers, and possibly other jobs. etcd's TLS client certificates (docs/security.md) decide who
// may talk to etcd at all and protect the channel; they do not tell one job's processes from
// another's, nor an agent started with the cluster's token file from one started without it.
// This decorator closes that gap: every value written through it carries an HMAC-SHA256 under the
// secret, and every value read through it must carry a valid one. It is about membership, not
// confidentiality: values stay readable by anyone who can read etcd.
//
// The envelope: "tsig1.<hex HMAC-SHA256(secret, key + '\0' + value)>.<value>". The MAC covers the
// key, so a signed value copied to another key does not verify there (keys containing '\0' are
// refused on both sides, which keeps key + '\0' + value unambiguous). Not covered: a member's old
// value written back to the same key by someone who can write to etcd (a replay); etcd's access
// control is what stops that.
//
// What each call does with the envelope:
//   - set, compare_and_set: sign the value (compare_and_set compares revisions only, as before);
//   - get: verify and unwrap; a value that does not verify, or that has no envelope, throws
//     MembershipError naming the key, the scope and the fix;
//   - list, watch: skip entries that do not verify (erase events carry no value and pass through)
//     and report each skipped key once through the constructor's callback, so one foreign writer
//     cannot crash a coordinator that lists or watches a shared prefix. watch() keeps waiting
//     (within its timeout) when every event it got was skipped, and its revision moves past them;
//   - add: passes through unsigned. etcd's counters are decimal values that every client
//     increments in place, and a counter carries no content, only ids (the next host id, ...): a
//     foreign add can make ids skip numbers, which every counter user already tolerates (ids are
//     never reused, not dense). Such a counter cannot be read with get() (it is unsigned): read it
//     by adding 0. (No MAC stops a foreign writer from writing -- it can erase keys too --; the MAC
//     stops what it writes from being believed.);
//   - erase, revision, wait, leases: pass through (wait only waits for keys to exist; the read
//     that follows verifies).
// Thread-safe when the store it wraps is.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "tessel/comm/control_store.h"

namespace tessel::comm {

// HMAC-SHA256 of `message` under `key`: 32 raw bytes. The MAC of both membership proofs (this
// store's envelopes and the Communicator's pair handshake, pair_handshake.h).
std::string hmac_sha256(std::string_view key, std::string_view message);

// Whether `value` has the shape of a signed envelope (checked: the tag only, not the MAC). Lets a
// process without a secret say why a signed value makes no sense to it.
bool looks_signed(std::string_view value);

class SignedStore final : public ControlStore {
 public:
  // Told about each entry list() or watch() skipped, once per key: the key and the refusal (the
  // text get() would throw for it).
  using SkipReport = std::function<void(const std::string& key, const std::string& refusal)>;

  // Signs and verifies with `secret` (bytes, non-empty: ConfigError otherwise) over `inner`.
  // `scope` names whose secret it is in messages ("job j1", "cluster c"). Without `on_skip`, each
  // skipped key is logged as a warning.
  SignedStore(std::shared_ptr<ControlStore> inner, std::string secret, std::string scope,
              SkipReport on_skip = {});

  int64_t set(const std::string& key, const std::string& value, LeaseId lease = 0) override;
  std::optional<KeyValue> get(const std::string& key) override;
  std::optional<int64_t> compare_and_set(const std::string& key, int64_t expected_revision,
                                         const std::string& value, LeaseId lease = 0) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool erase(const std::string& key) override;
  std::vector<KeyValue> list(const std::string& prefix) override;
  int64_t revision() override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  WatchResult watch(const std::string& prefix, int64_t after,
                    std::chrono::milliseconds timeout) override;
  LeaseId grant_lease(std::chrono::milliseconds ttl) override;
  void keep_alive(LeaseId lease) override;
  void revoke(LeaseId lease) override;

  const std::string& scope() const { return scope_; }

 private:
  // The envelope of `value` at `key`.
  std::string seal(const std::string& key, const std::string& value) const;
  // The value inside `sealed` at `key`, or nothing with *refusal set to why it is refused.
  std::optional<std::string> open(const std::string& key, const std::string& sealed,
                                  std::string* refusal) const;
  // Unwraps kv's value in place; false (after reporting the key, once) when it does not verify.
  bool open_or_skip(KeyValue& kv);

  const std::shared_ptr<ControlStore> inner_;
  const std::string secret_;
  const std::string scope_;
  const SkipReport on_skip_;
  std::mutex mu_;
  std::set<std::string> reported_;  // keys skipped so far (each reported once)
};

}  // namespace tessel::comm
