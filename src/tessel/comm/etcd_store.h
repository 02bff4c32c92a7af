// EtcdStore: the control store (control_store.h) on an etcd v3 server, through etcd's JSON
// gateway over plain HTTP (POST /v3/kv/..., /v3/lease/..., /v3/watch). It is what the processes of
// a multi-host job share: revisions are etcd's mod_revision, compare-and-set is a txn on it, and
// leases are etcd's leases (whole seconds; etcd erases their keys when they expire).
//
// Thread-safe: calls from several threads run on separate connections. Every HTTP call is bounded
// by the operation timeout given to the constructor; watch() and wait() by their own.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessel/comm/control_store.h"

namespace httplib {
class Client;
}

namespace tessel::comm {

// The environment variable naming the token file of a guarded embedded control store, for the
// EtcdStores a process makes without options (docs/security.md).
inline constexpr const char* kControlTokenFileEnv = "TESSEL_CONTROL_TOKEN_FILE";

struct EtcdStoreOptions {
  // Bounds every HTTP call (watch() and wait() have their own).
  std::chrono::milliseconds timeout = std::chrono::seconds(10);
  // A file holding the token of a StoreServer started with one (net/bearer_token.h): every
  // request then carries "Authorization: Bearer <token>". Empty: no token.
  std::string token_file;
};

class EtcdStore final : public ControlStore {
 public:
  // `endpoint`: etcd's client URL, "http://host:port". Connecting is lazy: the first call throws
  // PeerLostError when nothing answers there. Throws ConfigError for a malformed endpoint or a
  // token file that cannot be read or that others can read.
  EtcdStore(std::string endpoint, EtcdStoreOptions options);
  // As above, with the token file named by $TESSEL_CONTROL_TOKEN_FILE when it is set.
  explicit EtcdStore(std::string endpoint,
                     std::chrono::milliseconds timeout = std::chrono::seconds(10));
  ~EtcdStore() override;

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

  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Reply;
  // POSTs `body` (JSON text) to `path`, on an idle connection when `reuse` (else on a new one,
  // closed afterwards); throws PeerLostError when etcd cannot be reached.
  Reply post(const std::string& path, const std::string& body, bool reuse = true);
  // post() that also throws on an HTTP or etcd error; returns the reply's JSON text.
  std::string call(const std::string& path, const std::string& body, bool reuse = true);
  std::unique_ptr<httplib::Client> make_client(std::chrono::milliseconds read_timeout) const;

  const std::string endpoint_;
  const std::chrono::milliseconds timeout_;
  std::string token_;  // empty: none
  // Idle keep-alive connections: httplib::Client runs one request at a time.
  std::mutex mu_;
  std::vector<std::unique_ptr<httplib::Client>> idle_;
};

}  // namespace tessel::comm
